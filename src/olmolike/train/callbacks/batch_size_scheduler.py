"""Grows the global batch size on a schedule, by accumulating more micro-batches per step.

Large batches train stably only once the loss has come down; early on, small batches make
faster progress per token. The schedule multiplies the data loader's global batch size at
given steps or token counts. Each rank's micro-batch stays the same size, so memory use does
not change: a bigger batch is just more micro-batches accumulated before the optimizer step.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

from ...config import Config, StrEnum
from ...exceptions import ConfigurationError, DataError
from .callback import Callback

__all__ = ["BatchSizeSchedulerCallback", "BatchSizeStage", "BatchSizeUnits"]

log = logging.getLogger(__name__)


class BatchSizeUnits(StrEnum):
    """What a stage's ``start`` counts."""

    steps = "steps"
    """Optimizer steps trained."""
    tokens = "tokens"
    """Training tokens seen (global)."""


@dataclass
class BatchSizeStage(Config):
    """From ``start`` on, train with ``factor`` times the base global batch size."""

    start: int
    """The stage begins once this many steps or tokens (see ``units``) have been trained:
    with steps, ``start=100`` makes step 101 the stage's first."""
    factor: int
    """The global batch size during the stage, as a multiple of the base size."""

    def validate(self) -> None:
        if self.start < 0:
            raise self._invalid("start", f"must be >= 0, got {self.start}")
        if self.factor < 1:
            raise self._invalid(
                "factor", f"must be a positive whole multiple of the base size, got {self.factor}"
            )


