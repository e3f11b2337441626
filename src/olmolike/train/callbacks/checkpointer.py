"""Saves checkpoints at intervals, at fixed steps and at the end of training; removes old ones
by rule (OLMo-core 3.0's ``CheckpointerCallback`` fields and meaning).

Retention (rank 0, once a save is complete) removes whole checkpoints; every removal is a
purge (:meth:`~olmolike.train.checkpoint.Checkpointer.purge_checkpoint`): the marker now, the
files on a background thread, so a large checkpoint never holds up training."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from ...config import StrEnum, check_choice
from ...distributed.checkpoint_format import step_of
from ...distributed.utils import backend_supports_cpu, get_rank, is_distributed
from ...exceptions import CheckpointError, ConfigurationError
from ..checkpoint import Checkpointer
from .callback import Callback

__all__ = ["CheckpointRemovalStrategy", "CheckpointerCallback", "checkpoints_to_remove"]

log = logging.getLogger(__name__)


class CheckpointRemovalStrategy(StrEnum):
    """Which checkpoints of earlier runs, found in the save folder, a checkpointer removes."""

    ephemeral_only = "ephemeral_only"
    """Only ephemeral checkpoints (the default)."""

    all_non_permanent = "all_non_permanent"
    """Ephemeral checkpoints and any other that is not at a multiple of ``save_interval`` or
    at one of ``fixed_steps`` (e.g. left by a run with other settings)."""

    never = "never"
    """None: old checkpoints stay. This run's own ephemeral checkpoints are still replaced."""


def checkpoints_to_remove(
    strategy: CheckpointRemovalStrategy,
    found: Iterable[tuple[int, str, bool]],
    *,
    save_interval: int | None,
    fixed_steps: Iterable[int] = (),
    keep: Iterable[str] = (),
) -> list[str]:
    """The paths a strategy removes among ``found`` checkpoints ``(step, path, ephemeral)``.

    ``keep`` (e.g. the checkpoint just saved) is never removed; neither is step 0's.
    """
    strategy = check_choice(strategy, CheckpointRemovalStrategy, "strategy")
    kept, fixed = set(keep), set(fixed_steps)
    out = []
    for step, path, ephemeral in sorted(found):
        if path in kept or step == 0 or strategy == CheckpointRemovalStrategy.never:
            continue
        permanent_step = step in fixed or (save_interval is not None and step % save_interval == 0)
        if ephemeral or (
            strategy == CheckpointRemovalStrategy.all_non_permanent and not permanent_step
        ):
            out.append(path)
    return out


