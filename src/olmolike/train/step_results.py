"""What the trainer does around each step besides training: a component the trainer owns.

:class:`StepResults` keeps the metrics recorded during the steps, hands their reduction to the
:class:`~olmolike.train.background_ops.BookkeepingRunner` every ``metrics_collect_interval``
steps, runs the periodic cancel check, and at the end of every step delivers the results due
then: reduced metrics to the logging hooks (``deliver_metrics``) and finished saves to
``post_checkpoint_saved`` (:meth:`StepResults.deliver_saves`, the one path by which a save's
completion reaches the callbacks), both at steps every rank agrees on (see
``docs/callbacks.md``). It keeps the future of every save the trainer starts
(:meth:`StepResults.track_save`) until that save's completion is delivered. After the first
step it shortens every process group's timeout. It never touches the trainer: the trainer
passes in the step, and the functions it calls.
"""

from __future__ import annotations

import datetime
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..distributed.utils import is_distributed, set_group_timeouts
from ..exceptions import ConfigurationError
from .background_ops import BookkeepingRunner
from .cancellation import CancelCoordinator
from .metric_buffer import MetricBuffer
from .metrics import MetricReducer, StepMetrics

__all__ = ["Hooks", "StepResults"]


class Hooks(Protocol):
    """What this component calls the callbacks with."""

    def __call__(self, hook: str, *args: Any) -> None:
        """Call ``hook`` on every callback that has it, with ``args``."""

    def deliver_metrics(self, metrics: StepMetrics) -> None:
        """Hand one collection's reduced metrics, ``{step: {name: value}}``, to the hooks
        that log them."""


@dataclass
class StepResults:
    """Per-step metric collection, cancel checks and result delivery (see the module doc)."""

    runner: BookkeepingRunner
    """Runs the collectives of bookkeeping (metric reductions, cancel checks), in the background or
    inline."""
    cancel: CancelCoordinator
    """The run's cancellation, checked every ``cancel_check_interval`` steps."""
    hooks: Hooks
    """The callbacks' hooks (the trainer's ``HookCaller``)."""
    device: torch.device
    """Where bookkeeping collectives run: the CPU with gloo, else the training device."""
    metrics_collect_interval: int
    """Steps between metric collections (the trainer's ``metrics_collect_interval``)."""
    cancel_check_interval: int
    """Steps between the agreed cancel checks (the trainer's ``cancel_check_interval``)."""
    train_timeout_seconds: int | None
    """After the first step, every process group's timeout drops to this (``None``: keep)."""
    metrics: MetricBuffer = field(default_factory=MetricBuffer)
    """The metrics recorded since the last collection."""
    reducer: MetricReducer = field(default_factory=MetricReducer)
    """Reduces the collected metrics over ranks."""
    timeouts_shortened: bool = False
    """Whether the process groups' timeouts have dropped to ``train_timeout_seconds`` (after the
    first step)."""
    pending_saves: list[tuple[str, Future[None]]] = field(default_factory=list)
    """Saves whose completion has not been delivered, in order (path, future)."""
    saves_taken: int = 0
    """How many saves were taken off ``pending_saves`` (delivered, or failed)."""

    def __post_init__(self) -> None:
        for name in ("metrics_collect_interval", "cancel_check_interval"):
            if getattr(self, name) < 1:
                raise ConfigurationError(f"must be >= 1, got {getattr(self, name)}", path=name)

    def begin_step(self, step: int) -> None:
        self.runner.step = step
        self.metrics.begin_step(step)

    def end_step(self, step: int) -> None:
        if step % self.metrics_collect_interval == 0:
            self.collect_metrics()
        saves_done_everywhere = self.cancel.resolve(step)
        if step % self.cancel_check_interval == 0:
            self.check_if_canceled(step)
        self.runner.poll(step)
        if self.pending_saves and (saves_done_everywhere is not None or not is_distributed()):
            self.deliver_saves(saves_done_everywhere)
        if not self.timeouts_shortened and self.train_timeout_seconds is not None:
            # The first step (compiling, allocating, loading) may legitimately take long.
            self.timeouts_shortened = True
            set_group_timeouts(datetime.timedelta(seconds=self.train_timeout_seconds))

    def track_save(self, path: str, future: Future[None]) -> None:
        """Keep a save the trainer started (a blocking save's future is done) until its
        completion is delivered."""
        self.pending_saves.append((path, future))

    def deliver_saves(self, upto: int | None = None, *, wait: bool = False) -> None:
        """The one path by which a save's completion reaches the callbacks:
        ``post_checkpoint_saved(path)`` for each finished save, in save order, or the failed
        save's error (every rank's save holds it, so every rank stops at the same step).

        Called at steps every rank agrees on: at the end of a step (``upto``: how many saves
        every rank has seen finish, agreed by the periodic cancel check), after a blocking save
        and at the end of a run (``None``: every finished one; ``wait``: after the saves still
        running).
        """
        if wait:
            futures_wait([future for _, future in self.pending_saves])
        while self.pending_saves and self.pending_saves[0][1].done():
            if upto is not None and self.saves_taken >= upto:
                break
            path, future = self.pending_saves.pop(0)
            self.saves_taken += 1
            if future.cancelled():
                continue
            error = future.exception()
            if error is not None:
                raise error
            self.hooks("post_checkpoint_saved", path)

    def settle_saves(self) -> None:
        """Wait until every save in flight has finished or failed, delivering nothing (the
        run is aborting): then the save folder's newest marked checkpoint is final, and a
        line that names it stays true."""
        futures_wait([future for _, future in self.pending_saves])

    def _saves_done(self) -> int:
        """How many saves of this run have finished on this rank so far."""
        done = self.saves_taken
        for _, future in self.pending_saves:
            if not future.done():
                break
            done += 1
        return done

    def check_if_canceled(self, step: int) -> None:
        saves_done = self._saves_done()
        self.cancel.submit_check(
            step, self.runner, self.runner.group, self.device, saves_done=saves_done
        )

    def collect_metrics(self) -> None:
        # Every rank joins the reduction, even with nothing recorded since the last one: a
        # rank-local metric (say rank 0's, in post_epoch) must not start a one-sided collective.
        if not self.metrics and not self.runner.distributed:
            return
        self.runner.submit(
            self.reducer,
            self.metrics.collect(),
            self.runner.group,
            self.device,
            cb=self.hooks.deliver_metrics,
            op_name="reduce_metrics",
        )

    def flush(self) -> None:
        """Reduce the metrics recorded since the last collection and deliver every result."""
        self.collect_metrics()
        self.runner.wait_all()
