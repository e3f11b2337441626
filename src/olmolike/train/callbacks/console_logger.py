"""Metrics to the log, every few steps, on rank 0: one line per record."""

from __future__ import annotations

import datetime
import fnmatch
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from ...exceptions import ConfigurationError
from ...utils import format_float
from .callback import Callback

__all__ = ["ConsoleLoggerCallback"]

log = logging.getLogger(__name__)


@dataclass
class ConsoleLoggerCallback(Callback, name="console_logger"):
    """Logs the metrics of every ``metrics_log_interval``-th step whose names match ``metrics``,
    and a progress line on the other ``log_interval``-th steps.

    Each record is one line, so a log file can be grepped:
    ``[step=50/400] train/CE loss=2.3123 optim/LR (decay)=0.0039 throughput/TPS=5,120 eta=0:02:10``
    (the time to go is measured from the steps of this run so far).
    """

    log_interval: int = 1
    """Steps between log lines (progress, or metrics when the step has them logged)."""
    metrics_log_interval: int | None = None
    """Steps between metric logs; defaults to ``log_interval``. A larger value keeps the log
    short while ``log_interval`` still shows that training moves."""
    metrics: list[str] = field(default_factory=lambda: ["train/*", "optim/*", "throughput/TPS"])
    """Glob patterns of metric names to show (``throughput/TPS``: the speed monitor's tokens
    per second over all ranks)."""

    _shown: dict[str, bool] = field(default_factory=dict, init=False, repr=False)
    """Whether a metric name matches ``metrics``, by name: matched once, not every step."""
    _start: tuple[float, int] | None = field(default=None, init=False, repr=False)
    """When (monotonic seconds) and at which step this run's training began: for the ETA."""

    priority = -1

    def validate(self) -> None:
        if self.log_interval < 1:
            raise ConfigurationError(f"must be >= 1, got {self.log_interval}", path="log_interval")
        if self.metrics_log_interval is not None and self.metrics_log_interval < 1:
            raise ConfigurationError(
                f"must be >= 1 if set, got {self.metrics_log_interval}",
                path="metrics_log_interval",
            )

    def _metrics_step(self, step: int) -> bool:
        return step % (self.metrics_log_interval or self.log_interval) == 0

    def pre_train(self) -> None:
        self._start = (time.monotonic(), self.step)

    def post_step(self) -> None:
        step = self.trainer.global_step
        # Not a step whose metrics are logged (_metrics_step, without the call: every step).
        if step % self.log_interval == 0 and step % (
            self.metrics_log_interval or self.log_interval
        ):
            log.info("[step=%d/%s,epoch=%d]%s", step, *self._progress(self.trainer.epoch))

    def _progress(self, *between: Any) -> tuple[Any, ...]:
        """The run's ``max_steps`` (``?`` if unknown), ``between``, and `` eta=...``: this
        run's seconds per step so far times the steps left (or nothing)."""
        max_steps, step = self.trainer.max_steps, self.step
        shown = "?" if max_steps is None else str(max_steps)
        if self._start is None or max_steps is None or step <= self._start[1]:
            return shown, *between, ""
        per_step = (time.monotonic() - self._start[0]) / (step - self._start[1])
        left = datetime.timedelta(seconds=round(per_step * max(max_steps - step, 0)))
        return shown, *between, f" eta={left}"

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if not self._metrics_step(step) or not log.isEnabledFor(logging.INFO):
            return
        shown = [
            f"{name}={_format(value)}"
            for name, value in sorted(metrics.items())
            if self._is_shown(name)
        ]
        log.info("[step=%d/%s] %s%s", step, *self._progress(" ".join(shown)))

    def _is_shown(self, name: str) -> bool:
        shown = self._shown.get(name)
        if shown is None:
            shown = any(fnmatch.fnmatchcase(name, pattern) for pattern in self.metrics)
            self._shown[name] = shown
        return shown


def _format(value: float) -> str:
    """Losses and learning rates to 4 decimals (runs are compared on them); counts and
    rates with thousands separators; tiny values in scientific notation."""
    return f"{value:.4f}" if 1e-3 <= abs(value) < 1000 else format_float(value)
