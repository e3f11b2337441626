"""The base of callbacks whose output lives in the save folder and grows during the run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ... import io
from .callback import Callback

__all__: list[str] = []  # a base for this package's callbacks only


class _SaveFolderOutput(Callback):
    """A callback that writes a file or folder (:meth:`_output_name`) of the save folder.

    Rank 0 writes it in the save folder when that is local. For a remote save folder it writes
    under ``work_dir`` instead and copies it up whenever a checkpoint is saved (the trainer
    asks callbacks for their state exactly then, so the copy matches the checkpoint) and when
    training ends; each copy replaces the last, since the output only grows. What is written
    is flushed after each collection of metrics.
    """

    def _output_name(self) -> str:
        """The file or folder, relative to the save folder."""
        raise NotImplementedError

    def _flush(self) -> bool:
        """Flush what is written so far; ``False`` if nothing is open (not rank 0, or closed)."""
        raise NotImplementedError

    @property
    def _remote(self) -> bool:
        return io.is_url(self.trainer.save_folder)

    def _local_path(self) -> Path:
        """Where the output is written during the run."""
        folder = self.trainer.work_dir if self._remote else io.local_path(self.trainer.save_folder)
        return Path(folder) / self._output_name()

    def post_log_metrics(self) -> None:
        self._flush()

    def state_dict(self) -> dict[str, Any]:
        self._persist()
        return {}

    def post_train(self) -> None:
        self._persist()

    def _persist(self) -> None:
        if self._flush() and self._remote:
            name = self._output_name()
            io.persist(self.trainer.work_dir, self.trainer.save_folder, name, overwrite=True)
