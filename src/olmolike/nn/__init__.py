"""Model building blocks: the transformer, loss helpers, sampling and the Hugging Face export."""

from .functional import cross_entropy_loss, log_probs_of_labels
from .generation import Generation, filter_logits, generate, sample
from .hf_export import convert_to_hf_llama, export_hf_llama
from .kv_cache import KVCache
from .transformer import (
    Attention,
    FeedForward,
    RMSNorm,
    RotaryEmbedding,
    Transformer,
    TransformerBlock,
    TransformerConfig,
    TransformerPreset,
)

__all__ = [
    "Attention",
    "FeedForward",
    "Generation",
    "KVCache",
    "RMSNorm",
    "RotaryEmbedding",
    "Transformer",
    "TransformerBlock",
    "TransformerConfig",
    "TransformerPreset",
    "convert_to_hf_llama",
    "cross_entropy_loss",
    "export_hf_llama",
    "filter_logits",
    "generate",
    "log_probs_of_labels",
    "sample",
]
