"""Export a :class:`~olmolike.nn.Transformer` as a Hugging Face checkpoint.

A model with Llama blocks (pre-norm, no QK-norm) becomes a ``LlamaForCausalLM``; one with
OLMo-2 blocks (``block_type="reordered_norm"`` and ``qk_norm=True``, as every ``olmo2_*``
preset) becomes an ``Olmo2ForCausalLM``; a mixture of experts in every layer with pre-norm
blocks and QK-norm (the ``olmoe_1B_7B`` preset) an ``OlmoeForCausalLM``. They share our RoPE
convention, SwiGLU and the absence of biases, so the export is a rename of tensors (OLMoE's
experts also split into one matrix each, transposed: :mod:`olmolike.nn.hf_moe`) plus a
``config.json``: no value changes, and ``transformers``' ``AutoModelForCausalLM.from_pretrained``
computes the same logits. :mod:`olmolike.nn.hf_import` is the inverse.
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
from ..config import StrEnum
from ..exceptions import ConfigurationError
from .hf_moe import expert_tensors_to_hf
from .transformer import Transformer, TransformerBlockType
from .transformer_config import TransformerConfig

__all__ = [
    "HFArchitecture",
    "convert_to_hf",
    "export_hf",
    "hf_architecture",
    "hf_config",
    "hf_tensor_names",
]

log = logging.getLogger(__name__)


class HFArchitecture(StrEnum):
    """The Hugging Face model classes a :class:`Transformer` can be written as."""

    llama = "LlamaForCausalLM"
    olmo2 = "Olmo2ForCausalLM"
    olmoe = "OlmoeForCausalLM"


MODEL_TYPES = {
    HFArchitecture.llama: "llama",
    HFArchitecture.olmo2: "olmo2",
    HFArchitecture.olmoe: "olmoe",
}

# Per-block tensor names, ours (under ``blocks.{i}.``) -> Hugging Face's (under
# ``model.layers.{i}.``). Llama normalises the inputs of attention and MLP, OLMo-2 their outputs:
# the same two norms of ours, under the names of where they sit.
_ATTENTION_NAMES = {
    "attention.w_q.weight": "self_attn.q_proj.weight",
    "attention.w_k.weight": "self_attn.k_proj.weight",
    "attention.w_v.weight": "self_attn.v_proj.weight",
    "attention.w_out.weight": "self_attn.o_proj.weight",
}
_QK_NORM_NAMES = {
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
_PRE_NORM_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "feed_forward_norm.weight": "post_attention_layernorm.weight",
}
_SHARED_BLOCK_NAMES = {
    **_ATTENTION_NAMES,
    "feed_forward.w_gate.weight": "mlp.gate_proj.weight",
    "feed_forward.w_up.weight": "mlp.up_proj.weight",
    "feed_forward.w_down.weight": "mlp.down_proj.weight",
}
_BLOCK_NAMES = {
    HFArchitecture.llama: {**_SHARED_BLOCK_NAMES, **_PRE_NORM_NAMES},
    HFArchitecture.olmo2: {
        **_SHARED_BLOCK_NAMES,
        **_QK_NORM_NAMES,
        "attention_norm.weight": "post_attention_layernorm.weight",
        "feed_forward_norm.weight": "post_feedforward_layernorm.weight",
    },
    # The experts are not renamed but split (hf_moe.py); the router is.
    HFArchitecture.olmoe: {
        **_ATTENTION_NAMES,
        **_QK_NORM_NAMES,
        **_PRE_NORM_NAMES,
        "feed_forward.router.weight": "mlp.gate.weight",
    },
}
_TOP_NAMES = {
    "embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"


def hf_architecture(config: TransformerConfig) -> HFArchitecture:
    """The Hugging Face class with the blocks of ``config``, or a ConfigurationError."""
    if config.moe is not None:
        return _moe_architecture(config)
    reordered = config.block_type == TransformerBlockType.reordered_norm
    if not reordered and not config.qk_norm:
        return HFArchitecture.llama
    if reordered and config.qk_norm:
        return HFArchitecture.olmo2
    if reordered:
        raise ConfigurationError(
            "an OLMo-2 block (block_type='reordered_norm') without QK-norm has no Hugging Face "
            "class (Olmo2ForCausalLM always normalises q and k); set qk_norm=True to export it "
            "as OLMo-2, or block_type='default' for Llama",
            path="qk_norm",
        )
    raise ConfigurationError(
        "a pre-norm block with QK-norm has no Hugging Face class (LlamaForCausalLM has no q/k "
        "norm; Olmo2ForCausalLM normalises outputs, not inputs); train with qk_norm=False for "
        "Llama, or block_type='reordered_norm' with qk_norm=True for OLMo-2",
        path="qk_norm",
    )


def _moe_architecture(config: TransformerConfig) -> HFArchitecture:
    """OLMoE, the one mixture of experts exported: every layer MoE, no shared expert,
    pre-norm blocks with QK-norm (over all heads, as ours)."""
    assert config.moe is not None
    problems = []
    if (
        config.moe.layers is not None
        and config.moe.num_moe_layers(config.n_layers) < config.n_layers
    ):
        problems.append("dense layers among the MoE ones (moe.layers); OLMoE's are all MoE")
    if config.has_shared_expert:
        problems.append("a shared expert (moe.shared_expert_hidden_size); OLMoE has none")
    if config.block_type != TransformerBlockType.default or not config.qk_norm:
        problems.append("blocks other than OLMoE's (block_type='default' with qk_norm=True)")
    if problems:
        raise ConfigurationError(
            f"this mixture of experts has no Hugging Face class: it has {'; '.join(problems)}. "
            "olmolike exports MoE models as OlmoeForCausalLM only",
            path="moe",
        )
    return HFArchitecture.olmoe


def hf_tensor_names(config: TransformerConfig) -> dict[str, str]:
    """Our tensor names -> Hugging Face's, for a model of ``config`` (``i`` the block index)::

        embeddings.weight                    -> model.embed_tokens.weight
        blocks.i.attention.w_{q,k,v}.weight  -> model.layers.i.self_attn.{q,k,v}_proj.weight
        blocks.i.attention.w_out.weight      -> model.layers.i.self_attn.o_proj.weight
        blocks.i.feed_forward.w_gate.weight  -> model.layers.i.mlp.gate_proj.weight
        blocks.i.feed_forward.w_up.weight    -> model.layers.i.mlp.up_proj.weight
        blocks.i.feed_forward.w_down.weight  -> model.layers.i.mlp.down_proj.weight
        norm.weight                          -> model.norm.weight
        lm_head.weight                       -> lm_head.weight  (left out when tied)

    Llama: ``blocks.i.attention_norm`` -> ``input_layernorm``, ``blocks.i.feed_forward_norm``
    -> ``post_attention_layernorm``. OLMo-2: ``blocks.i.attention_norm`` ->
    ``post_attention_layernorm``, ``blocks.i.feed_forward_norm`` -> ``post_feedforward_layernorm``,
    ``blocks.i.attention.{q,k}_norm`` -> ``model.layers.i.self_attn.{q,k}_norm``.
    """
    block_names = _BLOCK_NAMES[hf_architecture(config)]
    names = {
        f"blocks.{i}.{ours}": f"model.layers.{i}.{theirs}"
        for i in range(config.n_layers)
        for ours, theirs in block_names.items()
    }
    names |= _TOP_NAMES
    if config.tie_weights:
        # Hugging Face stores a tied embedding once and re-ties lm_head when loading.
        del names["lm_head.weight"]
    return names


def convert_to_hf(
    state_dict: Mapping[str, Tensor], config: TransformerConfig
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Rename ``model.state_dict()`` to Hugging Face names; also return the ``config.json``.

    ``state_dict`` must hold full (unsharded) tensors: gather an FSDP model's state first
    (``get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))``). The
    returned tensors are contiguous views or copies, never shared, as safetensors requires.
    """
    names = hf_tensor_names(config)
    check_state_dict_matches(state_dict, config)
    tensors: dict[str, Tensor] = {}
    for ours, theirs in names.items():
        tensor = state_dict[ours]
        if isinstance(tensor, DTensor):
            raise ConfigurationError(
                f"{ours} is a sharded DTensor; gather a full state dict first "
                "(StateDictOptions(full_state_dict=True)) to export an FSDP model"
            )
        tensors[theirs] = tensor.detach().contiguous()
    if config.moe is not None:
        _check_full(state_dict, "feed_forward.experts.")
        moe_layers = [i for i in range(config.n_layers) if config.is_moe_layer(i)]
        tensors |= expert_tensors_to_hf(state_dict, moe_layers, config.moe.num_experts)
    return tensors, hf_config(config, dtype=state_dict["embeddings.weight"].dtype)