@dataclass
class BatchSizeSchedulerCallback(Callback, name="batch_size_scheduler"):
    """Changes the global batch size between steps according to ``schedule``.

    The base is the loader's global batch size when training starts; it is saved in
    checkpoints, so a resumed run scales the same base however its loader is configured. A
    change takes effect from the next batch. The loader's position must then be a whole
    number of new batches (so batches stay windows of the epoch's order); the schedule is
    checked for this at attach time for the first epoch, and a change that would not line up
    later (after an epoch boundary) waits for the next batch where it does, with a warning.
    """

    schedule: list[BatchSizeStage] = field(default_factory=list)
    """Stages sorted by ``start``; the first starts at 0."""
    units: BatchSizeUnits = BatchSizeUnits.steps
    """What the stages' ``start`` counts: ``steps`` (optimizer steps trained) or ``tokens`` (global
    training tokens seen)."""

    _base: int | None = field(default=None, init=False, repr=False)
    _factor: int | None = field(default=None, init=False, repr=False)
    _waiting_for: int | None = field(default=None, init=False, repr=False)

    def validate(self) -> None:
        if not self.schedule:
            raise ConfigurationError(
                "needs at least one stage, e.g. [BatchSizeStage(start=0, factor=1), "
                "BatchSizeStage(start=1000, factor=2)]",
                path="schedule",
            )
        if self.schedule[0].start != 0:
            raise ConfigurationError(
                f"must start at 0 (the batch size from the beginning), got "
                f"{self.schedule[0].start}; add a stage BatchSizeStage(start=0, factor=1)",
                path="schedule[0].start",
            )
        for i, (prev, stage) in enumerate(zip(self.schedule, self.schedule[1:]), start=1):
            if stage.start <= prev.start:
                raise ConfigurationError(
                    f"stages must be sorted by start with no two equal, but stage {i} starts "
                    f"at {stage.start} after stage {i - 1} at {prev.start}; sort them",
                    path=f"schedule[{i}].start",
                )

    @property
    def base_batch_size(self) -> int | None:
        """The global batch size (tokens) the factors multiply, once known."""
        return self._base

    @property
    def factor(self) -> int | None:
        """The factor in effect, once training has started."""
        return self._factor

    # -- checks ------------------------------------------------------------------------------

    def post_attach(self) -> None:
        loader = self.trainer.data_loader
        if not loader.supports_batch_size_changes:
            raise ConfigurationError(
                f"{type(loader).__name__} cannot change its batch size during an epoch; use "
                "a loader that can (NumpyDataLoader, TokenTensorDataLoader) or remove the "
                "batch_size_scheduler callback",
                path="callbacks.batch_size_scheduler",
            )
        self._check_sizes(self._base or loader.global_batch_size)
        self._warn_about_duration_units()

    def _check_sizes(self, base: int) -> None:
        self._check_micro_batches(base)
        self._check_first_epoch_alignment(base)

    def _check_micro_batches(self, base: int) -> None:
        module = self.trainer.train_module
        micro = getattr(module, "rank_microbatch_size", None)
        if micro is None:
            micro = getattr(getattr(module, "config", None), "rank_microbatch_size", None)
        if micro is None:
            log.debug("%s has no rank_microbatch_size to check", type(module).__name__)
            return
        world = self.trainer.data_loader.dp_world_size
        for i, stage in enumerate(self.schedule):
            rank_batch = base * stage.factor // world
            if rank_batch % micro:
                raise ConfigurationError(
                    f"stage {i} makes each rank's batch {rank_batch} tokens ({stage.factor} x "
                    f"the base {base} / {world} ranks), not a multiple of the train module's "
                    f"rank_microbatch_size ({micro} tokens); pick a factor or micro-batch size "
                    "that divides it",
                    path=f"schedule[{i}].factor",
                )

    def _check_first_epoch_alignment(self, base: int) -> None:
        """Each change must land where the epoch's consumed data is a whole number of new
        batches. Checked for the first epoch of a fresh run, where it can be worked out."""
        consumed = 0  # in base batches
        steps = 0
        for i, (prev, stage) in enumerate(zip(self.schedule, self.schedule[1:]), start=1):
            if self.units == BatchSizeUnits.steps:
                taken = stage.start - steps
            else:
                taken = math.ceil(max(0, stage.start - consumed * base) / (prev.factor * base))
            consumed, steps = consumed + taken * prev.factor, steps + taken
            if consumed % stage.factor == 0:
                continue
            extra = next(
                k
                for k in range(1, stage.factor + 1)
                if (consumed + k * prev.factor) % stage.factor == 0
            )
            fix = (
                f"start={stage.start + extra}"
                if self.units == BatchSizeUnits.steps
                else f"start={(consumed + extra * prev.factor) * base} (tokens)"
            )
            raise ConfigurationError(
                f"stage {i} (factor {stage.factor}) would begin after {consumed} base batches "
                f"of the first epoch, not a multiple of {stage.factor}, so its batches would "
                f"not be whole windows of the data order; use {fix}",
                path=f"schedule[{i}].start",
            )

    def _warn_about_duration_units(self) -> None:
        scheduler = getattr(self.trainer.train_module, "scheduler", None)
        lr_units = getattr(scheduler, "units", None)
        duration = self.trainer.max_duration
        if lr_units is None or str(lr_units) == str(duration.unit):
            return
        log.warning(
            "max_duration is %d %s but the LR schedule counts %s: the batch size schedule "
            "changes how many %s that duration amounts to during the run, so the LR schedule's "
            "length shifts at every batch size change. Give max_duration and the LR scheduler "
            "the same units (steps or tokens) to keep it fixed.",
            duration.value,
            duration.unit,
            lr_units,
            lr_units,
        )

    # -- the schedule ------------------------------------------------------------------------

    def pre_train(self) -> None:
        loader = self.trainer.data_loader
        if self._base is None:
            self._base, self._factor = loader.global_batch_size, 1
        else:
            # Resumed: continue at the checkpoint's size, which its position lines up with.
            if self._base != loader.global_batch_size:
                log.info(
                    "Scaling the checkpoint's base batch size of %d tokens, not the loader's "
                    "configured %d",
                    self._base,
                    loader.global_batch_size,
                )
                self._check_sizes(self._base)
            loader.global_batch_size = self._base * (self._factor or 1)
        self._apply()

    def pre_load_batch(self) -> None:
        self._apply()

    def _target_factor(self) -> int:
        trainer = self.trainer
        done = (
            trainer.global_step
            if self.units == BatchSizeUnits.steps
            else trainer.global_train_tokens_seen
        )
        return [stage.factor for stage in self.schedule if stage.start <= done][-1]

    def _apply(self) -> None:
        target = self._target_factor()
        if target == self._factor or self._base is None:
            return
        size = self._base * target
        try:
            self.trainer.data_loader.global_batch_size = size
        except DataError as exc:
            if self._waiting_for != target:
                log.warning(
                    "Step %d: the batch size change to %dx waits for a batch where it lines up: %s",
                    self.trainer.global_step + 1,
                    target,
                    exc,
                )
                self._waiting_for = target
            return
        log.info(
            "Step %d: global batch size %d -> %d tokens (%dx the base of %d)",
            self.trainer.global_step + 1,
            self._base * (self._factor or 1),
            size,
            target,
            self._base,
        )
        self._factor, self._waiting_for = target, None

    def state_dict(self) -> dict[str, Any]:
        return {"base": self._base, "factor": self._factor}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._base = state_dict["base"]
        self._factor = state_dict["factor"]
