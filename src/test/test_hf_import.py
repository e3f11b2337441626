"""Hugging Face import: tiny random Llama / OLMo-2 models built by transformers, imported here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_models import VOCAB, hf_config, hf_logits, hf_model, token_ids
from safetensors.torch import load_file

from olmolike.exceptions import ConfigurationError
from olmolike.nn import TransformerBlockType, export_hf, load_hf_model, transformer_config_from_hf
from olmolike.nn.hf_import import convert_from_hf, read_hf_tensors
from olmolike.nn.rope import RopeScalingConfig

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("arch", ["llama", "olmo2"])
@pytest.mark.parametrize("tie", [False, True])
def test_imported_model_reproduces_hf_logits(tmp_path: Path, arch: str, tie: bool) -> None:
    theirs = hf_model(arch, tie_word_embeddings=tie)
    theirs.save_pretrained(tmp_path)
    ours = load_hf_model(tmp_path).eval()
    config = ours.config
    assert (config.d_model, config.n_layers, config.n_heads, config.kv_heads) == (32, 2, 4, 2)
    assert (config.hidden_size, config.vocab_size, config.max_sequence_length) == (40, VOCAB, 64)
    assert (config.rope_theta, config.tie_weights) == (4321.0, tie)
    assert config.norm_eps == (1e-5 if arch == "llama" else 1e-6)
    assert config.qk_norm == (arch == "olmo2")
    olmo2 = TransformerBlockType.reordered_norm
    assert (config.block_type == olmo2) == (arch == "olmo2")
    if tie:
        assert ours.lm_head.weight is ours.embeddings.weight
    ids = token_ids()
    with torch.no_grad():
        got = ours(ids)
    assert (got - hf_logits(theirs, ids)).abs().max().item() <= 1e-5


LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 4321.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
}  # fmt: skip


def test_llama3_rope_scaling(tmp_path: Path) -> None:
    """Llama 3.1's scaled RoPE: imported, matches transformers, and exports back."""
    theirs = hf_model("llama", rope_parameters=dict(LLAMA3_ROPE))
    theirs.save_pretrained(tmp_path / "hf")
    ours = load_hf_model(tmp_path / "hf").eval()
    scaling = ours.config.rope_scaling
    assert scaling is not None
    assert (scaling.factor, scaling.original_max_sequence_length) == (8.0, 32)
    ids = token_ids()
    with torch.no_grad():
        got = ours(ids)
        unscaled = load_hf_model(tmp_path / "hf", rope_scaling=None)(ids)
    assert (got - hf_logits(theirs, ids)).abs().max().item() <= 1e-5
    assert (unscaled - got).abs().max().item() > 1e-3  # the scaling does change the model
    export_hf(ours.state_dict(), ours.config, tmp_path / "out")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert (got - hf_logits(again, ids)).abs().max().item() <= 1e-5


