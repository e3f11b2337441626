"""Metrics to the log, every few steps, on rank 0."""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass, field

from ...exceptions import ConfigurationError
from .callback import Callback

__all__ = ["ConsoleLoggerCallback"]

log = logging.getLogger(__name__)


@dataclass
class ConsoleLoggerCallback(Callback, name="console_logger"):
    """Logs the metrics of every ``metrics_log_interval``-th step whose names match ``metrics``,
    and a progress line on the other ``log_interval``-th steps."""

    log_interval: int = 1
    """Steps between log lines (progress, or metrics when the step has them logged)."""
    metrics_log_interval: int | None = None
    """Steps between metric logs; defaults to ``log_interval``. A larger value keeps the log
    short while ``log_interval`` still shows that training moves."""
    metrics: list[str] = field(default_factory=lambda: ["train/*", "optim/*"])
    """Glob patterns of metric names to show."""

    _shown: dict[str, bool] = field(default_factory=dict, init=False, repr=False)
    """Whether a metric name matches ``metrics``, by name: matched once, not every step."""

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

    def post_step(self) -> None:
        step = self.step
        if step % self.log_interval == 0 and not self._metrics_step(step):
            log.info("[step=%d/%s,epoch=%d]", step, self._max_steps(), self.trainer.epoch)

    def _max_steps(self) -> str:
        max_steps = self.trainer.max_steps
        return "?" if max_steps is None else str(max_steps)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if not self._metrics_step(step) or not log.isEnabledFor(logging.INFO):
            return
        shown = {name: value for name, value in sorted(metrics.items()) if self._is_shown(name)}
        lines = [f"[step={step}/{self._max_steps()}]"]
        lines += [f"    {name}={value:.4f}" for name, value in shown.items()]
        log.info("\n".join(lines))

    def _is_shown(self, name: str) -> bool:
        shown = self._shown.get(name)
        if shown is None:
            shown = any(fnmatch.fnmatchcase(name, pattern) for pattern in self.metrics)
            self._shown[name] = shown
        return shown