def _check_full(state_dict: Mapping[str, Tensor], infix: str) -> None:
    for name, tensor in state_dict.items():
        if infix in name and isinstance(tensor, DTensor):
            raise ConfigurationError(
                f"{name} is a sharded DTensor; gather a full state dict first "
                "(StateDictOptions(full_state_dict=True)) to export a sharded model"
            )


def check_state_dict_matches(state_dict: Mapping[str, Tensor], config: TransformerConfig) -> None:
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


def hf_config(
    config: TransformerConfig,
    *,
    dtype: torch.dtype = torch.float32,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> dict[str, Any]:
    """The ``config.json`` of the Hugging Face model with the shape of ``config``."""
    architecture = hf_architecture(config)
    if dtype not in _DTYPE_NAMES:
        raise ConfigurationError(
            f"cannot export weights of dtype {dtype}; cast them to one of "
            f"{', '.join(_DTYPE_NAMES.values())}"
        )
    hf: dict[str, Any] = {
        "architectures": [architecture.value],
        "model_type": MODEL_TYPES[architecture],
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.hidden_size,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_sequence_length,
        "rms_norm_eps": config.norm_eps,
        # transformers < 5 reads rope_theta and rope_scaling; 5 reads rope_parameters.
        "rope_theta": config.rope_theta,
        "rope_scaling": _rope_scaling(config),
        "rope_parameters": {"rope_theta": config.rope_theta, **_rope_scaling(config)},
        "attention_bias": False,
        "tie_word_embeddings": config.tie_weights,
        "initializer_range": config.init_std,
        "torch_dtype": _DTYPE_NAMES[dtype],
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        # Olmo2Config defaults pad_token_id to 1, which would mark a real token as padding.
        "pad_token_id": None,
    }
    if architecture == HFArchitecture.llama:
        hf |= {"head_dim": config.head_dim, "mlp_bias": False}
    if architecture == HFArchitecture.olmoe:
        assert config.moe is not None
        hf |= {
            "intermediate_size": config.expert_hidden_size,
            "num_experts": config.moe.num_experts,
            "num_experts_per_tok": config.moe.top_k,
            "norm_topk_prob": config.moe.normalize_top_k,
            "router_aux_loss_coef": config.moe.load_balancing_loss_coefficient,
            "output_router_logits": False,
            "clip_qkv": None,
        }
    return hf


def _rope_scaling(config: TransformerConfig) -> dict[str, Any]:
    scaling = config.rope_scaling
    if scaling is None:
        return {"rope_type": "default"}
    return {
        "rope_type": "llama3",
        "factor": scaling.factor,
        "low_freq_factor": scaling.low_freq_factor,
        "high_freq_factor": scaling.high_freq_factor,
        "original_max_position_embeddings": scaling.original_max_sequence_length,
    }


def export_hf(
    state_dict: Mapping[str, Tensor],
    config: TransformerConfig,
    output_dir: str | Path,
    *,
    overwrite: bool = False,
    eos_token_id: int | None = None,
    bos_token_id: int | None = None,
    max_shard_bytes: int | None = None,
) -> Path:
    """Write safetensors weights and ``config.json`` of the matching HF class to ``output_dir``.

    One ``model.safetensors``, or with ``max_shard_bytes`` as many
    ``model-0000i-of-0000n.safetensors`` as needed plus ``model.safetensors.index.json`` (the
    layout ``save_pretrained`` writes for large models). Refuses to replace existing files
    unless ``overwrite``; the check runs before anything is written, so a refused export leaves
    the directory as it was. Each file is written atomically. Tokenizer files are not
    written: copy your tokenizer's next to them.
    """
    if io.is_url(output_dir):
        raise ConfigurationError(
            f"export_hf writes a local directory, got {output_dir}; export locally, then upload "
            "the directory (olmolike.io.persist copies it to gs:// or s3://)"
        )
    if max_shard_bytes is not None and max_shard_bytes < 1:
        raise ConfigurationError(f"must be positive, got {max_shard_bytes}", path="max_shard_bytes")
    tensors, hf = convert_to_hf(state_dict, config)
    shards = _shards(tensors, max_shard_bytes)
    out = io.local_path(output_dir)
    # Weights of an earlier export in another layout count too: left beside the new ones, a
    # loader could pick them up.
    earlier = [p.name for p in out.glob("model*.safetensors*")] if out.is_dir() else []
    existing = sorted(
        {*earlier, *(name for name in (*shards, CONFIG_NAME) if (out / name).exists())}
    )
    if existing and not overwrite:
        raise FileExistsError(
            f"{out} already holds {', '.join(existing)}; pass --overwrite (overwrite=True "
            "from Python) to replace them"
        )
    for name in set(earlier) - set(shards):
        (out / name).unlink()
    for name, shard in shards.items():
        data = safetensors.torch.save(
            {key: tensors[key].cpu() for key in shard}, metadata={"format": "pt"}
        )
        io.write_file(out, name, data, overwrite=overwrite)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
            "weight_map": {key: name for name, shard in shards.items() for key in shard},
        }
        io.write_file(out, INDEX_NAME, json.dumps(index, indent=2) + "\n", overwrite=overwrite)
    hf |= {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id}
    io.write_file(out, CONFIG_NAME, json.dumps(hf, indent=2) + "\n", overwrite=overwrite)
    log.info("exported a %s checkpoint to %s", hf["architectures"][0], out)
    return out


def _shards(tensors: Mapping[str, Tensor], max_bytes: int | None) -> dict[str, list[str]]:
    """File name -> tensor names, in order, each file at most ``max_bytes`` (one tensor may be
    larger, alone in its file)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if max_bytes is not None and groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    if len(groups) == 1:
        return {WEIGHTS_NAME: groups[0]}
    n = len(groups)
    return {f"model-{i + 1:05d}-of-{n:05d}.safetensors": group for i, group in enumerate(groups)}
