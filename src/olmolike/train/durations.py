"""Converting durations (steps, tokens, epochs) into step counts."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

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


def stop_step(
    max_duration: Duration, hard_stop: Duration | None, progress: Callable[[], Progress]
) -> int:
    """The step training stops at: the earlier of ``max_duration`` and ``hard_stop``.

    The trainer asks at every step, so ``progress`` is only built when a duration needs it.
    """
    if hard_stop is None and max_duration.unit == DurationUnit.steps:
        return max_duration.value
    now = progress()
    stop = duration_to_steps(max_duration, now, what="max_duration")
    if hard_stop is not None:
        stop = min(stop, duration_to_steps(hard_stop, now, what="hard_stop"))
    return stop


def nothing_to_train(trainer: Trainer) -> bool:
    """Say loudly, with what to change, when a (resumed) run has no step left to train.

    Typically the save folder holds a finished run and the trainer resumed it, or ``hard_stop``
    is below the loaded step. Returns whether it warned.
    """
    step, stop = trainer.global_step, trainer._stop_step()
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


def training_progress(
    step: int, tokens: int, total: int | None, callbacks: Iterable[Any]
) -> TrainingProgress:
    """Where the run stands, with speed figures from the speed monitor among ``callbacks``."""
    speed = next((cb for cb in callbacks if hasattr(cb, "bps_avg")), None)
    bps = getattr(speed, "bps_avg", None)
    remaining = None
    if bps and total is not None and total > step:
        remaining = timedelta(minutes=1 + int((total - step) / bps // 60))
    return TrainingProgress(
        current_step=step,
        current_tokens=tokens,
        total_steps=total,
        time_remaining=remaining,
        bps=bps,
        tps=getattr(speed, "tps_avg", None),
        mfu=getattr(speed, "mfu_avg", None),
    )
