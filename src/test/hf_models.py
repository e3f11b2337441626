"""Tiny random Hugging Face Llama / OLMo-2 / OLMoE models, built from a config (no download)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

VOCAB = 67


def hf_config(arch: str, **overrides: Any) -> Any:
    """rope_theta and the norm eps differ from transformers' defaults on purpose."""
    transformers = pytest.importorskip("transformers")
    fields: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5 if arch == "llama" else 1e-6, rope_theta=4321.0, pad_token_id=None,
        bos_token_id=None, eos_token_id=VOCAB - 1,
    )  # fmt: skip
    if arch == "olmoe":  # 8 experts of width 16, top-2
        fields |= dict(intermediate_size=16, num_experts=8, num_experts_per_tok=2)
    fields |= overrides
    if arch == "llama":
        return transformers.LlamaConfig(**fields)
    if arch == "olmoe":
        return transformers.OlmoeConfig(**fields)
    return transformers.Olmo2Config(**fields)


def hf_model(arch: str, seed: int = 0, **overrides: Any) -> Any:
    """A random ``LlamaForCausalLM``, ``Olmo2ForCausalLM`` or ``OlmoeForCausalLM`` in eval mode.

    Norm weights are randomised too (they start at 1), so a norm in the wrong place (pre-norm
    vs OLMo-2's reordered norm) cannot go unnoticed.
    """
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = hf_config(arch, **overrides)
    classes = {
        "llama": "LlamaForCausalLM",
        "olmo2": "Olmo2ForCausalLM",
        "olmoe": "OlmoeForCausalLM",
    }
    cls = getattr(transformers, classes[arch])
    model = cls(config).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.5 * torch.rand(param.shape, generator=generator))
    return model


def save_hf_model(path: Path, arch: str, seed: int = 0, **overrides: Any) -> Any:
    model = hf_model(arch, seed, **overrides)
    model.save_pretrained(path)
    return model


def hf_logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def token_ids(seq_len: int = 48, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (2, seq_len), generator=torch.Generator().manual_seed(3))
