"""The Hugging Face export: transformers loads it and computes the same logits as we do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from olmolike.exceptions import ConfigurationError
from olmolike.nn import (
    TransformerBlockType,
    TransformerConfig,
    TransformerPreset,
    convert_to_hf,
    export_hf,
)


def config(**overrides: object) -> TransformerConfig:
    # rope_theta and norm_eps differ from transformers' defaults, so a config.json that failed
    # to carry them would change the logits.
    fields: dict[str, object] = dict(
        vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden_size=40,
        max_sequence_length=32, rope_theta=1234.0, norm_eps=1e-5,
    )  # fmt: skip
    return TransformerConfig(**{**fields, **overrides})  # type: ignore[arg-type]


def randomised(model: torch.nn.Module) -> torch.nn.Module:
    """Norm weights start at 1; make them random too so a misplaced norm cannot go unnoticed."""
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.5 * torch.rand(param.shape, generator=generator))
    return model


@pytest.mark.parametrize("tie", [False, True])
def test_transformers_reproduces_our_logits(tmp_path: Path, tie: bool) -> None:
    transformers = pytest.importorskip("transformers")
    ours_config = config(tie_weights=tie)
    model = randomised(ours_config.build(seed=0)).eval()
    out = export_hf(model.state_dict(), ours_config, tmp_path / "hf", eos_token_id=60)
    assert out == tmp_path / "hf"

    theirs = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert theirs.config.tie_word_embeddings == tie
    assert theirs.config.eos_token_id == 60
    ids = torch.randint(0, 61, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids)
        got = theirs(ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_tied_weights_are_stored_once(tmp_path: Path) -> None:
    tied = config(tie_weights=True)
    export_hf(tied.build(seed=0).state_dict(), tied, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    assert "lm_head.weight" not in tensors
    assert tensors["model.embed_tokens.weight"].shape == (61, 32)
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is True


def test_config_json_describes_the_shape() -> None:
    ours = config(n_kv_heads=1, max_sequence_length=64)
    model = ours.build(seed=0).to(torch.bfloat16)
    tensors, hf = convert_to_hf(model.state_dict(), ours)
    assert hf["architectures"] == ["LlamaForCausalLM"]
    assert (hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"]) == (32, 40, 2)
    assert (hf["num_attention_heads"], hf["num_key_value_heads"]) == (4, 1)
    assert (hf["rope_theta"], hf["rms_norm_eps"], hf["max_position_embeddings"]) == (
        1234.0, 1e-5, 64,
    )  # fmt: skip
    assert (hf["vocab_size"], hf["torch_dtype"], hf["tie_word_embeddings"]) == (
        61,
        "bfloat16",
        False,
    )
    assert tensors["model.layers.1.self_attn.k_proj.weight"].shape == (8, 32)
    assert len(tensors) == 2 * 9 + 3
    json.dumps(hf)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"qk_norm": True}, "qk_norm=False for Llama"),
        ({"block_type": "reordered_norm"}, "set qk_norm=True"),
    ],
)
def test_blocks_without_a_hf_class_are_refused(overrides: dict[str, object], match: str) -> None:
    ours = config(**overrides)
    with pytest.raises(ConfigurationError, match=match):
        convert_to_hf(ours.build(init_device="meta").state_dict(), ours)


@pytest.mark.parametrize("preset", list(TransformerPreset))
def test_every_preset_exports_to_its_architecture(tmp_path: Path, preset: str) -> None:
    """Each preset's block (norm placement, QK-norm, GQA, theta, eps) at a tiny size."""
    transformers = pytest.importorskip("transformers")
    shape = dict(d_model=32, n_layers=2, n_heads=4, mlp_hidden_size=40, max_sequence_length=32)
    full = TransformerConfig.from_preset(preset, 61)
    if full.n_kv_heads is not None:
        shape["n_kv_heads"] = 2
    ours_config = TransformerConfig.from_preset(preset, 61, **shape)
    model = randomised(ours_config.build(seed=0)).eval()
    export_hf(model.state_dict(), ours_config, tmp_path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    olmo2 = ours_config.block_type == TransformerBlockType.reordered_norm
    moe = ours_config.moe is not None
    assert preset.startswith("olmo2") == olmo2 and (olmo2 or moe) == ours_config.qk_norm
    expected_class = "Olmo2ForCausalLM" if olmo2 else "LlamaForCausalLM"
    if moe:
        expected_class = "OlmoeForCausalLM"
    assert type(theirs).__name__ == expected_class
    ids = torch.randint(0, 61, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (model(ids) - theirs.eval()(ids).logits).abs().max().item()
    assert diff <= 1e-5


def test_refuses_to_overwrite_without_permission(tmp_path: Path) -> None:
    ours = config()
    state = ours.build(seed=0).state_dict()
    export_hf(state, ours, tmp_path)
    before = (tmp_path / "model.safetensors").read_bytes()
    other = ours.build(seed=1).state_dict()
    with pytest.raises(FileExistsError, match="overwrite=True"):
        export_hf(other, ours, tmp_path)
    assert (tmp_path / "model.safetensors").read_bytes() == before
    export_hf(other, ours, tmp_path, overwrite=True)
    assert (tmp_path / "model.safetensors").read_bytes() != before


def test_state_dict_must_match_the_config() -> None:
    ours = config()
    state = ours.build(seed=0).state_dict()
    with pytest.raises(ConfigurationError, match=r"missing: \['norm.weight'\]"):
        convert_to_hf({k: v for k, v in state.items() if k != "norm.weight"}, ours)
    with pytest.raises(ConfigurationError, match="wrong shape"):
        convert_to_hf(state, config(vocab_size=62))
    with pytest.raises(ConfigurationError, match="unexpected"):
        convert_to_hf({**state, "extra.weight": torch.zeros(1)}, ours)


def test_urls_are_refused(tmp_path: Path) -> None:
    ours = config()
    with pytest.raises(ConfigurationError, match="local directory"):
        export_hf(ours.build(init_device="meta").state_dict(), ours, "s3://bucket/model")
