"""Model building blocks: the transformer (dense or mixture of experts), losses, sampling,
Hugging Face import and export."""

from .functional import cross_entropy_loss, log_probs_of_labels
from .generation import Generation, filter_logits, generate, sample
from .hf_export import HFArchitecture, convert_to_hf, export_hf
from .hf_import import load_hf_model, transformer_config_from_hf
from .kv_cache import KVCache
from .moe import ExpertCompute, MoEConfig, MoEFeedForward
from .rope import RopeScalingConfig, RotaryEmbedding
from .transformer import (
    Attention,
    FeedForward,
    RMSNorm,
    Transformer,
    TransformerBlock,
    TransformerBlockType,
)
from .transformer_config import TransformerConfig, TransformerPreset

__all__ = [
    "Attention",
    "ExpertCompute",
    "FeedForward",
    "Generation",
    "HFArchitecture",
    "KVCache",
    "MoEConfig",
    "MoEFeedForward",
    "RMSNorm",
    "RopeScalingConfig",
    "RotaryEmbedding",
    "Transformer",
    "TransformerBlock",
    "TransformerBlockType",
    "TransformerConfig",
    "TransformerPreset",
    "convert_to_hf",
    "cross_entropy_loss",
    "export_hf",
    "filter_logits",
    "generate",
    "load_hf_model",
    "log_probs_of_labels",
    "sample",
    "transformer_config_from_hf",
]
