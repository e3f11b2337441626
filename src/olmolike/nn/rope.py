"""Rotary position embeddings: the cos/sin tables, Llama 3.1's frequency scaling that stretches
a model to a longer context, and the per-document positions of packed sequences."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from ..config import Config

__all__ = [
    "RopeScalingConfig",
    "RotaryEmbedding",
    "apply_rotary",
    "document_attention",
    "document_starts",
]


@dataclass
class RopeScalingConfig(Config):
    """Llama 3.1's stretch of RoPE to long contexts (``rope_type: llama3`` in Hugging Face).

    Frequencies whose wavelength exceeds ``original_max_sequence_length / low_freq_factor``
    are divided by ``factor``; those shorter than ``original_max_sequence_length /
    high_freq_factor`` are kept; those between are blended linearly. Short-range position
    information stays as pretrained while long-range positions are spread over a longer
    context.
    """

    factor: float = 8.0
    """How much longer the new context is: the long-wavelength frequencies are divided by it (Llama
    3.1: 8)."""
    low_freq_factor: float = 1.0
    """Frequencies whose wavelength exceeds ``original_max_sequence_length / low_freq_factor`` are
    divided by ``factor`` in full."""
    high_freq_factor: float = 4.0
    """Frequencies whose wavelength is below ``original_max_sequence_length / high_freq_factor`` are
    kept as pretrained; those between the two bounds are blended."""
    original_max_sequence_length: int = 8192
    """The context length the model was pretrained with before the stretch."""

    def validate(self) -> None:
        if not self.factor >= 1.0:
            raise self._invalid("factor", f"must be >= 1, got {self.factor}")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise self._invalid(
                "high_freq_factor", "must be larger than low_freq_factor, and both positive"
            )
        if self.original_max_sequence_length < 1:
            raise self._invalid("original_max_sequence_length", "must be a positive integer")

    def scale(self, inv_freq: Tensor) -> Tensor:
        wavelength = 2 * math.pi / inv_freq
        context = self.original_max_sequence_length
        blend = (context / wavelength - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        blended = (1 - blend) * inv_freq / self.factor + blend * inv_freq
        long = wavelength > context / self.low_freq_factor
        short = wavelength < context / self.high_freq_factor
        return torch.where(long, inv_freq / self.factor, torch.where(short, inv_freq, blended))


class RotaryEmbedding(nn.Module):
    """Caches the cos/sin tables of rotary position embeddings, in float32.

    The tables are non-persistent buffers: they are a pure function of the config, so
    checkpoints and exports never carry them, and they stay float32 when the model is cast to
    a lower precision (angles at position 4000 need more than bf16's 8 bits of mantissa).
    """

    cos: Tensor
    sin: Tensor

    def __init__(
        self,
        head_dim: int,
        max_sequence_length: int,
        theta: float,
        scaling: RopeScalingConfig | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_sequence_length = max_sequence_length
        self.theta = theta
        self.scaling = scaling
        self.register_buffer("cos", torch.empty(max_sequence_length, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_sequence_length, head_dim), persistent=False)
        self.reset_buffers()

    def reset_buffers(self, device: torch.device | None = None) -> None:
        device = self.cos.device if device is None else device
        if device.type == "meta":
            return
        exponents = torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float32)
        inv_freq = 1.0 / self.theta ** (exponents / self.head_dim)
        if self.scaling is not None:
            inv_freq = self.scaling.scale(inv_freq)
        positions = torch.arange(self.max_sequence_length, device=device, dtype=torch.float32)
        angles = torch.outer(positions, inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.cos = angles.cos()
        self.sin = angles.sin()

    def _apply(self, fn: Any, recurse: bool = True) -> RotaryEmbedding:
        super()._apply(fn, recurse)
        if self.cos.dtype != torch.float32:
            # ``model.to(torch.bfloat16)`` casts buffers too: rebuild rather than lose precision.
            self.cos = torch.empty_like(self.cos, dtype=torch.float32)
            self.sin = torch.empty_like(self.sin, dtype=torch.float32)
            self.reset_buffers()
        return self

    def forward(self, seq_len: int) -> tuple[Tensor, Tensor]:
        return self.cos[:seq_len], self.sin[:seq_len]

    def at(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """The tables at per-sequence ``positions`` (B, T), shaped (B, 1, T, head_dim)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate feature pairs ``(i, i + head_dim/2)`` of ``x`` (..., T, head_dim) by position."""
    xf = x.float()
    first, second = xf.chunk(2, dim=-1)
    rotated = torch.cat((-second, first), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


def document_attention(doc_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Positions and attention mask for sequences that pack several documents.

    ``doc_ids`` (B, T) labels each token's document; a document is a run of equal ids. Returns
    positions (B, T) that restart at 0 with each document, and a boolean mask (B, 1, T, T)
    that lets a token see the earlier tokens of its own document only: each document is
    then computed exactly as if it were alone in the sequence.
    """
    index = torch.arange(doc_ids.shape[1], device=doc_ids.device)
    doc_start = document_starts(doc_ids)
    same_doc = doc_start[:, :, None] == doc_start[:, None, :]
    return index - doc_start, (same_doc & (index[:, None] >= index[None, :])).unsqueeze(1)


def document_starts(doc_ids: Tensor) -> Tensor:
    """The index of the first token of each token's document (B, T): two tokens are in the
    same document exactly when these are equal, and ``index - start`` is a token's position."""
    index = torch.arange(doc_ids.shape[1], device=doc_ids.device)
    starts = F.pad(doc_ids[:, 1:] != doc_ids[:, :-1], (1, 0), value=True)
    return torch.where(starts, index, 0).cummax(dim=1).values
