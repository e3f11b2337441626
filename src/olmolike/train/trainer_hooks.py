"""The trainer's side of the callback hooks added for OLMo-core parity (``Trainer`` inherits it).

It fires ``post_checkpoint_saved`` / ``post_checkpoint_loaded`` around the checkpoint methods
of :class:`~olmolike.train.trainer_io.TrainerCheckpointing`, keeps the set of callbacks that
block ephemeral checkpoints, and answers :attr:`training_progress`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..exceptions import CheckpointError, ConfigurationError
from .callbacks.callback import CALLBACK_HOOKS, Callback
from .callbacks.hooks import EXTRA_HOOKS, check_hook_names, hook_table
from .checkpoint import Checkpointer
from .common import TrainingProgress
from .trainer_eval import TrainerEval

__all__ = ["ALL_HOOKS", "TrainerHooks"]

log = logging.getLogger(__name__)

ALL_HOOKS = CALLBACK_HOOKS + EXTRA_HOOKS


class TrainerHooks(TrainerEval):
    """Hook dispatch for checkpoints, ephemeral blocking, progress and callback names."""

    callbacks: dict[str, Callback]

    if TYPE_CHECKING:

        def _call(self, hook: str, *args: Any) -> None: ...
        def _stop_step(self) -> int: ...

        global_train_tokens_seen: int

    # -- callbacks ---------------------------------------------------------------------------

    def _hook_table(self) -> dict[str, list[Callable[..., None]]]:
        check_hook_names(self.callbacks.values(), ALL_HOOKS)
        return hook_table(self.callbacks.values(), ALL_HOOKS, Callback)

    def get_callback_name(self, callback: Callback) -> str:
        """The name under which ``callback`` is attached."""
        for name, attached in self.callbacks.items():
            if attached is callback:
                return name
        raise ValueError(f"{type(callback).__name__} is not attached to this trainer")

    @property
    def _blocking_ephemeral(self) -> set[str]:
        blocking: set[str] = self.__dict__.setdefault("_blocking_ephemeral_checkpoints", set())
        return blocking

    @property
    def block_ephemeral_checkpoints(self) -> bool:
        """Whether some callback blocks ephemeral checkpoints right now (OLMo-core's name)."""
        return bool(self._blocking_ephemeral)

    # -- progress ----------------------------------------------------------------------------

    @property
    def training_progress(self) -> TrainingProgress:
        """Where the run stands, with speed figures from the speed monitor if there is one."""
        try:
            total: int | None = max(self._stop_step(), self.global_step)
        except ConfigurationError:
            total = None
        speed = next(
            (cb for cb in self.callbacks.values() if hasattr(cb, "bps_avg")),
            None,
        )
        bps = getattr(speed, "bps_avg", None)
        remaining = None
        if bps and total is not None and total > self.global_step:
            minutes = 1 + int((total - self.global_step) / bps // 60)
            remaining = timedelta(minutes=minutes)
        return TrainingProgress(
            current_step=self.global_step,
            current_tokens=self.global_train_tokens_seen,
            total_steps=total,
            time_remaining=remaining,
            bps=bps,
            tps=getattr(speed, "tps_avg", None),
            mfu=getattr(speed, "mfu_avg", None),
        )

    # -- checkpoints -------------------------------------------------------------------------

    @property
    def _background_saves(self) -> _BackgroundSaves:
        saves: _BackgroundSaves = self.__dict__.setdefault("_background_saves_", _BackgroundSaves())
        return saves

    def save_checkpoint(self, ephemeral: bool = False) -> str:
        path = super().save_checkpoint(ephemeral)
        self._call("post_checkpoint_saved", path)
        return path

    def save_checkpoint_async(self, ephemeral: bool = False) -> tuple[str, Future[None]]:
        path, future = super().save_checkpoint_async(ephemeral)
        self._background_saves.pending.append((path, future))
        return path, future

    def _saves_done(self) -> int:
        """How many background saves of this run have finished on this rank so far."""
        saves = self._background_saves
        done = saves.delivered
        for _, future in saves.pending:
            if not future.done():
                break
            done += 1
        return done

    def _deliver_checkpoint_events(self, upto: int | None = None, *, wait: bool = False) -> None:
        """Call ``post_checkpoint_saved`` for finished background saves, in order.

        ``upto`` is how many saves every rank has seen finish (agreed by the periodic cancel
        check), so a hook that issues collectives runs at the same step on every rank;
        ``None`` (one process, or the end of training) takes every finished one. ``wait``
        first waits for the saves still running.
        """
        saves = self._background_saves
        if wait:
            futures_wait([future for _, future in saves.pending])
        while saves.pending and saves.pending[0][1].done():
            if upto is not None and saves.delivered >= upto:
                break
            path, future = saves.pending.pop(0)
            saves.delivered += 1
            if not future.cancelled() and future.exception() is None:
                self._call("post_checkpoint_saved", path)

    def load_checkpoint(
        self,
        dir: str | Path,
        *,
        load_trainer_state: bool | None = None,
        load_optim_state: bool | None = None,
        reset_optimizer_states_on_load: bool = False,
    ) -> None:
        """Load a checkpoint, or the latest one in a folder of checkpoints.

        :param reset_optimizer_states_on_load: after loading, start the optimizer's
            per-parameter state (moments, step counts) afresh while keeping its settings and
            the model's weights: e.g. to continue a run on new data without its old momentum.
        """
        path = str(dir)
        if not Checkpointer.dir_is_checkpoint(path) and Checkpointer.contains_checkpoint(path):
            path = Checkpointer.latest_checkpoint(path)
        super().load_checkpoint(
            path, load_trainer_state=load_trainer_state, load_optim_state=load_optim_state
        )
        if reset_optimizer_states_on_load:
            self._reset_optimizer_states()
        self._call("post_checkpoint_loaded", path)

    def maybe_load_checkpoint(
        self,
        dir: str | Path | None = None,
        *,
        load_trainer_state: bool | None = None,
        load_optim_state: bool | None = None,
        reset_optimizer_states_on_load: bool = False,
    ) -> bool:
        """Like :meth:`load_checkpoint`, but does nothing if ``dir`` (default: the save folder)
        holds no checkpoint. Returns whether one was loaded."""
        dir = self.save_folder if dir is None else dir
        if not Checkpointer.contains_checkpoint(dir):
            return False
        self.load_checkpoint(
            dir,
            load_trainer_state=load_trainer_state,
            load_optim_state=load_optim_state,
            reset_optimizer_states_on_load=reset_optimizer_states_on_load,
        )
        return True

    def _reset_optimizer_states(self) -> None:
        optims = getattr(self.train_module, "optimizers", None) or [
            getattr(self.train_module, "optim", None)
        ]
        if not all(hasattr(o, "state") for o in optims):
            raise CheckpointError(
                f"reset_optimizer_states_on_load needs a train module with a torch optimizer "
                f"(an 'optim' attribute); {type(self.train_module).__name__} has none"
            )
        for optim in optims:
            optim.state.clear()  # rebuilt lazily, as for a new optimizer, at the next step
        log.info("Optimizer states reset after loading (reset_optimizer_states_on_load)")


@dataclass
class _BackgroundSaves:
    pending: list[tuple[str, Future[None]]] = field(default_factory=list)
    """Background saves whose ``post_checkpoint_saved`` has not been delivered, in order."""
    delivered: int = 0
    """How many were taken off ``pending`` (delivered, or failed and skipped)."""
