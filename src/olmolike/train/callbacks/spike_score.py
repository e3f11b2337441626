"""OLMo-core's SpikeScore: the rate of loss or gradient-norm spikes, as metrics.

Mixed into :class:`~olmolike.train.callbacks.StabilityMonitorCallback`, which keeps its own
detection and reactions (``policy``) beside it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SPIKE_SCORE_METRIC", "SPIKE_SCORE_TOTAL_METRIC", "SpikeScore"]


SPIKE_SCORE_METRIC = "spike/SpikeScore"
SPIKE_SCORE_TOTAL_METRIC = "spike/SpikeScore (total)"


@dataclass
class SpikeScore:
    """Adds ``spike/SpikeScore`` (the fraction of the last ``rolling_window`` steps with a
    spike, once that many steps are known) and ``spike/SpikeScore (total)`` (the fraction of
    all steps so far, from ``window_size`` steps on) to each step's metrics.

    A step spikes when its loss or gradient norm is more than ``threshold_std`` standard
    deviations above the mean of the previous ``window_size`` values (judged once that many are
    known; a flat history never spikes).
    """

    window_size: int = 128
    """Values of the previous steps that the mean and deviation are taken over."""
    rolling_window: int = 10000
    """Steps that ``spike/SpikeScore`` is taken over."""
    threshold_std: float = 6.0
    """How many standard deviations above the mean of the previous ``window_size`` values a loss or
    gradient norm must be to count as a spike in the SpikeScore."""
    enabled: bool = True
    """``False`` turns the whole monitor off."""
    loss_metric_name: str | None = None
    """The loss metric for the score; default the monitor's ``loss_metric``."""
    grad_norm_metric_name: str | None = None
    """The gradient-norm metric for the score; default the monitor's ``grad_norm_metric``."""

    _loss_history: deque[float] = field(default_factory=deque, init=False, repr=False)
    _grad_norm_history: deque[float] = field(default_factory=deque, init=False, repr=False)
    _spike_history: deque[bool] = field(default_factory=deque, init=False, repr=False)
    _total_spike_count: int = field(default=0, init=False, repr=False)
    _total_step_count: int = field(default=0, init=False, repr=False)

    def _check_score_settings(self) -> list[tuple[str, str]]:
        """``(field, problem)`` for impossible settings."""
        problems = []
        for name in ("window_size", "rolling_window"):
            if getattr(self, name) < 1:
                problems.append((name, f"must be >= 1, got {getattr(self, name)}"))
        if not self.threshold_std > 0:
            problems.append(("threshold_std", f"must be > 0, got {self.threshold_std}"))
        return problems

    def pre_log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        spike = False
        for name, history in (
            (self._metric("loss"), self._loss_history),
            (self._metric("grad_norm"), self._grad_norm_history),
        ):
            value = metrics.get(name)
            if value is not None:
                spike |= self._is_spike(value, history)
                _push(history, value, self.window_size)
        _push(self._spike_history, spike, self.rolling_window)
        self._total_step_count += 1
        self._total_spike_count += spike
        if len(self._spike_history) >= self.rolling_window:
            metrics[SPIKE_SCORE_METRIC] = sum(self._spike_history) / self.rolling_window
        if self._total_step_count >= self.window_size:
            metrics[SPIKE_SCORE_TOTAL_METRIC] = self._total_spike_count / self._total_step_count

    def _metric(self, which: str) -> str:
        """OLMo-core's ``*_metric_name``, else the monitor's own ``loss_metric``/``grad_norm_metric``."""
        return getattr(self, f"{which}_metric_name") or self._default_metric(which)

    def _default_metric(self, which: str) -> str:
        """The metric watched for ``which`` (``loss``, ``grad_norm``) when its
        ``*_metric_name`` is unset: the monitor this is mixed into says."""
        raise NotImplementedError

    def _is_spike(self, value: float, history: deque[float]) -> bool:
        if len(history) < self.window_size:
            return False
        mean = sum(history) / len(history)
        std = math.sqrt(sum((x - mean) ** 2 for x in history) / len(history))
        return std >= 1e-10 and value > mean + self.threshold_std * std

    def _score_state(self) -> dict[str, Any]:
        return {
            "loss_history": list(self._loss_history),
            "grad_norm_history": list(self._grad_norm_history),
            "spike_history": list(self._spike_history),
            "total_spike_count": self._total_spike_count,
            "total_step_count": self._total_step_count,
        }

    def _load_score_state(self, state: dict[str, Any]) -> None:
        self._loss_history = deque(state.get("loss_history", ()))
        self._grad_norm_history = deque(state.get("grad_norm_history", ()))
        self._spike_history = deque(state.get("spike_history", ()))
        self._total_spike_count = state.get("total_spike_count", 0)
        self._total_step_count = state.get("total_step_count", 0)


def _push(history: deque[Any], value: Any, size: int) -> None:
    history.append(value)
    while len(history) > size:
        history.popleft()
