"""Checkpoints at a list of exact steps, and the strategies for removing old checkpoints."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from ...config import StrEnum
from ...exceptions import ConfigurationError
from .checkpointer import CheckpointerCallback

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


class CheckpointRemovalStrategy(StrEnum):
    """Which old checkpoints found in the save folder a checkpointer may remove."""

    ephemeral_only = "ephemeral_only"
    """Only ephemeral checkpoints (the default)."""

    all_non_permanent = "all_non_permanent"
    """Ephemeral checkpoints and any other that is not at a multiple of ``save_interval``
    (e.g. left by a run with other settings)."""

    never = "never"
    """None: old checkpoints stay."""


def checkpoints_to_remove(
    strategy: CheckpointRemovalStrategy,
    found: Iterable[tuple[int, str, bool]],
    *,
    save_interval: int | None,
    keep: Iterable[str] = (),
) -> list[str]:
    """The paths a strategy removes among ``found`` checkpoints ``(step, path, ephemeral)``.

    ``keep`` (e.g. the checkpoint just saved) is never removed; neither is step 0's.
    """
    kept = set(keep)
    out = []
    for step, path, ephemeral in sorted(found):
        if path in kept or strategy == CheckpointRemovalStrategy.never:
            continue
        permanent_step = step == 0 or (save_interval is not None and step % save_interval == 0)
        if ephemeral or (
            strategy == CheckpointRemovalStrategy.all_non_permanent and not permanent_step
        ):
            out.append(path)
    return out
