"""Small value types shared by the trainer, its config and callbacks."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.nn.functional as F

from ..config import Config, StrEnum
from ..utils import format_float, format_int, format_timedelta

__all__ = [
    "Duration",
    "DurationUnit",
    "LoadStrategy",
    "MetricMergeStrategy",
    "ReduceType",
    "StepSkipRange",
    "TrainingProgress",
    "get_inputs_for_loss",
    "get_labels",
    "reshape_inputs_for_loss",
]


class DurationUnit(StrEnum):
    """Units that can be used to define a :class:`Duration`."""

    steps = "steps"
    """Steps (batches)."""

    epochs = "epochs"
    """Epochs."""

    tokens = "tokens"
    """Tokens."""


@dataclass
class Duration(Config):
    """A length of training in steps, epochs or tokens.

    ``str()`` and ``repr()`` give ``Duration(value=5, unit='steps')``, as in OLMo-core;
    :meth:`describe` gives the short form for messages (``5 steps``).
    """

    value: int
    """The value of the duration."""

    unit: DurationUnit
    """The unit associated with the value."""

    def validate(self) -> None:
        if self.value < 0:
            # The one bound a Duration knows; a run's max_duration also refuses 0, so say so
            # here rather than send a user from -5 to 0 to 1.
            raise self._invalid(
                "value", f"must be >= 0 (>= 1 for a max_duration), got {self.value}"
            )

    @classmethod
    def steps(cls, steps: int) -> Duration:
        """Define a duration from a number of steps."""
        return cls(value=steps, unit=DurationUnit.steps)

    @classmethod
    def epochs(cls, epochs: int) -> Duration:
        """Define a duration from a number of epochs."""
        return cls(value=epochs, unit=DurationUnit.epochs)

    @classmethod
    def tokens(cls, tokens: int) -> Duration:
        """Define a duration from a number of tokens."""
        return cls(value=tokens, unit=DurationUnit.tokens)

    @classmethod
    def chinchilla_tokens(
        cls, multiple: float, *, model_params: int, _tok_per_param: int = 20
    ) -> Duration:
        """A multiple of the Chinchilla-optimal token count (20 tokens per parameter).

        :param multiple: 1.0 is compute-optimal for training; larger values over-train, which
            is common when inference cost matters.
        :param model_params: the number of active, non-embedding parameters.

        The count is rounded down to a whole token, as OLMo-core does, so the same arguments
        give the same duration in both.
        """
        if multiple <= 0 or model_params <= 0:
            raise ValueError("multiple and model_params must both be positive")
        return cls.tokens(int(_tok_per_param * model_params * multiple))

    def due(self, *, step: int, tokens: int, epoch: int) -> bool:
        """Whether training that has reached ``step``, ``tokens`` and (1-based) ``epoch`` is done."""
        if self.unit == DurationUnit.steps:
            return step >= self.value
        if self.unit == DurationUnit.tokens:
            return tokens >= self.value
        return epoch > self.value

    def describe(self) -> str:
        """``1,000 tokens``: the duration in words, for messages."""
        return f"{self.value:,d} {self.unit}"


class LoadStrategy(StrEnum):
    """Determines the strategy for loading checkpoints prior to training."""

    if_available = "if_available"
    """Load from the save folder or load path (in that order) if a checkpoint is there, else
    train from scratch."""

    always = "always"
    """Load from the save folder or load path (in that order); no checkpoint is an error."""

    never = "never"
    """Never load a checkpoint, even if one exists."""


class ReduceType(StrEnum):
    """How a metric is reduced across ranks."""

    mean = "mean"
    """Average across the process group."""

    sum = "sum"
    """Add across the process group."""

    max = "max"
    """Take the max across the process group."""

    min = "min"
    """Take the min across the process group (not in OLMo-core: for extremes such as GRPO's
    smallest per-completion clip share)."""

    l2_norm = "l2_norm"
    """For metrics that are L2 norms on each rank: the norm of the concatenation, i.e.
    ``sqrt(sum(x_i ** 2))``."""


class MetricMergeStrategy(StrEnum):
    """How a metric recorded twice in the same step is merged."""

    warn = "warn"
    """Warn about the duplicate and keep the value recorded first."""

    latest = "latest"
    """The latest is used."""

    oldest = "oldest"
    """The oldest (first logged) is used."""

    mean = "mean"
    """The average of the duplicate and the value recorded so far."""

    sum = "sum"
    """The sum of the duplicates is used."""

    max = "max"
    """The maximum of the duplicates."""

    min = "min"
    """The minimum of the duplicates."""


@dataclass
class StepSkipRange(Config):
    """Steps ``[start, stop)`` to skip: their batches are consumed but nothing is trained.

    Use it to step over a stretch of data that made a run diverge, without changing which
    batches come after it.
    """

    start: int
    """The first step to skip (steps start at 1, not 0)."""

    stop: int
    """The endpoint of the range (exclusive)."""

    def validate(self) -> None:
        if self.start < 1:
            raise self._invalid(
                "start", f"steps are 1-based, so start must be >= 1, got {self.start}"
            )
        if self.stop <= self.start:
            raise self._invalid(
                "stop", f"must be greater than start ({self.start}), got {self.stop}"
            )

    def __contains__(self, step: object) -> bool:
        return (
            isinstance(step, int) and not isinstance(step, bool) and self.start <= step < self.stop
        )


# -- loss inputs ---------------------------------------------------------------------------


def get_labels(batch: dict[str, Any], label_ignore_index: int = -100) -> torch.Tensor:
    """Next-token labels for a batch: ``input_ids`` shifted left by one.

    Positions excluded by the batch's masks get ``label_ignore_index``: ``label_mask`` (False
    = no loss), ``attention_mask`` (0 = padding) and ``instance_mask`` (False = the whole
    instance). The last position has no next token and is always ignored.
    """
    labels = batch["input_ids"].clone()
    if (label_mask := batch.get("label_mask")) is not None:
        labels.masked_fill_(~label_mask.bool(), label_ignore_index)
    if (attention_mask := batch.get("attention_mask")) is not None:
        labels.masked_fill_(attention_mask == 0, label_ignore_index)
    if (instance_mask := batch.get("instance_mask")) is not None:
        labels.masked_fill_(~instance_mask.bool().unsqueeze(-1), label_ignore_index)
    return F.pad(labels[..., 1:], (0, 1), value=label_ignore_index)


def reshape_inputs_for_loss(
    logits: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten ``(B, S, V)`` logits and ``(B, S)`` labels to ``(B * S, V)`` and ``(B * S,)``."""
    return logits.reshape(-1, logits.size(-1)), labels.reshape(-1)


