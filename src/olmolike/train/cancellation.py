"""Canceling a run: any rank may ask, every rank stops at the same step.

A rank that calls :meth:`CancelCoordinator.request` only marks itself. Every
``cancel_check_interval`` steps all ranks submit a check to the bookkeeping thread (a MAX
all-reduce of "who asked", then a broadcast of the reason). The check submitted at step ``s``
is resolved at the end of step ``s + 1`` on every rank: usually already finished, and
otherwise waited for. Resolving at a fixed step, instead of whenever the background result
happens to arrive, is what makes every rank stop at the same step; two ranks stopping one step
apart would leave one of them waiting forever in the next step's collectives.

With a single process there is nobody to agree with, and a request takes effect at the end
of the current step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import traceback
from collections.abc import Iterator
from concurrent.futures import Future
from types import FrameType
from typing import cast

import torch
import torch.distributed as dist

from ..distributed.failure import print_uncaught
from ..distributed.utils import broadcast_object, get_rank
from ..exceptions import OLMoLikeError
from .background_ops import BookkeepingRunner
from .explain import last_checkpoint

__all__ = ["CancelCoordinator", "exit_if_signaled", "log_failure"]

log = logging.getLogger(__name__)

_Verdict = tuple[int, str] | None  # (canceling rank, reason)


class CancelCoordinator:
    """One rank's side of the cancel protocol above: its own request, the pending check and,
    once a check found a request, who canceled and why."""

    def __init__(self, *, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.canceled = False
        self.reason: str | None = None
        self.canceling_rank: int | None = None
        self.error: BaseException | None = None
        """The error the run is ending on, once there is one: a signal then asks only for what
        is under way already."""
        self.aborted = False
        """Whether a second SIGINT aborted the run."""
        self._requested: str | None = None
        self._check: tuple[int, Future[tuple[_Verdict, int]]] | None = None

    def request(self, reason: str, *, no_sync: bool = False) -> None:
        """Ask for the run to stop. ``no_sync`` means every rank asks at the same step."""
        if self._requested is not None or self.canceled:
            return
        self._requested = reason
        # A launcher's SIGTERM to a rank that is already failing (torchrun ends the ranks
        # left once one died) is no news: the failure's own line says what happened.
        level = logging.INFO if self.error is not None else logging.WARNING
        log.log(level, "Rank %d asks to cancel the run: %s", self.rank, reason)
        if no_sync or self.world_size == 1:
            self._apply((self.rank, reason))

    def submit_check(
        self,
        step: int,
        runner: BookkeepingRunner,
        group: dist.ProcessGroup | None,
        device: torch.device,
        *,
        saves_done: int = 0,
    ) -> None:
        """Start a check (every rank, same step); it is resolved at the end of ``step + 1``.

        The same all-reduce agrees on how many background saves every rank has seen finish
        (``saves_done`` is this rank's count), so their ``post_checkpoint_saved`` hooks run at
        an agreed step too.
        """
        if self.world_size == 1 or self.canceled or self._check is not None:
            return
        future = runner.submit(
            _agree_on_cancel,
            self._requested,
            self.rank,
            saves_done,
            group,
            device,
            op_name="check_if_canceled",
        )
        self._check = (step, future)

    def resolve(self, step: int) -> int | None:
        """Apply a check submitted before ``step``, waiting for it if it is still running.

        Returns the number of background saves finished on every rank, if a check resolved.
        """
        if self._check is None or self._check[0] >= step:
            return None
        _, future = self._check
        self._check = None
        verdict, saves_done = future.result()
        if verdict is not None:
            self._apply(verdict)
        return saves_done

    def _apply(self, verdict: tuple[int, str]) -> None:
        self.canceled = True
        self.canceling_rank, self.reason = verdict

    def log_outcome(self, step: int) -> None:
        """Say who canceled the run and why, if it was canceled (at the end of training)."""
        if self.canceled:
            log.warning(
                "Run canceled at step %d by rank %s: %s", step, self.canceling_rank, self.reason
            )

    @contextlib.contextmanager
    def signals_cancel(self) -> Iterator[None]:
        """While active, SIGTERM and SIGINT cancel the run gracefully; a second SIGINT aborts."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        signals_received = 0

        def handle(signum: int, frame: FrameType | None) -> None:
            del frame
            nonlocal signals_received
            signals_received += 1
            name = signal.Signals(signum).name
            if signum == signal.SIGINT and signals_received > 1:
                self.aborted = True
                raise KeyboardInterrupt(f"second {name}: aborting without a graceful stop")
            self.request(_SIGNAL_REASON.format(name))

        previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            # A rank's error ends its process (failure.install_exit_on_error): until its
            # hook runs, a launcher's SIGTERM must not end it without a word.
            failing_rank = self.error is not None and self.world_size > 1
            if failing_rank and previous[signal.SIGTERM] is signal.SIG_DFL:
                signal.signal(signal.SIGTERM, self._say_why_then_end)

    def _say_why_then_end(self, signum: int, frame: FrameType | None) -> None:
        """SIGTERM while the run's error is on its way to the exception hook (torchrun sends it
        to the ranks left once one died): print the error's line first, then end as SIGTERM
        always did. The hook ignores SIGTERM once it runs."""
        del frame
        error = cast(BaseException, self.error)
        if not print_uncaught(type(error), error, error.__traceback__):
            traceback.print_exception(error)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


_SIGNAL_REASON = "received {}"


def exit_if_signaled(reason: str | None, step: int, save_folder: str) -> None:
    """End a run that SIGINT or SIGTERM canceled (on any rank) with a non-zero exit, once it
    is saved and closed, so the shell or scheduler sees an interrupted job, not a finished one.

    SIGINT raises :class:`KeyboardInterrupt` (exit 130), SIGTERM ``SystemExit(143)``.
    """
    signum = next(
        (s for s in (signal.SIGINT, signal.SIGTERM) if reason == _SIGNAL_REASON.format(s.name)),
        None,
    )
    if signum is None:
        return
    message = (
        f"run canceled at step {step} ({reason}); {last_checkpoint(save_folder)}: run the "
        "same command again to resume"
    )
    if signum == signal.SIGINT:
        raise KeyboardInterrupt(message)
    if get_rank() == 0:
        log.warning(message)
    raise SystemExit(128 + signum)


def log_failure(exc: BaseException, step: int, *, first: bool) -> None:
    """Log why training stopped, at info level when the exception's own line says it (a
    Ctrl-C, an :class:`OLMoLikeError`: the exception hook prints it) or when it follows from
    another rank's failure."""
    said = isinstance(exc, (OLMoLikeError, KeyboardInterrupt))
    level = logging.ERROR if first and not said else logging.INFO
    log.log(level, "Training failed at step %d: %s: %s", step, type(exc).__name__, exc)


def _agree_on_cancel(
    requested: str | None,
    rank: int,
    saves_done: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> tuple[_Verdict, int]:
    # One MAX all-reduce: the highest canceling rank, and the lowest count of finished saves.
    flags = [0 if requested is None else rank + 1, -saves_done]
    flag = torch.tensor(flags, dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    canceling_rank, agreed_saves = int(flag[0].item()) - 1, -int(flag[1].item())
    if canceling_rank < 0:
        return None, agreed_saves
    reason = broadcast_object(requested, src=canceling_rank, group=group)
    return (canceling_rank, str(reason)), agreed_saves
