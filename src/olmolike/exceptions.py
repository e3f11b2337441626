"""The exception hierarchy: catch :class:`OLMoLikeError` to catch everything olmolike raises on purpose."""

from __future__ import annotations

__all__ = [
    "BookkeepingError",
    "CheckpointError",
    "ConfigurationError",
    "DamagedCheckpointError",
    "DataError",
    "DiskFullError",
    "DistributedContextError",
    "MetricError",
    "NetworkError",
    "OLMoLikeError",
    "RankLostError",
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


class DiskFullError(CheckpointError):
    """A checkpoint save ran out of disk space; the checkpoint was left without a marker.

    The message names the folder, about how much a checkpoint needs, what is free, and the last
    complete checkpoint.
    """


class RankLostError(OLMoLikeError):
    """Another rank of the job died or stopped responding: this rank cannot go on.

    Not a mistake of the user's, and not this rank's bug: the message names the rank that is
    gone, how (a signal or exit status where this host can see it), and, from the trainer,
    where the run can resume. Every surviving rank prints it as its one line.
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