def get_inputs_for_loss(
    batch: dict[str, Any], logits: torch.Tensor, label_ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and labels ready for a cross-entropy loss: the batch's ``labels`` if it has
    them, else those of :func:`get_labels`, flattened by :func:`reshape_inputs_for_loss`."""
    labels = batch.get("labels")
    if labels is None:
        labels = get_labels(batch, label_ignore_index)
    return reshape_inputs_for_loss(logits, labels)


# -- progress ------------------------------------------------------------------------------


@dataclass
class TrainingProgress:
    """Where a run stands, from :attr:`Trainer.training_progress <olmolike.train.Trainer>`."""

    current_step: int
    """The last step taken."""
    current_tokens: int | None = None
    """Tokens trained on so far (over all ranks)."""
    total_steps: int | None = None
    """The step training will stop at (``hard_stop`` if earlier), if it can be known."""
    time_remaining: timedelta | None = None
    """An estimate from the average speed, rounded up to the minute."""
    bps: float | None = None
    """Average steps (batches) per second so far."""
    tps: float | None = None
    """Average tokens per second per device so far."""
    mfu: float | None = None
    """Average model FLOPs utilization, in percent."""

    def __str__(self) -> str:
        if self.total_steps is not None:
            done = min(100, int(100 * self.current_step / max(self.total_steps, 1)))
            parts = [f"{done}% complete, step {self.current_step:,d}/{self.total_steps:,d}"]
        else:
            parts = [f"step {self.current_step:,d}/???"]
        if self.current_tokens is not None:
            parts.append(f"{format_int(self.current_tokens)} tokens")
        if self.time_remaining is not None:
            parts.append(f"eta {format_timedelta(self.time_remaining)}")
        if self.tps is not None:
            parts.append(f"{format_float(self.tps)} TPS")
        elif self.bps is not None:
            parts.append(f"{format_float(self.bps)} BPS")
        if self.mfu is not None:
            parts.append(f"{format_float(self.mfu)}% MFU")
        return ", ".join(parts)
