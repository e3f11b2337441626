"""Small value types shared by the trainer, its config and callbacks."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import Config, StrEnum

__all__ = [
    "Duration",
    "DurationUnit",
    "LoadStrategy",
    "MetricMergeStrategy",
    "ReduceType",
    "StepSkipRange",
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
    """A length of training in steps, epochs or tokens."""

    value: int
    """The value of the duration."""

    unit: DurationUnit
    """The unit associated with the value."""

    def validate(self) -> None:
        if self.value < 0:
            raise self._invalid("value", f"must be >= 0, got {self.value}")

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
        """
        if multiple <= 0 or model_params <= 0:
            raise ValueError("multiple and model_params must both be positive")
        return cls.tokens(math.ceil(multiple * _tok_per_param * model_params))

    def due(self, *, step: int, tokens: int, epoch: int) -> bool:
        """Whether training that has reached ``step``, ``tokens`` and (1-based) ``epoch`` is done."""
        if self.unit == DurationUnit.steps:
            return step >= self.value
        if self.unit == DurationUnit.tokens:
            return tokens >= self.value
        return epoch > self.value

    def __str__(self) -> str:
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
