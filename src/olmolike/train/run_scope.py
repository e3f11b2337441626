"""What surrounds ``fit()`` and ``eval_checkpoints()``: a component the trainer owns.

:class:`RunScope` reports an error (to the rank-failure monitor, the log, and every callback's
``on_error``), closes the callbacks, and then lets go of everything the trainer holds, in the
same order on every rank: the checkpointer's buffers and threads and the save folder's lease
(after the last save: the next run may start), the bookkeeping threads, and the process groups
made for the trainer. It gets the components and functions it calls, never the trainer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch.distributed as dist

from ..distributed.failure import report_rank_failure, set_failure_context
from ..distributed.utils import destroy_group, is_distributed
from ..exceptions import OLMoLikeError
from .background_ops import BookkeepingRunner
from .cancellation import CancelCoordinator, log_failure
from .checkpoint.run import RunCheckpoints
from .explain import explain_failure, stopped_at
from .step_results import StepResults

__all__ = ["RunScope"]

log = logging.getLogger(__name__)


@dataclass
class RunScope:
    """Error reporting, closing and releasing around a run (see the module docstring)."""

    checkpoints: RunCheckpoints
    """The run's checkpoint loading, whose save folder lease is given up when the run is released.
    """
    step_results: StepResults
    """The run's metric collection and pending saves, finished when the run ends."""
    bookkeeping: BookkeepingRunner
    """The runner of bookkeeping operations, closed when the run is released."""
    call_each: Callable[..., None]
    """Calls a hook on every callback even if one fails: ``call_each(name, *args,
    raise_errors=...)``."""
    owned_groups: list[dist.ProcessGroup]
    """Process groups made for this trainer, destroyed when it is released."""
    step: Callable[[], int]
    """The trainer's current step, named in the failure's log line."""
    save_folder: str
    """The run's save folder, named in the failure's log line."""
    cancel: CancelCoordinator
    """The run's cancellation: told the error the run ends on, and asked whether a second
    SIGINT aborted it."""
    error: BaseException | None = field(default=None, init=False)
    """The error the last run raised on this rank, if any."""
    released: bool = field(default=False, init=False)
    """Whether the trainer's resources have been released (a finished distributed trainer cannot run
    again)."""

    @contextmanager
    def running(self) -> Iterator[None]:
        """Around ``fit()`` or ``eval_checkpoints()``: errors are reported, callbacks closed,
        everything released."""
        if self.released and is_distributed():
            raise OLMoLikeError(
                "this trainer has finished (fit() or eval_checkpoints() returned) and destroyed "
                "the process groups it made; build a new trainer to train or evaluate again"
            )
        self.error = None
        # For the line of a rank that the failure monitor ends (another rank froze).
        set_failure_context(lambda: stopped_at(self.step(), self.save_folder))
        try:
            yield
        except BaseException as exc:
            self.cancel.error = exc
            if self.cancel.aborted:
                self._settle_saves()
            self.error = explain_failure(
                exc, self.step(), self.save_folder, interrupted=self.cancel.aborted
            )
            self.cancel.error = self.error
            self._report(self.error)
            if self.error is not exc:  # e.g. a rank died: say which, not gloo's lost connection
                raise self.error from exc
            raise
        finally:
            try:
                self._close()
            finally:
                set_failure_context(None)

    def _settle_saves(self) -> None:
        """After a second Ctrl-C, before the line that names the newest complete checkpoint
        is composed: the saves in flight finish (every rank waits for its own, so none
        leaves another's agreement short) or fail. Before, a save could commit after the
        line named an older checkpoint. A further Ctrl-C stops waiting."""
        try:
            self.step_results.settle_saves()
        except KeyboardInterrupt:
            log.info("Stopped waiting for the checkpoint saves in flight (another SIGINT)")

    def _report(self, exc: BaseException) -> None:
        first = report_rank_failure(exc)  # a later rank's failure follows from the first's
        log_failure(exc, self.step(), first=first)
        self.call_each("on_error", exc, raise_errors=False)
        # A collective stuck on a dead peer must not keep this process alive.
        self.bookkeeping.shutdown(wait=False)

    def _close(self) -> None:
        """Close hooks, then let go of everything the trainer holds, whatever they raised."""
        clean = self.error is None
        try:
            if clean:  # every rank is here: nothing to agree on
                self.step_results.deliver_saves(wait=True)
            self.call_each("close", raise_errors=clean)
            if clean:
                self.step_results.flush()  # what close hooks submitted; their errors are raised
        except BaseException:
            clean = False
            raise
        finally:
            self._release(clean=clean)

    def _release(self, *, clean: bool) -> None:
        """``clean``: no error on this rank, so nothing is stuck and the peers' last ops can
        be waited for; else nothing is waited for."""
        self.released = True
        try:
            self.checkpoints.release(wait=clean)
        finally:
            self.bookkeeping.close(clean=clean)
            for group in self.owned_groups:
                destroy_group(group, barrier=clean)
