"""Llama 3.1's RoPE frequency scaling, which stretches a model to a longer context."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..config import Config

__all__ = ["RopeScalingConfig"]


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
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
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
