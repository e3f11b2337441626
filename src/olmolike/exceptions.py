"""The exception hierarchy: catch :class:`OLMoLikeError` to catch everything olmolike raises on purpose."""

from __future__ import annotations

__all__ = [
    "BookkeepingError",
    "CheckpointError",
    "ConfigurationError",
    "DamagedCheckpointError",
    "DataError",
    "DistributedContextError",
    "MetricError",
    "NetworkError",
    "OLMoLikeError",
]


class OLMoLikeError(Exception):
    """Base class for every error olmolike raises deliberately."""


class ConfigurationError(OLMoLikeError, ValueError):
    """A configuration is invalid: an unknown key, a wrong type, or an impossible value.

    The message names the dotted path of the offending field and how to fix it.
    """

    def __init__(self, reason: str, *, path: str = "") -> None:
        self.reason = reason
        self.path = path
        super().__init__(f"{path}: {reason}" if path else reason)

    def under(self, prefix: str) -> ConfigurationError:
        """The same error, reported for a field nested under ``prefix``."""
        if not prefix:
            return self
        return ConfigurationError(
            self.reason, path=f"{prefix}.{self.path}" if self.path else prefix
        )


class CheckpointError(OLMoLikeError):
    """A checkpoint could not be saved, found, or loaded."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint with a marker whose files are missing, truncated, garbled or unreadable.

    A resume skips such a checkpoint for the next older one; other checkpoint errors (a model
    of another shape, say) are raised as they are.
    """


class DistributedContextError(OLMoLikeError, RuntimeError):
    """A single-process operation (unsharding a checkpoint, say) was called from a process of a
    distributed run. A ``RuntimeError`` too, as OLMo-core raises for the same mistake."""


class NetworkError(OLMoLikeError):
    """A remote storage operation failed after all retries."""


class DataError(OLMoLikeError):
    """Training or evaluation data is malformed or inconsistent."""


class MetricError(OLMoLikeError, ValueError):
    """A metric was recorded inconsistently (e.g. its reduce type changed)."""


class BookkeepingError(OLMoLikeError):
    """A background bookkeeping operation was used incorrectly."""
