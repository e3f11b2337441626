"""A training run's checkpoint loading: a component the trainer builds from its settings and
owns.

:class:`RunCheckpoints` loads the run's checkpoints, resumes at the start of ``fit()`` (with
fallback past damaged checkpoints), holds the files added to every checkpoint, and gives the
save folder up when the trainer is done. Saves go from the trainer straight to the
:class:`~olmolike.train.checkpoint.Checkpointer` (see ``docs/contributing-layers.md``, "A
save, from the callback to the files and back").

It imports nothing of the trainer: the trainer passes in what to restore.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ... import io
from ...distributed.checkpoint_format import DamagedCheckpointError, mark_damaged
from ...distributed.utils import broadcast_object, get_rank
from ...exceptions import CheckpointError
from .checkpointable import Checkpointable
from .checkpointer import Checkpointer, CheckpointMetadata, check_extra_file_name

__all__ = ["RunCheckpoints", "checkpoint_step"]

log = logging.getLogger(__name__)


@dataclass
class RunCheckpoints:
    """A run's checkpoint loading and the files added to its saves (see the module
    docstring)."""

    checkpointer: Checkpointer
    """Reads and writes the checkpoints."""
    train_module: Checkpointable
    """What a load restores: its model and optimizer state."""
    save_folder: str
    """The run's save folder: resumed from first, and the folder whose lease the run holds."""
    work_dir: Path
    """A local directory for remote checkpoints downloaded before loading."""
    load_path: str | None
    """Where to look when the save folder holds no checkpoint (a checkpoint, or a folder of them).
    """
    load_strategy: str
    """A :class:`~olmolike.train.LoadStrategy` value: ``if_available``, ``always``, ``never``."""
    load_trainer_state: bool | None
    """Default of :meth:`load`'s flag; ``None``: load it if the checkpoint has it."""
    load_optim_state: bool | None
    """Default of :meth:`load`'s flag; ``None``: load it if the checkpoint has it."""
    extra_files: dict[str, str | bytes] = field(default_factory=dict)
    """Files written into every checkpoint saved from now on (name to contents)."""
    loaded: bool = False
    """Whether a checkpoint has been loaded."""

    def add_file(self, name: str, contents: str | bytes) -> None:
        check_extra_file_name(name)
        self.extra_files[name] = contents

    # -- loading -----------------------------------------------------------------------------

    def load(
        self,
        dir: str | Path,
        restore: Callable[[dict[str, Any]], None],
        *,
        load_trainer_state: bool | None = None,
        load_optim_state: bool | None = None,
        reset_optimizer_states_on_load: bool = False,
    ) -> str:
        """Load a checkpoint, or the latest one in a folder of checkpoints; returns its path.

        ``restore`` receives the trainer state, when it is loaded.
        """
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
            load_trainer_state=_default(load_trainer_state, self.load_trainer_state),
            load_optim_state=_default(load_optim_state, self.load_optim_state),
            current_config=self.extra_files.get("config.json"),
        )
        if trainer_state is not None:
            restore(trainer_state)
            log.info(
                "Loaded checkpoint %s (resuming at step %d)", path, trainer_state["global_step"]
            )
        else:
            log.info("Loaded checkpoint %s (model and optimizer state only)", path)
        self.loaded = True
        if reset_optimizer_states_on_load:
            reset_optimizer_states(self.train_module)
        return path

    def resume(self, load: Callable[[str], None]) -> None:
        """What ``fit()`` does first: take the save folder's lease (one writer per folder),
        then ``load`` the save folder's latest checkpoint, else ``load_path``'s.

        A checkpoint that turns out damaged (missing, truncated, garbled or unreadable files)
        is skipped with a warning, and the next older complete one is loaded (the save
        folder's, then ``load_path``'s), exactly as a new process would load it: nothing of the
        damaged one stays. A damaged one in the save folder loses its marker (the reason is
        kept in ``.olmolike-damaged.json``), so the steps trained again can be saved there.
        Other load errors (a model of another shape, say) are raised as they are.
        """
        self.checkpointer.acquire_lease(self.save_folder)
        if self.load_strategy == "never":
            return
        # Rank 0 looks, everyone loads the same paths: listings can differ between nodes.
        paths = broadcast_object(self._checkpoints_to_load() if get_rank() == 0 else None)
        for i, path in enumerate(paths):
            try:
                load(path)
                return
            except DamagedCheckpointError as e:
                if i + 1 == len(paths):
                    raise
                log.warning("Cannot resume from %s; trying %s instead. %s", path, paths[i + 1], e)
                if get_rank() == 0 and path.startswith(self.save_folder.rstrip("/") + "/"):
                    # This run holds the folder: the steps it trains again may be saved anew.
                    mark_damaged(path, str(e))
                # Damage found while DCP reads the shards comes after some tensors were
                # overwritten in place. The next checkpoint overwrites all of the model; the
                # optimizers start afresh, as in a new process, in case it holds no optimizer
                # state (a failed load never gets to apply param groups).
                clear_optimizer_states(self.train_module)
        if self.load_strategy == "always":
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

    def release(self, *, wait: bool) -> None:
        """When the trainer is done: free the checkpointer's staging buffers and threads (``wait``
        for a save still running; else it is abandoned), then let the next run on the save
        folder start at once."""
        try:
            self.checkpointer.close(wait=wait)
        finally:
            self.checkpointer.release_lease()


def reset_optimizer_states(train_module: Checkpointable) -> None:
    """Start the optimizers' per-parameter state afresh, keeping their settings."""
    if not clear_optimizer_states(train_module):
        raise CheckpointError(
            f"reset_optimizer_states_on_load needs a train module with a torch optimizer "
            f"(an 'optim' attribute); {type(train_module).__name__} has none"
        )
    log.info("Optimizer states reset after loading (reset_optimizer_states_on_load)")


def clear_optimizer_states(train_module: Checkpointable) -> bool:
    """Drop the optimizers' per-parameter state (moments, step counts), keeping their
    settings: a new optimizer has none, and builds it at its first step. Returns whether the
    train module has torch optimizers to do it to."""
    optims: list[Any] = getattr(train_module, "optimizers", None) or [
        getattr(train_module, "optim", None)
    ]
    if not all(hasattr(o, "state") for o in optims):
        return False
    for optim in optims:
        optim.state.clear()
    return True


def checkpoint_step(dir: str) -> int:
    """The step of the checkpoint ``dir`` (or of the latest one it holds)."""
    if not Checkpointer.dir_is_checkpoint(dir) and Checkpointer.contains_checkpoint(dir):
        dir = Checkpointer.latest_checkpoint(dir)
    step = CheckpointMetadata.read(dir).step
    if step is None:
        raise CheckpointError(f"{dir} does not record its step; cannot log its metrics")
    return step


def _default(value: bool | None, default: bool | None) -> bool | None:
    return default if value is None else value
