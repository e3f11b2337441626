"""Activation checkpointing's settings: which transformer blocks recompute their activations
in backward instead of keeping them. The train module applies them
(:class:`~olmolike.train.train_module.TransformerTrainModule`); the memory planner counts the
blocks they select (:mod:`olmolike.plan.activations`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...config import Config, StrEnum, register_config_class

__all__ = ["ActivationCheckpointingConfig", "ActivationCheckpointingMode"]


class ActivationCheckpointingMode(StrEnum):
    """Which blocks recompute their activations in backward instead of keeping them."""

    full = "full"
    """Recompute every block's activations in backward: the least memory, ~1/3 more compute."""
    selected_blocks = "selected_blocks"
    """Recompute every ``block_interval``-th block: a trade between memory and compute."""


@dataclass
class ActivationCheckpointingConfig(Config):
    """Activation checkpointing: trade compute for memory by recomputing block activations."""

    mode: ActivationCheckpointingMode = ActivationCheckpointingMode.full
    """Which activations are recomputed in the backward pass instead of kept: see
    :class:`ActivationCheckpointingMode` (``full``: every block's)."""
    block_interval: int = 1
    """With ``selected_blocks``: checkpoint blocks 0, N, 2N, ..."""

    def validate(self) -> None:
        if self.block_interval <= 0:
            raise self._invalid("block_interval", f"must be positive, got {self.block_interval}")

    def selects(self, block_index: int) -> bool:
        if self.mode == ActivationCheckpointingMode.full:
            return True
        return block_index % self.block_interval == 0


# Its name before it moved here from the train module, for config files written then.
register_config_class(
    ActivationCheckpointingConfig,
    "olmolike.train.train_module.transformer.ActivationCheckpointingConfig",
)
