"""Saves checkpoints at intervals and at the end of training; removes old ones by rule."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass, field

from ...distributed.utils import get_rank
from ...exceptions import ConfigurationError
from ..checkpoint import Checkpointer
from .callback import Callback

__all__ = ["CheckpointerCallback"]

log = logging.getLogger(__name__)


@dataclass
class CheckpointerCallback(Callback, name="checkpointer"):
    """Saves a checkpoint every ``save_interval`` steps and when training ends.

    Ephemeral checkpoints (every ``ephemeral_save_interval`` steps) are for resuming after a
    preemption: only the newest is kept, and it is removed once a newer checkpoint of any kind
    is complete, never before. Removal is done by rank 0, marker first; step folders left
    without a marker by a killed removal or save are removed after the next save.
    """

    save_interval: int = 250
    """Steps between permanent checkpoints."""
    ephemeral_save_interval: int | None = None
    """Steps between ephemeral checkpoints (only the newest is kept)."""
    pre_train_checkpoint: bool | None = None
    """Save a checkpoint before the first step; by default only when not resuming."""
    save_async: bool = False
    """Write checkpoints in the background; training waits only for the copy to CPU memory."""
    max_checkpoints: int | None = None
    """Keep at most this many permanent checkpoints (the newest); ``None`` keeps them all."""
    enabled: bool = True
    """``False`` saves no checkpoint at all (nor does the trainer's ``no_checkpoints=True``)."""

    _pending: list[tuple[str, Future[None], bool]] = field(
        default_factory=list, init=False, repr=False
    )
    _last_saved_step: int | None = field(default=None, init=False, repr=False)
    _failed: bool = field(default=False, init=False, repr=False)
    _staging_prepared: bool = field(default=False, init=False, repr=False)

    priority = 1

    def validate(self) -> None:
        if self.save_interval < 1:
            raise ConfigurationError(
                f"must be >= 1, got {self.save_interval}", path="save_interval"
            )
        if (
            self.ephemeral_save_interval is not None
            and not 1 <= self.ephemeral_save_interval < self.save_interval
        ):
            raise ConfigurationError(
                f"must be >= 1 and below save_interval ({self.save_interval}), "
                f"got {self.ephemeral_save_interval}",
                path="ephemeral_save_interval",
            )
        if self.max_checkpoints is not None and self.max_checkpoints < 1:
            raise ConfigurationError(
                f"must be >= 1 if set, got {self.max_checkpoints}", path="max_checkpoints"
            )

    @property
    def active(self) -> bool:
        return self.enabled and not self.trainer.no_checkpoints

    @property
    def last_saved_step(self) -> int | None:
        """The step of the newest checkpoint this callback started saving in this process."""
        return self._last_saved_step

    def pre_train(self) -> None:
        if not self.active:
            return
        wanted = self.pre_train_checkpoint
        if wanted is None:
            wanted = not self.trainer.checkpoint_loaded
        if wanted and self.trainer.global_step == 0:
            self._save(ephemeral=False)

    def post_step(self) -> None:
        if not self.active:
            return
        self._collect_finished(wait=False)
        step = self.trainer.global_step
        if self.save_async and not self._staging_prepared:
            self.trainer.checkpointer.prepare_async_staging(self.trainer.train_module)
            self._staging_prepared = True
        if self.trainer.training_complete:
            return  # post_train saves the final checkpoint, and as a permanent one
        if step % self.save_interval == 0:
            self._save(ephemeral=False)
        elif (
            self.ephemeral_save_interval
            and step % self.ephemeral_save_interval == 0
            and not self.trainer.block_ephemeral_checkpoints
        ):
            self._save(ephemeral=True)

    def post_train(self) -> None:
        if not self.active:
            return
        step = self.trainer.global_step
        already_saved = self._last_saved_step == step or Checkpointer.dir_is_checkpoint(
            self.trainer._step_dir()
        )
        if not already_saved:  # a restarted, finished run must not save (or fail) again
            self._save(ephemeral=False)
        self._collect_finished(wait=True)

    def on_error(self, exc: BaseException) -> None:
        self._failed = True

    def close(self) -> None:
        # After an error a background save may wait on a dead peer: do not wait for it then.
        if not self._failed and self._pending:
            self._collect_finished(wait=True)

    def _save(self, *, ephemeral: bool) -> None:
        trainer = self.trainer
        if self.save_async:
            path, future = trainer.save_checkpoint_async(ephemeral=ephemeral)
            self._pending.append((path, future, ephemeral))
        else:
            path = trainer.save_checkpoint(ephemeral=ephemeral)
            self._after_save(path, ephemeral)
        self._last_saved_step = trainer.global_step

    def _collect_finished(self, *, wait: bool) -> None:
        while self._pending and (wait or self._pending[0][1].done()):
            path, future, ephemeral = self._pending.pop(0)
            future.result()  # a failed save raises here, in the training loop
            self._after_save(path, ephemeral)

    def _after_save(self, path: str, ephemeral: bool) -> None:
        """Retention, by rank 0, once the checkpoint at ``path`` is complete.

        Ephemeral checkpoints of earlier steps than ``path`` are removed, so a newer one is
        never removed in favour of an older one (two async saves may be collected at once).
        Step folders without a marker (a removal or save killed half-way) are removed too,
        except those of saves still in progress.
        """
        if get_rank() != 0:
            return
        folder = self.trainer.save_folder
        saved_step = _step_of(path)
        for step, old in Checkpointer.find_checkpoints(folder, ephemeral=True):
            if step < saved_step:
                log.info("Removing ephemeral checkpoint %s", old)
                Checkpointer.remove_checkpoint(old)
        in_progress = [pending for pending, _, _ in self._pending]
        Checkpointer.remove_abandoned(folder, keep=[path, *in_progress])
        if ephemeral or self.max_checkpoints is None:
            return
        permanent = list(Checkpointer.find_checkpoints(folder, ephemeral=False))
        for _, old in permanent[: max(0, len(permanent) - self.max_checkpoints)]:
            log.info("Removing checkpoint %s (max_checkpoints=%d)", old, self.max_checkpoints)
            Checkpointer.remove_checkpoint(old)


def _step_of(path: str) -> int:
    name = path.rstrip("/").rsplit("/", 1)[-1]
    return int(name[len("step") :]) if name.startswith("step") and name[4:].isdigit() else -1