@dataclass
class CheckpointerCallback(Callback, name="checkpointer"):
    """Saves a checkpoint every ``save_interval`` steps, at ``fixed_steps`` and when training
    ends.

    Ephemeral checkpoints (every ``ephemeral_save_interval`` steps) are for resuming after a
    preemption: only the newest is kept, and it is removed once a newer checkpoint of any kind
    is complete, never before. Removal is done by rank 0, marker first; step folders left
    without a marker by a killed removal or save are removed after the next save.
    """

    save_interval: int | None = 250
    """Steps between permanent checkpoints; ``None`` saves only at ``fixed_steps`` and at the
    end."""
    ephemeral_save_interval: int | None = None
    """Steps between ephemeral checkpoints (only the newest is kept): cheap insurance against
    preemption between two permanent checkpoints."""
    pre_train_checkpoint: bool | None = None
    """Save a checkpoint before the first step; by default only when not resuming."""
    save_async: bool | None = None
    """Write checkpoints in the background; training waits only for the copy to CPU memory.

    ``None`` (OLMo-core's default) means: in the background when the checkpointer's process
    group can run CPU collectives (gloo), which the background writer needs; decided when
    training starts.
    """
    remove: CheckpointRemovalStrategy = CheckpointRemovalStrategy.ephemeral_only
    """Which checkpoints of earlier runs in the save folder to remove (once this run's next
    checkpoint is complete)."""
    ephemeral_cooldown: int | None = None
    """Steps after any checkpoint during which no ephemeral one is saved, so that a permanent
    checkpoint is not followed at once by a redundant ephemeral one."""
    fixed_steps: list[int] | None = None
    """Steps at which to save permanent checkpoints in addition to ``save_interval`` (e.g. the
    end of a learning-rate schedule's stable phase)."""
    max_checkpoints: int | None = None
    """Keep at most this many permanent checkpoints (the newest); ``None`` keeps them all.

    OLMo-core 3.0 defaults to 3; olmolike never deletes a permanent checkpoint unless asked.
    """
    enabled: bool = True
    """``False`` saves no checkpoint at all (nor does the trainer's ``no_checkpoints=True``)."""

    _saving: dict[str, bool] = field(default_factory=dict, init=False, repr=False)
    """This callback's saves whose completion has not reached it yet (path: ephemeral)."""
    _last_saved_step: int | None = field(default=None, init=False, repr=False)
    _own_ephemeral: list[str] = field(default_factory=list, init=False, repr=False)
    _old_to_remove: list[str] = field(default_factory=list, init=False, repr=False)
    _prepared_for: int | None = field(default=None, init=False, repr=False)
    """The step of the save for which this callback had the checkpointer prepare staging
    buffers, until a save uses them or they are discarded."""

    priority = 1

    def validate(self) -> None:
        if self.save_interval is not None and self.save_interval < 1:
            raise ConfigurationError(
                f"must be >= 1 (or None), got {self.save_interval}", path="save_interval"
            )
        if self.ephemeral_save_interval is not None and not (
            1 <= self.ephemeral_save_interval < (self.save_interval or float("inf"))
        ):
            raise ConfigurationError(
                f"must be >= 1 and below save_interval ({self.save_interval}), "
                f"got {self.ephemeral_save_interval}",
                path="ephemeral_save_interval",
            )
        for name in ("max_checkpoints", "ephemeral_cooldown"):
            value, least = getattr(self, name), 1 if name == "max_checkpoints" else 0
            if value is not None and value < least:
                raise ConfigurationError(f"must be >= {least} if set, got {value}", path=name)
        if self.fixed_steps is not None and any(step < 1 for step in self.fixed_steps):
            raise ConfigurationError(
                f"steps must be >= 1 (step 0 is pre_train_checkpoint), got {self.fixed_steps}",
                path="fixed_steps",
            )

    @property
    def active(self) -> bool:
        return self.enabled and not self.trainer.no_checkpoints

    @property
    def last_saved_step(self) -> int | None:
        """The step of the newest checkpoint this callback started saving in this process."""
        return self._last_saved_step

    @property
    def checkpointer(self) -> Checkpointer:
        """The trainer's checkpointer (OLMo-core's shortcut, for subclasses)."""
        return self.trainer.checkpointer

    @property
    def save_folder(self) -> str:
        """The trainer's save folder (OLMo-core's shortcut, for subclasses)."""
        return self.trainer.save_folder

    @property
    def checkpoint_pending(self) -> bool:
        """Whether a save of this callback is not complete yet (as far as it was told)."""
        return bool(self._saving)

    def pre_train(self) -> None:
        if not self.active:
            return
        if self.save_async is None:
            group = self.trainer.checkpointer.process_group
            self.save_async = is_distributed() and backend_supports_cpu(group)
        if get_rank() == 0:
            self._old_to_remove = self._find_old_to_remove()
        wanted = self.pre_train_checkpoint
        if wanted is None:
            wanted = not self.trainer.checkpoint_loaded
        if wanted and self.trainer.global_step == 0:
            self._save(ephemeral=False)

    def _find_old_to_remove(self) -> list[str]:
        """Checkpoints of earlier runs (up to this step) that ``remove`` says to remove."""
        found = [
            (step, path, _is_ephemeral(path))
            for step, path in Checkpointer.find_checkpoints(self.trainer.save_folder)
            if step <= self.trainer.global_step
        ]
        old = checkpoints_to_remove(
            self.remove, found, save_interval=self.save_interval, fixed_steps=self.fixed_steps or ()
        )
        for path in old:
            log.info("Found %s from an earlier run; removing it after the next save", path)
        return old

    def post_step(self) -> None:
        trainer = self.trainer
        if not self.enabled or trainer.no_checkpoints:  # not self.active (read every step)
            if self._prepared_for is not None:  # saves were switched off (stability monitor)
                self._discard_prepared()
            return
        step = trainer.global_step
        if self.save_async and self.saves_at(step + 1) and self._prepared_for is None:
            # Buffers of the next save, allocated while this step's successor runs.
            trainer.checkpointer.prepare_async_staging(trainer.train_module)
            self._prepared_for = step + 1
        permanent = self._permanent_due(step)
        ephemeral = not permanent and self._ephemeral_due(step)
        # Asked only when it matters: most steps neither save nor hold prepared buffers.
        due = permanent or ephemeral or self._prepared_for == step
        if due and trainer.training_complete:
            return  # post_train saves the final checkpoint, and as a permanent one
        if permanent or ephemeral:
            self._save(ephemeral=ephemeral)
        elif self._prepared_for == step:  # an ephemeral save blocked since they were prepared
            self._discard_prepared()

    def saves_at(self, step: int) -> bool:
        """Whether the end of ``step`` saves a checkpoint (before the last step)."""
        return self.active and (self._permanent_due(step) or self._ephemeral_due(step))

    def _permanent_due(self, step: int) -> bool:
        return bool(self.fixed_steps and step in self.fixed_steps) or (
            self.save_interval is not None and step % self.save_interval == 0
        )

    def _ephemeral_due(self, step: int) -> bool:
        if not self.ephemeral_save_interval or step % self.ephemeral_save_interval != 0:
            return False
        if self.trainer.block_ephemeral_checkpoints:
            return False
        last, cooldown = self._last_saved_step, self.ephemeral_cooldown
        return cooldown is None or last is None or step - last >= cooldown

    def post_train(self) -> None:
        if not self.active:
            self._discard_prepared()
            return
        step = self.trainer.global_step
        already_saved = self._last_saved_step == step or Checkpointer.dir_is_checkpoint(
            self.trainer.checkpoint_dir()
        )
        if not already_saved:  # a restarted, finished run must not save (or fail) again
            self._save(ephemeral=False)
        self._discard_prepared()
        # Callbacks after this one (lower priority) find every checkpoint complete and retained.
        self.trainer.wait_for_checkpoints()

    def _discard_prepared(self) -> None:
        """Free the staging buffers this callback had prepared for a save that will not come
        (another checkpointer callback's stay: they are for its save)."""
        if self._prepared_for is not None:
            self._prepared_for = None
            self.trainer.checkpointer.discard_prepared_staging()

    def _save(self, *, ephemeral: bool) -> None:
        trainer = self.trainer
        self._prepared_for = None  # a save uses the buffers prepared for it
        path = trainer.checkpoint_dir()
        self._saving[path] = ephemeral  # a blocking save is delivered before it returns
        if ephemeral:
            self._own_ephemeral.append(path)
        if self.save_async:
            trainer.save_checkpoint_async(ephemeral=ephemeral)
        else:
            trainer.save_checkpoint(ephemeral=ephemeral)
        self._last_saved_step = trainer.global_step

    def post_checkpoint_saved(self, path: str) -> None:
        """Retention, once a checkpoint this callback saved is complete (the trainer delivers
        completion, at a step every rank agrees on: see
        :meth:`~olmolike.train.step_results.StepResults.deliver_saves`). Only rank 0 removes
        anything."""
        ephemeral = self._saving.pop(path, None)
        if ephemeral is None or get_rank() != 0:
            return  # another's save (a user's, another checkpointer's)
        self._retain(path, ephemeral)
        self._old_to_remove = []

    def _retain(self, saved: str, ephemeral: bool) -> None:
        """Purge what goes once ``saved`` is complete: ephemeral checkpoints of earlier steps
        (only this run's, unless ``remove`` says otherwise), so a newer one is never removed in
        favour of an older one (two async saves may complete at once); the checkpoints of
        earlier runs that ``remove`` picked; step folders without a marker (a removal or save
        killed half-way), except those of saves in progress; and, after a permanent save, the
        oldest permanent ones beyond ``max_checkpoints``."""
        folder = self.trainer.save_folder
        saved_step = step_of(saved)
        remove_others = self.remove != CheckpointRemovalStrategy.never
        for step, old in Checkpointer.find_checkpoints(folder, ephemeral=True):
            own = old in self._own_ephemeral
            if saved_step is not None and step < saved_step and (own or remove_others):
                log.info("Removing ephemeral checkpoint %s", old)
                Checkpointer.purge_checkpoint(old)
                if own:
                    self._own_ephemeral.remove(old)
        for old in self._old_to_remove:
            if Checkpointer.dir_is_checkpoint(old):
                log.info("Removing checkpoint %s of an earlier run (remove)", old)
                Checkpointer.purge_checkpoint(old)
        Checkpointer.remove_abandoned(folder, keep=[saved, *self._saving])
        if ephemeral or self.max_checkpoints is None:
            return
        permanent = list(Checkpointer.find_checkpoints(folder, ephemeral=False))
        for _, old in permanent[: max(0, len(permanent) - self.max_checkpoints)]:
            log.info("Removing checkpoint %s (max_checkpoints=%d)", old, self.max_checkpoints)
            Checkpointer.purge_checkpoint(old)


def _is_ephemeral(path: str) -> bool:
    try:
        return bool(Checkpointer.checkpoint_metadata(path)["ephemeral"])
    except CheckpointError:  # a malformed marker: of neither kind, as find_checkpoints treats it
        return False
