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
    """Logs the metrics of every ``log_interval``-th step whose names match ``metrics``."""

    log_interval: int = 1
    metrics: list[str] = field(default_factory=lambda: ["train/*", "optim/*"])
    """Glob patterns of metric names to show."""

    _shown: dict[str, bool] = field(default_factory=dict, init=False, repr=False)
    """Whether a metric name matches ``metrics``, by name: matched once, not every step."""

    priority = -1

    def validate(self) -> None:
        if self.log_interval < 1:
            raise ConfigurationError(f"must be >= 1, got {self.log_interval}", path="log_interval")

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if step % self.log_interval or not log.isEnabledFor(logging.INFO):
            return
        shown = {name: value for name, value in sorted(metrics.items()) if self._is_shown(name)}
        max_steps = self.trainer.max_steps
        lines = [f"[step={step}/{max_steps if max_steps is not None else '?'}]"]
        lines += [f"    {name}={value:.4f}" for name, value in shown.items()]
        log.info("\n".join(lines))

    def _is_shown(self, name: str) -> bool:
        shown = self._shown.get(name)
        if shown is None:
            shown = any(fnmatch.fnmatchcase(name, pattern) for pattern in self.metrics)
            self._shown[name] = shown
        return shown
