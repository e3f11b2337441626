"""Converting durations (steps, tokens, epochs) into step counts, and counting FLOPs.

Pure functions of values: a :class:`Progress` (where training stands and the batch geometry),
the durations, and a :class:`Speed`. The trainer builds those from its own state. A
:class:`FlopCounter` turns trained tokens into the trainer's ``global_train_petaflops``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

from ..exceptions import ConfigurationError
from .common import Duration, DurationUnit, TrainingProgress

__all__ = [
    "FlopCounter",
    "Progress",
    "Speed",
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
    """The last step trained (0 before the first)."""
    tokens_seen: int
    """Training tokens consumed so far, over all ranks."""
    global_batch_size: int
    """Tokens per step."""
    steps_per_epoch: int | None
    """Batches in one epoch, ``None`` if the data loader cannot tell."""


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


def stop_step(max_duration: Duration, hard_stop: Duration | None, progress: Progress) -> int:
    """The step training stops at: the earlier of ``max_duration`` and ``hard_stop``."""
    stop = duration_to_steps(max_duration, progress, what="max_duration")
    if hard_stop is not None:
        stop = min(stop, duration_to_steps(hard_stop, progress, what="hard_stop"))
    return stop


def nothing_to_train(
    max_duration: Duration, hard_stop: Duration | None, progress: Progress, save_folder: str
) -> bool:
    """Say loudly, with what to change, when a (resumed) run has no step left to train.

    Typically the save folder holds a finished run and the trainer resumed it, or ``hard_stop``
    is below the loaded step. Returns whether it warned.
    """
    step, stop = progress.step, stop_step(max_duration, hard_stop, progress)
    if step < stop:
        return False
    by_hard_stop = hard_stop is not None and duration_to_steps(hard_stop, progress) == stop
    field = "hard_stop" if by_hard_stop else "max_duration"
    log.warning(
        "Nothing to train: the run is at step %d (loaded from %s) and %s ends it at step %d. "
        "To train on, raise %s (--trainer.%s.value=...); to start afresh, use a new "
        "save_folder or remove this one.",
        step,
        save_folder,
        field,
        stop,
        field,
        field,
    )
    return True


@dataclass(frozen=True)
class Speed:
    """Recent throughput, as a speed monitor measures it (each ``None`` until known)."""

    bps: float | None = None
    """Batches (steps) per second."""
    tps: float | None = None
    """Tokens per second."""
    mfu: float | None = None
    """Model FLOPs utilisation."""


def training_progress(
    max_duration: Duration, hard_stop: Duration | None, progress: Progress, speed: Speed
) -> TrainingProgress:
    """Where the run stands; the time to go from ``speed`` when it knows the steps per second."""
    step = progress.step
    try:
        total: int | None = max(stop_step(max_duration, hard_stop, progress), step)
    except ConfigurationError:
        total = None
    remaining = None
    if speed.bps and total is not None and total > step:
        remaining = timedelta(minutes=1 + int((total - step) / speed.bps // 60))
    return TrainingProgress(
        current_step=step,
        current_tokens=progress.tokens_seen,
        total_steps=total,
        time_remaining=remaining,
        bps=speed.bps,
        tps=speed.tps,
        mfu=speed.mfu,
    )


@dataclass
class FlopCounter:
    """The petaflops of trained tokens (the trainer's ``global_train_petaflops``), from the
    train module's FLOPs per token, asked once per sequence length."""

    flops_per_token: Callable[[int], int | None]
    """FLOPs per trained token at a sequence length; ``None`` if unknown."""
    known: dict[int, int | None] = field(default_factory=dict)
    """FLOPs per token already asked for, by sequence length (``None``: the train module cannot
    tell)."""

    def petaflops(self, seq_len: int, tokens: int) -> float:
        if seq_len not in self.known:
            self.known[seq_len] = self.flops_per_token(seq_len)
        per_token = self.known[seq_len]
        return 0.0 if per_token is None else per_token * tokens / 1e15
