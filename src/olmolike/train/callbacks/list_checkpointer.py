"""Checkpoints at a list of exact steps."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ...exceptions import ConfigurationError
from .checkpointer import CheckpointerCallback, CheckpointRemovalStrategy, checkpoints_to_remove

__all__ = ["CheckpointRemovalStrategy", "ListCheckpointerCallback", "checkpoints_to_remove"]

log = logging.getLogger(__name__)


@dataclass
class ListCheckpointerCallback(CheckpointerCallback, name="list_checkpointer"):
    """Saves permanent checkpoints exactly at ``save_steps`` (e.g. the ends of the periods of
    a warmup-stable-decay schedule, or token milestones), and at the end of training.

    Everything else works as in :class:`CheckpointerCallback`: background saves, ephemeral
    checkpoints, ``max_checkpoints``.
    """

    save_interval: int = 1_000_000_000
    """Kept out of the way: the steps come from ``save_steps``."""
    save_steps: list[int] | None = None
    """The steps to save at."""

    _steps: frozenset[int] = field(default=frozenset(), init=False, repr=False)

    def validate(self) -> None:
        super().validate()
        if not self.save_steps:
            raise ConfigurationError(
                "must list the steps to save at, e.g. [1000, 5000]", path="save_steps"
            )
        if any(step < 1 for step in self.save_steps):
            raise ConfigurationError(
                f"steps must be >= 1, got {self.save_steps}", path="save_steps"
            )
        self._steps = frozenset(self.save_steps)

    def post_step(self) -> None:
        super().post_step()
        step = self.step
        if (
            self.active
            and step in self._steps
            and self.last_saved_step != step
            and not self.trainer.training_complete  # post_train saves the last step
        ):
            self._save(ephemeral=False)
