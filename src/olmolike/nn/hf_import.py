"""Import a Hugging Face checkpoint (``LlamaForCausalLM``, ``Olmo2ForCausalLM`` or
``OlmoeForCausalLM``).

A Hugging Face model folder holds ``config.json`` and its weights as ``model.safetensors``, or
as several ``model-0000i-of-0000n.safetensors`` listed in ``model.safetensors.index.json``.
The folder may be local or remote (``gs://``, ``s3://``, anything :mod:`olmolike.io` reads).
:func:`transformer_config_from_hf` maps ``config.json`` onto a :class:`TransformerConfig`,
refusing what our model cannot compute (other architectures, RoPE scaling, biases, ...) with
a :class:`~olmolike.exceptions.ConfigurationError`; :func:`convert_from_hf` renames the
tensors (the inverse of :func:`olmolike.nn.hf_export.convert_to_hf`). Nothing here imports
``transformers``.
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

from .. import io
from ..exceptions import ConfigurationError
from .hf_export import (
    CONFIG_NAME,
    INDEX_NAME,
    WEIGHTS_NAME,
    HFArchitecture,
    hf_architecture,
    hf_tensor_names,
)
from .hf_moe import expert_tensors_from_hf
from .moe import MoEConfig
from .rope import RopeScalingConfig
from .transformer import Transformer, TransformerBlockType
from .transformer_config import TransformerConfig

__all__ = [
    "convert_from_hf",
    "is_hf_model_dir",
    "load_hf_model",
    "read_hf_config",
    "read_hf_tensors",
    "transformer_config_from_hf",
]

log = logging.getLogger(__name__)

# What transformers assumes for keys a config.json leaves out (LlamaConfig / Olmo2Config /
# OlmoeConfig).
_DEFAULTS: dict[HFArchitecture, dict[str, Any]] = {
    HFArchitecture.llama: {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048},
    HFArchitecture.olmo2: {"rms_norm_eps": 1e-5, "max_position_embeddings": 2048},
    HFArchitecture.olmoe: {
        "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "num_experts": 64,
        "num_experts_per_tok": 8, "norm_topk_prob": False, "router_aux_loss_coef": 0.01,
    },
}  # fmt: skip
_DEFAULT_ROPE_THETA = 10_000.0

# Options that change the computation; our model has only their default (off) value.
_UNSUPPORTED_FLAGS = ("attention_bias", "mlp_bias")


def _supported() -> str:
    return ", ".join(a.value for a in HFArchitecture)


def transformer_config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> TransformerConfig:
    """The :class:`TransformerConfig` of a Hugging Face ``config.json`` (as a dict).

    ``overrides`` replace fields afterwards (e.g. a shorter ``max_sequence_length``).
    :raises ConfigurationError: naming the unsupported architecture or option.
    """
    architecture = _architecture(hf)
    values = {**_DEFAULTS[architecture], **hf}
    get = values.get

    def need(key: str) -> Any:
        if values.get(key) is None:
            raise ConfigurationError(f"the Hugging Face config.json has no {key!r}")
        return values[key]

    n_heads, d_model = int(need("num_attention_heads")), int(need("hidden_size"))
    _check_supported(hf, architecture, d_model, n_heads)
    n_kv_heads = get("num_key_value_heads")
    olmo2 = architecture == HFArchitecture.olmo2
    moe = None
    if architecture == HFArchitecture.olmoe:
        moe = MoEConfig(
            num_experts=int(get("num_local_experts") or need("num_experts")),
            top_k=int(need("num_experts_per_tok")),
            hidden_size=int(need("intermediate_size")),
            normalize_top_k=bool(get("norm_topk_prob")),
            load_balancing_loss_coefficient=float(need("router_aux_loss_coef")),
        )
    config = TransformerConfig(
        vocab_size=int(need("vocab_size")),
        d_model=d_model,
        n_layers=int(need("num_hidden_layers")),
        n_heads=n_heads,
        n_kv_heads=None if n_kv_heads is None or n_kv_heads == n_heads else int(n_kv_heads),
        mlp_hidden_size=int(need("intermediate_size")),
        max_sequence_length=int(need("max_position_embeddings")),
        rope_theta=float(_rope(hf)["rope_theta"]),
        rope_scaling=_rope_scaling(hf),
        norm_eps=float(need("rms_norm_eps")),
        qk_norm=architecture in (HFArchitecture.olmo2, HFArchitecture.olmoe),
        tie_weights=bool(get("tie_word_embeddings", False)),
        block_type=TransformerBlockType.reordered_norm if olmo2 else TransformerBlockType.default,
        init_std=float(get("initializer_range", 0.02)),
        moe=moe,
    )
    return config.replace(**overrides) if overrides else config


def _architecture(hf: Mapping[str, Any]) -> HFArchitecture:
    names = hf.get("architectures") or []
    for name in names:
        if name in {a.value for a in HFArchitecture}:
            return HFArchitecture(name)
    by_type = {
        "llama": HFArchitecture.llama,
        "olmo2": HFArchitecture.olmo2,
        "olmoe": HFArchitecture.olmoe,
    }
    if not names and hf.get("model_type") in by_type:
        return by_type[hf["model_type"]]
    found = ", ".join(names) or f"model_type {hf.get('model_type')!r}"
    raise ConfigurationError(
        f"unsupported Hugging Face architecture {found}; olmolike imports {_supported()} "
        "(convert the model to one of them, or train from scratch)"
    )


def _rope(hf: Mapping[str, Any]) -> dict[str, Any]:
    # transformers 5 writes rope_parameters; older versions rope_theta and rope_scaling. Like
    # transformers, a rope_scaling wins when both are there.
    rope = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    rope.setdefault("rope_type", rope.get("type", "default"))
    rope.setdefault("rope_theta", hf.get("rope_theta", _DEFAULT_ROPE_THETA))
    return rope


def _rope_scaling(hf: Mapping[str, Any]) -> RopeScalingConfig | None:
    rope = _rope(hf)
    if rope["rope_type"] != "llama3":
        return None
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if k not in rope]
    if missing:
        raise ConfigurationError(f"the llama3 RoPE scaling in config.json lacks {missing}")
    # Like transformers, the pretraining context defaults to max_position_embeddings.
    original = rope.get("original_max_position_embeddings") or hf.get("max_position_embeddings")
    return RopeScalingConfig(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_sequence_length=int(
            original or _DEFAULTS[HFArchitecture.llama]["max_position_embeddings"]
        ),
    )


def _check_supported(
    hf: Mapping[str, Any], architecture: HFArchitecture, d_model: int, n_heads: int
) -> None:
    def refuse(what: str) -> ConfigurationError:
        return ConfigurationError(
            f"the {architecture.value} config has {what}, which olmolike's transformer does not "
            f"implement; it imports {_supported()} with default or llama3 RoPE, no biases, SiLU "
            "MLPs and head_dim = hidden_size / num_attention_heads"
        )

    rope = _rope(hf)
    if rope["rope_type"] not in ("default", "llama3"):
        raise refuse(
            f"RoPE scaling of type {rope['rope_type']!r} (only 'default' and 'llama3' are "
            "supported)"
        )
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise refuse(f"partial_rotary_factor={rope['partial_rotary_factor']}")
    for flag in _UNSUPPORTED_FLAGS:
        if hf.get(flag):
            raise refuse(f"{flag}=true")
    if hf.get("clip_qkv") is not None:
        raise refuse(f"clip_qkv={hf['clip_qkv']} (q, k and v clamped)")
    if hf.get("hidden_act", "silu") != "silu":
        raise refuse(f"hidden_act={hf['hidden_act']!r} (only 'silu')")
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim * n_heads != d_model:
        raise refuse(f"head_dim={head_dim} != hidden_size / num_attention_heads")


def is_hf_model_dir(path: str | Path) -> bool:
    """Whether ``path`` holds a ``config.json`` and safetensors weights (single or sharded)."""
    return io.exists(io.join_path(path, CONFIG_NAME)) and (
        io.exists(io.join_path(path, WEIGHTS_NAME)) or io.exists(io.join_path(path, INDEX_NAME))
    )


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The ``config.json`` of the Hugging Face model folder ``path``."""
    config_path = io.join_path(path, CONFIG_NAME)
    if not io.exists(config_path):
        raise ConfigurationError(
            f"{path} has no {CONFIG_NAME}: pass a Hugging Face model folder (the directory "
            "save_pretrained wrote, holding config.json and *.safetensors)"
        )
    return dict(json.loads(io.read_bytes(config_path)))


