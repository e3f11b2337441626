"""Turn "one rank crashed, the others hang in a collective until the timeout" into a prompt exit.

A rank that fails writes a short report into the job's key-value store (the one torchrun or
``MASTER_ADDR:MASTER_PORT`` provides). Every rank runs a daemon thread that polls the store;
when it sees another rank's report it gives the process a grace period to fail on its own
(gloo usually raises at once when a peer disappears), then ends it with a message that names
the rank that failed and its error. NCCL collectives, which can block until their timeout,
are covered the same way.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import sys
import tempfile
import threading
import traceback
from pathlib import Path
from types import TracebackType

import torch.distributed as dist

from ..exceptions import OLMoLikeError

__all__ = [
    "RankFailureMonitor",
    "exiting_on_error",
    "install_error_hook",
    "install_exit_on_error",
    "print_uncaught",
    "rank_failed",
    "report_rank_failure",
    "start_failure_monitor",
    "stop_failure_monitor",
]

log = logging.getLogger(__name__)

GRACE_ENV = "OLMOLIKE_RANK_FAILURE_GRACE_SECONDS"
DEFAULT_GRACE_SECONDS = 15.0
EXIT_CODE = 3


class RankFailureMonitor:
    """Reports this rank's failure and watches for the failures of other ranks."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        *,
        attempt: str = "0",
        poll_interval: float = 0.5,
        grace_period: float = DEFAULT_GRACE_SECONDS,
    ) -> None:
        self.rank = rank
        self.poll_interval = poll_interval
        self.grace_period = grace_period
        self._store = store
        self._key = f"olmolike/rank_failure/{attempt}"
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._reported = False
        self._first = True
        self._thread = threading.Thread(
            target=self._watch, name="rank-failure-monitor", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (normal shutdown: a peer that exits is no longer a failure).

        Waits for the thread to end: left inside a store call at interpreter exit, it would
        race the C++ runtime's teardown, which aborts the process now and then.
        """
        self._stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.poll_interval + 30)

    @property
    def reported(self) -> bool:
        """Whether this rank reported its failure."""
        return self._reported

    def report(self, exc: BaseException) -> bool:
        """Tell every other rank that this one failed with ``exc``. Idempotent.

        Returns whether this rank's failure was the job's first (the one to show the user).
        """
        with self._lock:
            if self._reported:
                return self._first
            self._reported = True
            summary = f"rank {self.rank} failed with {type(exc).__name__}: {exc}"
            try:
                # The first failure is the cause; later ones are usually its consequences.
                self._first = self._store.add(f"{self._key}/count", 1) == 1
                if self._first:
                    self._store.set(self._key, summary[:2000])
            except Exception as store_error:  # the job is already failing; do not mask exc
                log.warning(
                    "Could not report this rank's failure to the other ranks: %s", store_error
                )
            return self._first

    def _watch(self) -> None:
        while not self._stopped.wait(self.poll_interval):
            if self._reported:
                return  # this rank failed itself and is on its way out: let it finish
            try:
                with self._lock:
                    failed = self._store.check([self._key])
                    message = self._store.get(self._key).decode() if failed else ""
            except Exception as e:
                # The store lives on rank 0 (or the launcher): losing it means they are gone.
                self._terminate(f"the job's key-value store is unreachable ({e})")
                return
            if failed and not message.startswith(f"rank {self.rank} "):
                self._terminate(message)
                return

    def _terminate(self, why: str) -> None:
        log.error(
            "Rank %d is stopping because %s. Waiting %.0fs for it to exit on its own.",
            self.rank,
            why,
            self.grace_period,
        )
        if self._stopped.wait(self.grace_period):
            return
        sys.stderr.write(f"[rank {self.rank}] exiting: {why}\n")
        sys.stderr.flush()
        logging.shutdown()
        os._exit(EXIT_CODE)


_monitor: RankFailureMonitor | None = None
_stopped_monitor: RankFailureMonitor | None = None


def start_failure_monitor(rank: int) -> RankFailureMonitor | None:
    """Start watching for peer failures, if the launcher gave us a store address."""
    global _monitor
    if _monitor is not None:
        return _monitor
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        log.debug("No MASTER_ADDR/MASTER_PORT: rank failure monitoring is off")
        return None
    store = dist.TCPStore(
        host,
        int(port),
        is_master=False,
        timeout=datetime.timedelta(seconds=30),
        wait_for_workers=False,
    )
    grace = float(os.environ.get(GRACE_ENV, DEFAULT_GRACE_SECONDS))
    # torchrun keeps one store across restarts: key the reports by attempt so an old failure
    # does not end the new attempt.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    _monitor = RankFailureMonitor(store, rank, attempt=attempt, grace_period=grace)
    _monitor.start()
    return _monitor


def stop_failure_monitor() -> None:
    """Stop and join the rank-failure monitor: from here on, a peer exiting is no failure."""
    global _monitor, _stopped_monitor
    if _monitor is not None:
        _monitor.stop()
        # Still reports: a script's `finally: teardown_training_environment()` runs before
        # its error reaches the exception hook, which asks whether it was the first failure.
        _stopped_monitor, _monitor = _monitor, None


_exiting = False
"""Whether this rank is exiting on an uncaught error, without the interpreter's teardown."""


def rank_failed() -> bool:
    """Whether this rank reported a failure to the other ranks: they may be gone or stuck."""
    monitor = _monitor or _stopped_monitor
    return monitor is not None and monitor.reported


def exiting_on_error() -> bool:
    """Whether this rank is ending on an uncaught error with ``os._exit`` (after its ``atexit``
    handlers), the way :func:`install_exit_on_error` ends it."""
    return _exiting


def report_rank_failure(exc: BaseException) -> bool:
    """Report ``exc`` to the other ranks; whether it is the job's first failure (True when
    not monitoring: a single process's failure is always the one to show)."""
    monitor = _monitor or _stopped_monitor
    return monitor.report(exc) if monitor is not None else True


def print_uncaught(
    exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
) -> bool:
    """Print an uncaught exception the short way, if it is one: returns False otherwise.

    An :class:`OLMoLikeError` (a mistake the user can fix) or a :class:`KeyboardInterrupt`
    (Ctrl-C; what it cut short is logged) is one line, printed only by the job's first failing
    rank (every rank usually raises the same one); the failure of a rank that followed
    another rank's is one line too. Their full tracebacks go to a file, whose
    path the line gives. Any other error of the first failing rank is a bug: not handled here.
    """
    first = report_rank_failure(exc)
    if first and not isinstance(exc, (OLMoLikeError, KeyboardInterrupt)):
        return False
    where = Path(tempfile.gettempdir()) / f"olmolike-traceback-{os.getpid()}.txt"
    try:
        where.write_text("".join(traceback.format_exception(exc_type, exc, tb)))
    except OSError:
        where = Path("(not written)")
    if first:
        kind = "interrupted" if isinstance(exc, KeyboardInterrupt) else "error"
        sys.stderr.write(f"{kind}: {exc or 'KeyboardInterrupt'}\n(full traceback: {where})\n")
    elif not isinstance(exc, (OLMoLikeError, KeyboardInterrupt)):  # the first one said why
        monitor = _monitor or _stopped_monitor
        rank = f"rank {monitor.rank}" if monitor is not None else "this rank"
        what = str(exc).splitlines()[0][:200] if str(exc) else ""
        sys.stderr.write(
            f"{rank} stopped after another rank's failure: {exc_type.__name__}: {what} "
            f"(full traceback: {where})\n"
        )
    sys.stderr.flush()
    return True


def install_error_hook() -> None:
    """Print uncaught errors the short way (:func:`print_uncaught`), in a single process."""
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if not print_uncaught(exc_type, exc, tb):
            previous(exc_type, exc, tb)

    if getattr(previous, "olmolike", False):
        return
    hook.olmolike = True  # type: ignore[attr-defined]
    sys.excepthook = hook


EXIT_HANDLERS_TIMEOUT = 10.0
"""Seconds a failing rank gives its ``atexit`` handlers before it exits."""

_hook_installed = False


def install_exit_on_error() -> None:
    """Make an uncaught exception end this rank with status 1 and its traceback, promptly.

    The exception is reported to the other ranks and printed; ``atexit`` handlers get
    :data:`EXIT_HANDLERS_TIMEOUT` seconds; then the process exits without the interpreter's
    and the C++ runtime's teardown. That teardown would otherwise run while background
    threads are still inside collectives (an async save, a metric reduction) on process
    groups that were never destroyed, which aborts the process with SIGABRT ("terminate
    called without an active exception") and hides the real error's exit status.
    """
    global _hook_installed
    if _hook_installed:
        return
    _hook_installed = True
    previous = sys.excepthook
    if getattr(previous, "olmolike", False):  # install_error_hook's: this one does its work
        previous = sys.__excepthook__

    def hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if not print_uncaught(exc_type, exc, tb):
            previous(exc_type, exc, tb)
        _exit_without_teardown(1)

    sys.excepthook = hook


def _exit_without_teardown(code: int) -> None:
    global _exiting
    _exiting = True
    finished = threading.Event()

    def run_handlers() -> None:
        try:
            atexit._run_exitfuncs()
        finally:
            finished.set()

    threading.Thread(target=run_handlers, name="exit-handlers", daemon=True).start()
    if not finished.wait(EXIT_HANDLERS_TIMEOUT):
        sys.stderr.write(f"exit handlers still running after {EXIT_HANDLERS_TIMEOUT:.0f}s\n")
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed pipe must not change the exit status
            stream.flush()
    os._exit(code)
