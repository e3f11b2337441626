"""Converting durations (steps, tokens, epochs) into step counts."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from ..exceptions import ConfigurationError
from .common import Duration, DurationUnit, TrainingProgress

if TYPE_CHECKING:
    from .trainer import Trainer

__all__ = [
    "Progress",
    "duration_to_steps",
    "duration_to_tokens",
    "nothing_to_train",
    "stop_step",
    "training_progress",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Progress:
    """Where training stands, and the batch geometry that turns tokens into steps."""

    step: int
    tokens_seen: int
    global_batch_size: int
    """Tokens per step."""
    steps_per_epoch: int | None


def duration_to_steps(duration: Duration, progress: Progress, *, what: str = "duration") -> int:
    """The global step at which ``duration`` is reached.

    Token durations count the steps still needed at the *current* batch size on top of the
    steps already taken, so they stay right when the batch size changes during training.

    :raises ConfigurationError: for an epoch duration when the loader cannot tell how many
        batches an epoch has.
    """
    if duration.unit == DurationUnit.steps:
        return duration.value
    if duration.unit == DurationUnit.tokens:
        remaining = max(0, duration.value - progress.tokens_seen)
        return progress.step + math.ceil(remaining / progress.global_batch_size)
    if progress.steps_per_epoch is None:
        raise ConfigurationError(
            f"is {duration.describe()}, but the data loader cannot tell how many batches an epoch has "
            "(total_batches is None), so the number of steps is unknown. The LR schedule needs "
            "it ahead of time: give the duration in steps or tokens instead.",
            path=what,
        )
    return duration.value * progress.steps_per_epoch


def duration_to_tokens(duration: Duration, progress: Progress) -> int | None:
    """The number of training tokens ``duration`` amounts to, if known."""
    if duration.unit == DurationUnit.tokens:
        return duration.value
    if duration.unit == DurationUnit.steps:
        return duration.value * progress.global_batch_size
    if progress.steps_per_epoch is None:
        return None
    return duration.value * progress.steps_per_epoch * progress.global_batch_size


def progress_of(trainer: Trainer) -> Progress:
    """Where ``trainer`` stands now."""
    return Progress(
        trainer.global_step,
        trainer.global_train_tokens_seen,
        trainer.global_batch_size,
        trainer.steps_per_epoch,
    )


def stop_step(trainer: Trainer) -> int:
    """The step training stops at: the earlier of ``max_duration`` and ``hard_stop``.

    The trainer asks at every step, so its progress is only read when a duration needs it.
    """
    max_duration, hard_stop = trainer.max_duration, trainer.hard_stop
    if hard_stop is None and max_duration.unit == DurationUnit.steps:
        return max_duration.value
    now = progress_of(trainer)
    stop = duration_to_steps(max_duration, now, what="max_duration")
    if hard_stop is not None:
        stop = min(stop, duration_to_steps(hard_stop, now, what="hard_stop"))
    return stop


def nothing_to_train(trainer: Trainer) -> bool:
    """Say loudly, with what to change, when a (resumed) run has no step left to train.

    Typically the save folder holds a finished run and the trainer resumed it, or ``hard_stop``
    is below the loaded step. Returns whether it warned.
    """
    step, stop = trainer.global_step, stop_step(trainer)
    if step < stop:
        return False
    hard_stop = trainer.hard_stop
    by_hard_stop = hard_stop is not None and trainer.convert_duration_to_steps(hard_stop) == stop
    field = "hard_stop" if by_hard_stop else "max_duration"
    log.warning(
        "Nothing to train: the run is at step %d (loaded from %s) and %s ends it at step %d. "
        "To train on, raise %s (--trainer.%s.value=...); to start afresh, use a new "
        "save_folder or remove this one.",
        step,
        trainer.save_folder,
        field,
        stop,
        field,
        field,
    )
    return True


def training_progress(trainer: Trainer) -> TrainingProgress:
    """Where the run stands, with speed figures from the trainer's speed monitor if it has one."""
    step = trainer.global_step
    try:
        total: int | None = max(stop_step(trainer), step)
    except ConfigurationError:
        total = None
    speed = next((cb for cb in trainer.callbacks.values() if hasattr(cb, "bps_avg")), None)
    bps = getattr(speed, "bps_avg", None)
    remaining = None
    if bps and total is not None and total > step:
        remaining = timedelta(minutes=1 + int((total - step) / bps // 60))
    return TrainingProgress(
        current_step=step,
        current_tokens=trainer.global_train_tokens_seen,
        total_steps=total,
        time_remaining=remaining,
        bps=bps,
        tps=getattr(speed, "tps_avg", None),
        mfu=getattr(speed, "mfu_avg", None),
    )