def read_hf_tensors(
    path: str | Path, *, download_dir: str | Path | None = None
) -> dict[str, Tensor]:
    """Every tensor of the folder's safetensors weights, under Hugging Face's names.

    Local files are memory-mapped. Remote files are read into memory, or with
    ``download_dir`` downloaded there first (and memory-mapped), which needs half the memory.
    """
    files = _weight_files(path)
    tensors: dict[str, Tensor] = {}
    for name in files:
        source = io.join_path(path, name)
        if io.is_url(source) and download_dir is not None:
            local = Path(download_dir) / name
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_bytes(io.read_bytes(source))
            source = str(local)
        if io.is_url(source):
            tensors |= safetensors.torch.load(io.read_bytes(source))
        else:
            tensors |= safetensors.torch.load_file(str(io.local_path(source)))
    return tensors


def _weight_files(path: str | Path) -> list[str]:
    if io.exists(io.join_path(path, WEIGHTS_NAME)):
        return [WEIGHTS_NAME]
    index_path = io.join_path(path, INDEX_NAME)
    if io.exists(index_path):
        weight_map = json.loads(io.read_bytes(index_path)).get("weight_map", {})
        return sorted(set(weight_map.values()))
    raise ConfigurationError(
        f"{path} holds no {WEIGHTS_NAME} nor {INDEX_NAME}; olmolike reads safetensors weights "
        "only (re-save a PyTorch .bin checkpoint with save_pretrained(safe_serialization=True))"
    )


