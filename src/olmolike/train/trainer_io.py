"""The trainer's checkpoint and file methods, apart from the loop (``Trainer`` inherits them)."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import io
from ..distributed.checkpoint_format import DamagedCheckpointError, mark_damaged
from ..distributed.utils import broadcast_object, get_rank
from ..exceptions import CheckpointError
from .checkpoint import Checkpointer, check_extra_file_name
from .common import LoadStrategy

if TYPE_CHECKING:
    from .train_module import TrainModule

__all__ = ["TrainerCheckpointing"]

log = logging.getLogger(__name__)


class TrainerCheckpointing(ABC):
    """Saving, loading and persisting files, for :class:`~olmolike.train.Trainer`."""

    train_module: TrainModule
    save_folder: str
    work_dir: Path
    checkpointer: Checkpointer
    save_overwrite: bool
    load_path: str | None
    load_strategy: LoadStrategy
    load_trainer_state: bool | None
    load_optim_state: bool | None
    global_step: int
    _checkpoint_loaded: bool
    _checkpoint_files: dict[str, str | bytes]

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Trainer state (counters, data position, RNG, callbacks)."""

    @abstractmethod
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...

    @property
    def checkpoint_loaded(self) -> bool:
        """Whether a checkpoint has been loaded."""
        return self._checkpoint_loaded

    def _step_dir(self) -> str:
        return io.join_path(self.save_folder, f"step{self.global_step}")

    def add_checkpoint_file(self, name: str, contents: str | bytes) -> None:
        """Include a file named ``name`` in every checkpoint saved from now on.

        Rank 0 writes it into the checkpoint folder before the completion marker, so a copied
        checkpoint folder carries it. Adding a name again replaces its contents.
        """
        check_extra_file_name(name)
        self._checkpoint_files[name] = contents

    def save_checkpoint(self, ephemeral: bool = False) -> str:
        """Save a checkpoint of the current step to the save folder; returns its path."""
        path = self._step_dir()
        self.checkpointer.save(
            path,
            self.train_module,
            self.state_dict(),
            ephemeral=ephemeral,
            extra_files=self._checkpoint_files,
        )
        return path

    def save_checkpoint_async(self, ephemeral: bool = False) -> tuple[str, Future[None]]:
        """Start saving a checkpoint of the current step; the future completes when it is whole."""
        path = self._step_dir()
        future = self.checkpointer.save_async(
            path,
            self.train_module,
            self.state_dict(),
            ephemeral=ephemeral,
            extra_files=self._checkpoint_files,
        )
        return path, future

    def load_checkpoint(
        self,
        dir: str | Path,
        *,
        load_trainer_state: bool | None = None,
        load_optim_state: bool | None = None,
    ) -> None:
        """Load a checkpoint, or the latest one in a folder of checkpoints."""
        path = str(dir)
        if not Checkpointer.dir_is_checkpoint(path):
            if not Checkpointer.contains_checkpoint(path):
                raise CheckpointError(
                    f"{path} is not a complete checkpoint (it has no marker) and holds none"
                )
            path = Checkpointer.latest_checkpoint(path)
        log.info("Loading checkpoint %s", path)
        trainer_state = self.checkpointer.load(
            path,
            self.train_module,
            load_trainer_state=self.load_trainer_state
            if load_trainer_state is None
            else load_trainer_state,
            load_optim_state=self.load_optim_state
            if load_optim_state is None
            else load_optim_state,
            current_config=self._checkpoint_files.get("config.json"),
        )
        if trainer_state is not None:
            self.load_state_dict(trainer_state)
        self._checkpoint_loaded = True
        log.info("Loaded checkpoint %s (resuming at step %d)", path, self.global_step)

    def maybe_load_checkpoint(
        self,
        dir: str | Path | None = None,
        *,
        load_trainer_state: bool | None = None,
        load_optim_state: bool | None = None,
    ) -> bool:
        """Like :meth:`load_checkpoint`, but does nothing if ``dir`` (default: the save folder)
        holds no checkpoint. Returns whether one was loaded."""
        dir = self.save_folder if dir is None else dir
        if not Checkpointer.contains_checkpoint(dir):
            return False
        self.load_checkpoint(
            dir, load_trainer_state=load_trainer_state, load_optim_state=load_optim_state
        )
        return True

    def _load_on_start(self) -> None:
        """What ``fit()`` does first: take the save folder's lease (one writer per folder),
        then load the save folder's latest checkpoint, else ``load_path``.

        A checkpoint that turns out damaged (missing, truncated or unreadable files) is skipped
        with a warning, and the next older complete one is loaded (the save folder's, then
        ``load_path``'s); a damaged one in the save folder loses its marker (the reason is
        kept in ``.olmolike-damaged.json``), so the steps trained again can be saved there.
        Other load errors (a model of another shape, say) are raised as they are.
        """
        self.checkpointer.acquire_lease(self.save_folder)
        if self.load_strategy == LoadStrategy.never:
            return
        # Rank 0 looks, everyone loads the same paths: listings can differ between nodes.
        paths = broadcast_object(self._checkpoints_to_load() if get_rank() == 0 else None)
        for i, path in enumerate(paths):
            try:
                self.load_checkpoint(path)
                return
            except DamagedCheckpointError as e:
                if i + 1 == len(paths):
                    raise
                log.warning("Cannot resume from %s; trying %s instead. %s", path, paths[i + 1], e)
                if get_rank() == 0 and path.startswith(self.save_folder.rstrip("/") + "/"):
                    # This run holds the folder: the steps it trains again may be saved anew.
                    mark_damaged(path, str(e))
        if self.load_strategy == LoadStrategy.always:
            raise CheckpointError(
                f"load_strategy is 'always' but there is no checkpoint in the save folder "
                f"({self.save_folder}) or at load_path ({self.load_path})"
            )

    def _checkpoints_to_load(self) -> list[str]:
        """Complete checkpoints to try, best first: the save folder's, newest first, then
        ``load_path`` (itself if it is one, else the ones it holds, newest first)."""
        load_path = self.load_path
        if load_path is not None:
            load_path = io.resolve_download_url(load_path, self.work_dir / "downloads")
        paths: list[str] = []
        for candidate in (self.save_folder, load_path):
            if candidate is None:
                continue
            if Checkpointer.dir_is_checkpoint(candidate):
                paths.append(str(candidate))
            else:
                found = Checkpointer.find_checkpoints(candidate)
                paths += [path for _, path in reversed(list(found))]
        return paths

    def _release_save_folder(self) -> None:
        """Let the next run on the save folder start at once (``fit()`` calls it at the end)."""
        self.checkpointer.release_lease()

    def write_file(self, name: str, contents: str | bytes, dir: str | Path | None = None) -> str:
        """Write ``contents`` to ``name`` under ``dir`` (default: the save folder)."""
        return io.write_file(dir or self.save_folder, name, contents, overwrite=self.save_overwrite)

    def persist_working_file(self, name: str | Path) -> str:
        """Copy ``work_dir/name`` to ``save_folder/name`` (nothing to do if they are the same)."""
        if not (self.work_dir / name).is_file():
            raise FileNotFoundError(f"{self.work_dir / name} is not a file")
        return io.persist(self.work_dir, self.save_folder, name, overwrite=self.save_overwrite)

    def persist_working_subdir(self, name: str | Path) -> str:
        """Copy the directory ``work_dir/name`` to ``save_folder/name``."""
        if not (self.work_dir / name).is_dir():
            raise NotADirectoryError(f"{self.work_dir / name} is not a directory")
        return io.persist(self.work_dir, self.save_folder, name, overwrite=self.save_overwrite)