def test_sharded_safetensors_with_an_index(tmp_path: Path) -> None:
    theirs = hf_model("olmo2")
    theirs.save_pretrained(tmp_path, max_shard_size="20KB")
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "model.safetensors.index.json").exists()
    assert not (tmp_path / "model.safetensors").exists()
    ours = load_hf_model(tmp_path).eval()
    ids = token_ids()
    with torch.no_grad():
        assert (ours(ids) - hf_logits(theirs, ids)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("arch", ["llama", "olmo2"])
def test_export_import_export_is_bit_identical(tmp_path: Path, arch: str) -> None:
    hf_model(arch, tie_word_embeddings=arch == "olmo2").save_pretrained(tmp_path / "hf")
    model = load_hf_model(tmp_path / "hf")
    export_hf(model.state_dict(), model.config, tmp_path / "a")
    again = load_hf_model(tmp_path / "a")
    export_hf(again.state_dict(), again.config, tmp_path / "b")
    first, second = (load_file(tmp_path / d / "model.safetensors") for d in ("a", "b"))
    original = load_file(tmp_path / "hf" / "model.safetensors")
    assert first.keys() == second.keys() == original.keys()
    for name, tensor in first.items():
        assert torch.equal(tensor, second[name]) and torch.equal(tensor, original[name]), name
    assert json.loads((tmp_path / "a/config.json").read_text()) == json.loads(
        (tmp_path / "b/config.json").read_text()
    )


def test_sharded_export_round_trips(tmp_path: Path) -> None:
    hf_model("llama").save_pretrained(tmp_path / "hf")
    model = load_hf_model(tmp_path / "hf")
    export_hf(model.state_dict(), model.config, tmp_path / "out", max_shard_bytes=16_000)
    index = json.loads((tmp_path / "out/model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    again = load_hf_model(tmp_path / "out")
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[name]), name
    ids = token_ids()
    with torch.no_grad():
        assert (model(ids) - hf_logits(theirs, ids)).abs().max().item() <= 1e-5
    # Re-exporting as one file replaces the shards rather than leaving them beside it.
    export_hf(model.state_dict(), model.config, tmp_path / "out", overwrite=True)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]


def test_dtype_is_kept_unless_asked(tmp_path: Path) -> None:
    hf_model("llama").to(torch.bfloat16).save_pretrained(tmp_path)
    assert load_hf_model(tmp_path).embeddings.weight.dtype == torch.bfloat16
    model = load_hf_model(tmp_path, dtype=torch.float32, max_sequence_length=16)
    assert model.lm_head.weight.dtype == torch.float32 and model.rope.cos.shape[0] == 16
    assert model.rope.cos.dtype == torch.float32


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}, "MixtralForCausal"),
        ({"architectures": ["Qwen2ForCausalLM"]}, "LlamaForCausalLM, Olmo2ForCausalLM"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic'"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "'yarn'"),
        ({"attention_bias": True}, "attention_bias=true"),
        ({"mlp_bias": True}, "mlp_bias=true"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"head_dim": 16}, "head_dim=16"),
    ],
)
def test_unsupported_configs_are_refused(change: dict[str, Any], match: str) -> None:
    hf = hf_config("llama").to_dict() | change
    with pytest.raises(ConfigurationError, match=match) as error:
        transformer_config_from_hf(hf)
    assert "LlamaForCausalLM" in str(error.value)  # names what is supported


def test_unsupported_architecture_folder(tmp_path: Path) -> None:
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=VOCAB)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    with pytest.raises(ConfigurationError, match="unsupported Hugging Face architecture GPT2"):
        load_hf_model(tmp_path)


def test_raw_config_defaults_follow_transformers() -> None:
    """A config.json without eps / theta / max positions means transformers' defaults."""
    minimal = dict(
        vocab_size=10, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
        num_attention_heads=2,
    )  # fmt: skip
    llama = transformer_config_from_hf({"architectures": ["LlamaForCausalLM"], **minimal})
    olmo2 = transformer_config_from_hf({"model_type": "olmo2", **minimal})
    assert (llama.norm_eps, olmo2.norm_eps) == (1e-6, 1e-5)
    assert llama.rope_theta == olmo2.rope_theta == 10_000.0
    assert llama.max_sequence_length == 2048 and llama.n_kv_heads is None


def test_missing_and_misshapen_tensors_are_named(tmp_path: Path) -> None:
    hf_model("olmo2").save_pretrained(tmp_path)
    config = load_hf_model(tmp_path).config
    tensors = read_hf_tensors(tmp_path)
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    with pytest.raises(ConfigurationError, match=r"missing: \['model.layers.1.self_attn.k_norm"):
        convert_from_hf(tensors, config)
    tensors = read_hf_tensors(tmp_path)
    tensors["model.norm.weight"] = torch.ones(5)
    with pytest.raises(ConfigurationError, match=r"wrong shape: \['model.norm.weight \(5,\)"):
        convert_from_hf(tensors, config)


def test_folder_without_weights_or_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"no config\.json"):
        load_hf_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(hf_config("llama").to_dict()))
    with pytest.raises(ConfigurationError, match="safetensors"):
        load_hf_model(tmp_path)


def test_rope_scaling_config_is_validated() -> None:
    with pytest.raises(ConfigurationError, match="high_freq_factor"):
        RopeScalingConfig(low_freq_factor=4.0, high_freq_factor=1.0)
    with pytest.raises(ConfigurationError, match="factor"):
        RopeScalingConfig(factor=0.5)