def convert_from_hf(
    hf_tensors: Mapping[str, Tensor], config: TransformerConfig
) -> dict[str, Tensor]:
    """Rename Hugging Face tensors to our ``state_dict`` names (both tied names when tied).

    :raises ConfigurationError: listing missing, unexpected and wrongly shaped tensors.
    """
    names = hf_tensor_names(config)
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in Transformer(config).state_dict().items()}
    # Checkpoints of older transformers versions carry the RoPE frequencies, a pure function of
    # the config; a tied checkpoint may also store the head it ties.
    ignorable = {n for n in hf_tensors if n.endswith("rotary_emb.inv_freq")}
    if config.tie_weights:
        ignorable.add("lm_head.weight")
    missing = sorted(theirs for theirs in names.values() if theirs not in hf_tensors)
    state = {ours: hf_tensors[theirs] for ours, theirs in names.items() if theirs in hf_tensors}
    expected = set(names.values())
    if config.moe is not None:
        moe_layers = [i for i in range(config.n_layers) if config.is_moe_layer(i)]
        experts, used, absent = expert_tensors_from_hf(
            hf_tensors, moe_layers, config.moe.num_experts
        )
        state |= experts
        expected |= used
        missing += absent
    unexpected = sorted(set(hf_tensors) - expected - ignorable)
    wrong = [
        f"{names[ours]} {tuple(t.shape)} != {tuple(shapes[ours])}"
        for ours, t in state.items()
        if t.shape != shapes[ours]
    ]
    if missing or unexpected or wrong:
        raise ConfigurationError(
            "the Hugging Face weights do not match their config.json (missing: "
            f"{missing[:8] or 'none'}; unexpected: {unexpected[:8] or 'none'}; wrong shape: "
            f"{wrong[:8] or 'none'}); the folder is incomplete or not a "
            f"{hf_architecture_name(config)} checkpoint"
        )
    if config.tie_weights:
        state["lm_head.weight"] = state["embeddings.weight"]
    return state


def hf_architecture_name(config: TransformerConfig) -> str:
    return hf_architecture(config).value


def load_hf_model(
    path: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    download_dir: str | Path | None = None,
    **overrides: Any,
) -> Transformer:
    """A :class:`Transformer` with the shape and weights of the Hugging Face folder ``path``.

    The weights keep their stored dtype unless ``dtype`` is given; ``overrides`` change config
    fields that do not affect the weights' shapes (e.g. ``max_sequence_length``).
    """
    config = transformer_config_from_hf(read_hf_config(path), **overrides)
    state = convert_from_hf(read_hf_tensors(path, download_dir=download_dir), config)
    model = config.build(init_device="meta")
    # assign=True adopts the loaded tensors instead of copying them into fresh memory.
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_weights:
        model.lm_head.weight = model.embeddings.weight
    model.rope.reset_buffers(torch.device("cpu"))  # the tables are not in the state dict
    model.to(device=device, dtype=dtype)
    log.info("loaded %s from %s", hf_architecture_name(config), path)
    return model
