"""Checkpointer settings. (Saving and loading arrive with the checkpointing work; the trainer
config already carries these settings so that configs written today keep working.)"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import Config

__all__ = ["CheckpointerConfig"]


@dataclass
class CheckpointerConfig(Config):
    """A configuration class for building :class:`Checkpointer` instances."""

    work_dir: str | None = None
    """Local directory for staging files; defaults to the trainer's ``work_dir``."""
    save_overwrite: bool | None = None
    """Overwrite existing checkpoints; defaults to the trainer's ``save_overwrite``."""
    pre_download: bool = False
    """Download a remote checkpoint to ``work_dir`` before loading it."""
    save_thread_count: int | None = None
    """Threads writing checkpoint files (per rank)."""
    load_thread_count: int | None = None
    """Threads reading checkpoint files (per rank)."""
    throttle_uploads: bool = False
    """Let ranks upload one after another, for object stores that limit request rates."""

    def validate(self) -> None:
        for name in ("save_thread_count", "load_thread_count"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise self._invalid(name, f"must be >= 1 if set, got {value}")
