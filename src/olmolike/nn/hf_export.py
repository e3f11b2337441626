"""Export a :class:`~olmolike.nn.Transformer` as a Hugging Face ``LlamaForCausalLM`` checkpoint.

Our blocks are Llama blocks (pre-norm, SwiGLU, rotate-half RoPE, no biases), so the export is
a rename of tensors plus a ``config.json``; no weight is permuted or changed. The result loads
with ``transformers.LlamaForCausalLM.from_pretrained(output_dir)`` and gives the same logits.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from .. import io
from ..exceptions import ConfigurationError
from .transformer import Transformer, TransformerConfig

__all__ = ["convert_to_hf_llama", "export_hf_llama", "hf_llama_config"]

log = logging.getLogger(__name__)

# Per-block tensor names: ours (under ``blocks.{i}.``) -> Hugging Face's (under
# ``model.layers.{i}.``).
_BLOCK_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.w_q.weight": "self_attn.q_proj.weight",
    "attention.w_k.weight": "self_attn.k_proj.weight",
    "attention.w_v.weight": "self_attn.v_proj.weight",
    "attention.w_out.weight": "self_attn.o_proj.weight",
    "feed_forward_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w_gate.weight": "mlp.gate_proj.weight",
    "feed_forward.w_up.weight": "mlp.up_proj.weight",
    "feed_forward.w_down.weight": "mlp.down_proj.weight",
}

_TOP_NAMES = {
    "embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def convert_to_hf_llama(
    state_dict: Mapping[str, Tensor], config: TransformerConfig
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Rename ``model.state_dict()`` to Llama tensor names; also return the HF ``config.json``.

    The mapping (``i`` is the block index)::

        embeddings.weight                      -> model.embed_tokens.weight
        blocks.i.attention_norm.weight         -> model.layers.i.input_layernorm.weight
        blocks.i.attention.w_{q,k,v}.weight    -> model.layers.i.self_attn.{q,k,v}_proj.weight
        blocks.i.attention.w_out.weight        -> model.layers.i.self_attn.o_proj.weight
        blocks.i.feed_forward_norm.weight      -> model.layers.i.post_attention_layernorm.weight
        blocks.i.feed_forward.w_gate.weight    -> model.layers.i.mlp.gate_proj.weight
        blocks.i.feed_forward.w_up.weight      -> model.layers.i.mlp.up_proj.weight
        blocks.i.feed_forward.w_down.weight    -> model.layers.i.mlp.down_proj.weight
        norm.weight                            -> model.norm.weight
        lm_head.weight                         -> lm_head.weight  (left out when tied)

    ``state_dict`` must hold full (unsharded) tensors: gather an FSDP model's state first
    (``get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))``). The
    returned tensors are contiguous views or copies, never shared, as safetensors requires.
    """
    _check_representable(config)
    _check_matches(state_dict, config)
    tensors: dict[str, Tensor] = {}
    for ours, theirs in _hf_names(config).items():
        tensor = state_dict[ours]
        if isinstance(tensor, DTensor):
            raise ConfigurationError(
                f"{ours} is a sharded DTensor; gather a full state dict first "
                "(StateDictOptions(full_state_dict=True)) to export an FSDP model"
            )
        tensors[theirs] = tensor.detach().contiguous()
    return tensors, hf_llama_config(config, dtype=state_dict["embeddings.weight"].dtype)


def _check_representable(config: TransformerConfig) -> None:
    if config.qk_norm:
        raise ConfigurationError(
            "a model with QK-norm cannot be represented as LlamaForCausalLM (Llama has no "
            "q/k norm); train with qk_norm=False to export it to Llama",
            path="qk_norm",
        )


def _check_matches(state_dict: Mapping[str, Tensor], config: TransformerConfig) -> None:
    """Names and shapes must be those of a model built from ``config`` (checked on meta)."""
    with torch.device("meta"):
        expected = {name: t.shape for name, t in Transformer(config).state_dict().items()}
    optional = {"lm_head.weight"} if config.tie_weights else set()
    missing = sorted(set(expected) - set(state_dict) - optional)
    unexpected = sorted(set(state_dict) - set(expected))
    wrong_shape = [
        f"{name} {tuple(state_dict[name].shape)} != {tuple(shape)}"
        for name, shape in expected.items()
        if name in state_dict and state_dict[name].shape != shape
    ]
    if missing or unexpected or wrong_shape:
        raise ConfigurationError(
            "the state dict does not match the TransformerConfig (missing: "
            f"{missing or 'none'}; unexpected: {unexpected or 'none'}; wrong shape: "
            f"{wrong_shape or 'none'}); pass model.state_dict() of a model built from this config"
        )


def _hf_names(config: TransformerConfig) -> dict[str, str]:
    names = {
        f"blocks.{i}.{ours}": f"model.layers.{i}.{theirs}"
        for i in range(config.n_layers)
        for ours, theirs in _BLOCK_NAMES.items()
    }
    names |= _TOP_NAMES
    if config.tie_weights:
        # Hugging Face stores a tied embedding once and re-ties lm_head when loading.
        del names["lm_head.weight"]
    return names


def hf_llama_config(
    config: TransformerConfig,
    *,
    dtype: torch.dtype = torch.float32,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> dict[str, Any]:
    """The ``config.json`` of a ``LlamaForCausalLM`` with the shape of ``config``."""
    _check_representable(config)
    if dtype not in _DTYPE_NAMES:
        raise ConfigurationError(
            f"cannot export weights of dtype {dtype}; cast them to one of "
            f"{', '.join(_DTYPE_NAMES.values())}"
        )
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.hidden_size,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_sequence_length,
        "rms_norm_eps": config.norm_eps,
        # transformers < 5 reads rope_theta; 5 reads rope_parameters (and converts the former).
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": config.tie_weights,
        "initializer_range": config.init_std,
        "torch_dtype": _DTYPE_NAMES[dtype],
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
    }


def export_hf_llama(
    state_dict: Mapping[str, Tensor],
    config: TransformerConfig,
    output_dir: str | Path,
    *,
    overwrite: bool = False,
    eos_token_id: int | None = None,
    bos_token_id: int | None = None,
) -> Path:
    """Write ``model.safetensors`` and ``config.json`` for ``LlamaForCausalLM`` to ``output_dir``.

    Refuses to replace either file unless ``overwrite``; the check runs before anything is
    written, so a refused export leaves the directory as it was. Each file is written
    atomically. Tokenizer files are not written: copy your tokenizer's next to them.
    """
    if io.is_url(output_dir):
        raise ConfigurationError(
            f"export_hf_llama writes a local directory, got {output_dir}; export locally, then "
            "upload the directory (olmolike.io.persist copies it to gs:// or s3://)"
        )
    out = io.local_path(output_dir)
    files = ("model.safetensors", "config.json")
    existing = [name for name in files if (out / name).exists()]
    if existing and not overwrite:
        raise FileExistsError(
            f"{out} already holds {', '.join(existing)}; pass overwrite=True (--overwrite) "
            "to replace them"
        )
    tensors, hf_config = convert_to_hf_llama(state_dict, config)
    hf_config |= {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id}
    weights = safetensors.torch.save(
        {name: t.cpu() for name, t in tensors.items()}, metadata={"format": "pt"}
    )
    io.write_file(out, "model.safetensors", weights, overwrite=overwrite)
    io.write_file(out, "config.json", json.dumps(hf_config, indent=2) + "\n", overwrite=overwrite)
    log.info("exported a LlamaForCausalLM checkpoint to %s", out)
    return out
