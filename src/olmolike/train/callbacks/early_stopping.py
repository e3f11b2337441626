"""Stops a run whose watched metric (usually the validation loss) has stopped improving."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

from ...config import StrEnum
from ...exceptions import ConfigurationError
from .callback import Callback

__all__ = ["EarlyStoppingCallback", "EarlyStoppingMode"]

log = logging.getLogger(__name__)


class EarlyStoppingMode(StrEnum):
    """Which direction of the watched metric counts as better."""

    min = "min"
    """Lower is better (losses, perplexities)."""
    max = "max"
    """Higher is better (accuracies)."""


@dataclass
class EarlyStoppingCallback(Callback, name="early_stopping"):
    """Cancels the run after ``patience`` evaluations in a row without improvement.

    The metric is read from :meth:`log_metrics`, where it arrives reduced across ranks: every
    rank sees the same value, so every rank reaches the same decision without communicating.
    An evaluation counts as an improvement only if it beats the best value so far by more than
    ``min_delta``; this keeps noise around a plateau from resetting the count forever. The best
    value and the count are saved in checkpoints, so a resumed run keeps its patience.
    """

    metric: str = "eval/lm/CE loss"
    """The full metric name as logged (``namespace/name``)."""
    mode: EarlyStoppingMode = EarlyStoppingMode.min
    """Which direction of ``metric`` is better: ``min`` (losses) or ``max`` (accuracies)."""
    patience: int = 3
    """Evaluations without improvement that are tolerated; one more stops the run."""
    min_delta: float = 0.0
    """How much better than the best a value must be to count as an improvement."""
    enabled: bool = True
    """``False`` turns the callback off while keeping it in the config (an override can turn it back
    on)."""

    _best: float | None = field(default=None, init=False, repr=False)
    _best_step: int | None = field(default=None, init=False, repr=False)
    _evals_without_improvement: int = field(default=0, init=False, repr=False)

    def validate(self) -> None:
        if self.patience < 1:
            raise ConfigurationError(
                f"must be >= 1 (evaluations without improvement before stopping), "
                f"got {self.patience}",
                path="patience",
            )
        if not math.isfinite(self.min_delta) or self.min_delta < 0:
            raise ConfigurationError(
                f"must be a finite number >= 0, got {self.min_delta}", path="min_delta"
            )
        if not self.metric:
            raise ConfigurationError(
                "must name a logged metric, e.g. 'eval/lm/CE loss'", path="metric"
            )

    @property
    def best(self) -> float | None:
        """The best value seen so far."""
        return self._best

    @property
    def evals_without_improvement(self) -> int:
        return self._evals_without_improvement

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled or self.metric not in metrics:
            return
        value = metrics[self.metric]
        if self._improved(value):
            self._best, self._best_step = value, step
            self._evals_without_improvement = 0
            return
        self._evals_without_improvement += 1
        log.info(
            "%s=%.4f at step %d: no improvement on %.4f (step %s) for %d of %d evaluations",
            self.metric,
            value,
            step,
            self._best if self._best is not None else math.nan,
            self._best_step,
            self._evals_without_improvement,
            self.patience,
        )
        if self._evals_without_improvement >= self.patience:
            self.trainer.cancel_run(
                f"early stopping: {self.metric} has not improved on its best "
                f"({self._best} at step {self._best_step}) by more than {self.min_delta} for "
                f"{self.patience} evaluations"
            )

    def _improved(self, value: float) -> bool:
        # A NaN never improves: comparisons with it are False.
        if self._best is None:
            return math.isfinite(value)
        if self.mode == EarlyStoppingMode.min:
            return value < self._best - self.min_delta
        return value > self._best + self.min_delta

    def state_dict(self) -> dict[str, Any]:
        return {
            "best": self._best,
            "best_step": self._best_step,
            "evals_without_improvement": self._evals_without_improvement,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._best = state_dict["best"]
        self._best_step = state_dict["best_step"]
        self._evals_without_improvement = state_dict["evals_without_improvement"]
