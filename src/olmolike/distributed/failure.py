"""Turn "one rank crashed, the others hang in a collective until the timeout" into a prompt exit.

A rank that fails writes a short report into the job's key-value store (the one torchrun,
``olmolike train --nproc-per-node`` or ``MASTER_ADDR:MASTER_PORT`` provides). Every rank runs
a daemon thread that polls the store (:mod:`.rank_monitor`); when it sees another rank's
report it gives the process a grace period to fail on its own (gloo usually raises at once
when a peer disappears), then ends it with a message that names the rank that failed and its
error. NCCL collectives, which can block until their timeout, are covered the same way, and
so is a rank that froze (its heartbeat went silent). This module starts the monitor and
prints the uncaught errors the short way, once per job.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import math
import os
import signal
import sys
import tempfile
import threading
import traceback
from collections.abc import Iterator
from pathlib import Path
from types import FrameType, TracebackType

import torch.distributed as dist

from ..exceptions import ConfigurationError, OLMoLikeError, RankLostError
from .lost_ranks import describe_lost_ranks
from .rank_monitor import (
    DEFAULT_FROZEN_SECONDS,
    DEFAULT_GRACE_SECONDS,
    EXIT_CODE,
    FROZEN_ENV,
    GRACE_ENV,
    RankFailureMonitor,
    set_failure_context,
    tell_torchrun,
)

__all__ = [
    "DEFAULT_FROZEN_SECONDS",
    "DEFAULT_GRACE_SECONDS",
    "EXIT_CODE",
    "FROZEN_ENV",
    "GRACE_ENV",
    "RankFailureMonitor",
    "check_frozen_timeout",
    "exiting_on_error",
    "find_lost_ranks",
    "frozen_rank_timeout",
    "install_error_hook",
    "install_exit_on_error",
    "let_others_report",
    "print_uncaught",
    "rank_failed",
    "report_rank_failure",
    "set_failure_context",
    "start_failure_monitor",
    "stop_failure_monitor",
    "tell_torchrun",
]

log = logging.getLogger(__name__)

_monitor: RankFailureMonitor | None = None
_stopped_monitor: RankFailureMonitor | None = None


def start_failure_monitor(
    rank: int, frozen_timeout: float | None = None
) -> RankFailureMonitor | None:
    """Start watching for peer failures, if the launcher gave us a store address.

    ``frozen_timeout``: seconds without a heartbeat after which a rank is frozen (0: never
    named); by default ``$OLMOLIKE_FROZEN_RANK_TIMEOUT``, else :data:`DEFAULT_FROZEN_SECONDS`.
    """
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
    refusal: ConfigurationError | None = None
    try:
        if frozen_timeout is None:
            frozen_timeout = frozen_rank_timeout()
        else:
            frozen_timeout = check_frozen_timeout(frozen_timeout, "frozen_rank_timeout")
    except ConfigurationError as e:  # said once per job: by the monitor's first failing rank
        refusal, frozen_timeout = e, DEFAULT_FROZEN_SECONDS
    # torchrun keeps one store across restarts: key the reports by attempt so an old failure
    # does not end the new attempt.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    # torchrun's agent (and olmolike's launcher) hold the store its ranks use; else rank 0.
    store_rank = None if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else 0
    _monitor = RankFailureMonitor(
        store,
        rank,
        attempt=attempt,
        world_size=world_size,
        store_rank=store_rank,
        grace_period=grace,
        frozen_timeout=frozen_timeout,
    )
    _monitor.start()
    if refusal is not None:
        raise refusal
    return _monitor


def frozen_rank_timeout() -> float:
    """``$OLMOLIKE_FROZEN_RANK_TIMEOUT`` (seconds), else :data:`DEFAULT_FROZEN_SECONDS`,
    checked (:func:`check_frozen_timeout`)."""
    text = os.environ.get(FROZEN_ENV)
    if text is None:
        return DEFAULT_FROZEN_SECONDS
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    return check_frozen_timeout(seconds, FROZEN_ENV, shown=repr(text))


_LONGEST_WAIT = threading.TIMEOUT_MAX / 2
"""Longer waits overflow the clock of a thread's wait (about 146 years)."""


def check_frozen_timeout(seconds: float, name: str, *, shown: str | None = None) -> float:
    """``seconds`` as a frozen-rank timeout: 0 (never) for 0 or infinity. Anything else
    that is not a duration a thread can wait for is refused, naming ``name``: a negative
    one made every call to the store time out at once, and an infinite one overflowed, both
    ending a healthy job with a line that blamed the store's holder."""
    if seconds == math.inf:
        return 0.0
    if not 0 <= seconds <= _LONGEST_WAIT:
        raise ConfigurationError(
            f"{name} must be a number of seconds >= 0 (0 or inf: never name a rank frozen), "
            f"got {shown if shown is not None else seconds}"
        )
    return float(seconds)


def stop_failure_monitor() -> None:
    """Stop and join the rank-failure monitor: from here on, a peer exiting is no failure."""
    global _monitor, _stopped_monitor
    if _monitor is not None:
        _monitor.stop()
        # Still reports: a script's `finally: teardown_training_environment()` runs before
        # its error reaches the exception hook, which asks whether it was the first failure.
        _stopped_monitor, _monitor = _monitor, None


def let_others_report(timeout: float = 10.0) -> None:
    """On the rank whose process holds the job's store (rank 0 without a launcher that
    holds it), before its process group ends the store: up to ``timeout`` seconds until every
    other rank has ended its run, reported its failure or seen another's."""
    monitor = _monitor or _stopped_monitor
    if monitor is not None and monitor.roster.store_rank == monitor.rank:
        monitor.wait_for_others(timeout)


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
    """Report ``exc`` to the other ranks; whether it is the job's first failure, the one to
    show (True when not monitoring: a single process's failure is always the one to show;
    False once a monitor printed the job's line, say that a rank froze: an error of this
    rank's after that, a collective's lost connection, follows from it)."""
    monitor = _monitor or _stopped_monitor
    if monitor is None:
        return True
    return monitor.report(exc) and not monitor.line_said


_PRINTED: set[int] = set()
"""The exceptions whose line is printed: torchrun's SIGTERM can arrive while the exception
hook prints one, and its handler prints the same error first (whichever runs first wins)."""


def print_uncaught(
    exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
) -> bool:
    """Print an uncaught exception the short way, if it is one: returns False otherwise.

    An :class:`OLMoLikeError` (a mistake the user can fix) or a :class:`KeyboardInterrupt`
    (Ctrl-C; the line says what it cut short) is one line, printed only by the job's first
    failing rank (every rank usually raises the same one). A :class:`RankLostError`, or any
    error of a rank whose peer died (:func:`find_lost_ranks`), is one line on every rank left;
    the failure of a rank that followed another rank's is one line too. Their full tracebacks
    go to a file, whose path the line ends with. Any other error of the first failing rank is
    a bug: not handled here.
    """
    if id(exc) in _PRINTED:  # the exception hook and a SIGTERM handler both got here
        return True
    first = report_rank_failure(exc)
    monitor = _monitor or _stopped_monitor
    if monitor is not None and monitor.line_said:
        return True  # a monitor found the cause and printed the job's line
    line = _short_line(exc, first)
    if line is None:
        return False
    where = Path(tempfile.gettempdir()) / f"olmolike-traceback-{os.getpid()}.txt"
    try:
        where.write_text("".join(traceback.format_exception(exc_type, exc, tb)))
    except OSError:
        where = Path("(not written)")
    if line:
        line = f"{line} (full traceback: {where})"
        sys.stderr.write(f"{line}\n")
        _PRINTED.add(id(exc))
        tell_torchrun(line)
    sys.stderr.flush()
    return True


def _short_line(exc: BaseException, first: bool) -> str | None:
    """The line that stands for ``exc``: empty when another rank's line says it already,
    ``None`` for a bug (its traceback is the message)."""
    monitor = _monitor or _stopped_monitor
    rank = f"rank {monitor.rank}" if monitor is not None else "this rank"
    what = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
    if isinstance(exc, RankLostError):
        return f"error: {exc}"
    if isinstance(exc, (OLMoLikeError, KeyboardInterrupt)):
        if not first:
            return ""
        kind = "interrupted" if isinstance(exc, KeyboardInterrupt) else "error"
        return f"{kind}: {exc or 'KeyboardInterrupt'}"
    if first and (lost := find_lost_ranks(exc)) is not None:
        return f"error: {lost}; {rank} stopped on {what}"
    if first:
        return None
    return f"{rank} stopped after another rank's failure: {what}"


_LOST_PEER_SIGNS = (
    "connection closed",
    "connection reset",
    "broken pipe",
    "connection refused",
    "timed out",
    "timeout",
)
"""What the error of a collective whose peer vanished says (gloo, NCCL, the store)."""


def find_lost_ranks(exc: BaseException, *, wait: float = 3.0) -> str | None:
    """If ``exc`` may come from a rank that vanished (a lost connection, a timeout), name the
    ranks that are gone and how (see :mod:`.lost_ranks`); ``None`` otherwise."""
    monitor = _monitor or _stopped_monitor
    if monitor is None or monitor.roster.world_size < 2:
        return None
    chain: list[BaseException] = []
    seen: BaseException | None = exc
    while seen is not None and len(chain) < 10:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    text = " ".join(str(e).lower() for e in chain)
    if not any(isinstance(e, dist.DistError) for e in chain) and not any(
        sign in text for sign in _LOST_PEER_SIGNS
    ):
        return None
    return describe_lost_ranks(monitor.roster, wait=wait)


def install_error_hook() -> None:
    """Print uncaught errors the short way (:func:`print_uncaught`), in a single process."""
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        with _shielded(keep_sigterm_ignored=False):
            if not print_uncaught(exc_type, exc, tb):
                previous(exc_type, exc, tb)

    if getattr(previous, "olmolike", False):
        return
    hook.olmolike = True  # type: ignore[attr-defined]
    sys.excepthook = hook


@contextlib.contextmanager
def _shielded(*, keep_sigterm_ignored: bool) -> Iterator[None]:
    """While the uncaught error is printed, SIGINT and SIGTERM wait; afterwards a further
    Ctrl-C ends the exiting process at once, quietly (a traceback from wherever the exit
    happened to be, an ``atexit`` handler say, would bury the line just printed)."""
    try:
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: signals are not ours to handle
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, _exit_at_once)
        if not keep_sigterm_ignored:
            signal.signal(signal.SIGTERM, previous)


def _exit_at_once(signum: int, frame: FrameType | None) -> None:
    del frame
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(128 + signum)


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
        # A launcher (torchrun's agent) ends the ranks left with SIGTERM when one fails: that
        # must not cut this rank's line short. It exits within EXIT_HANDLERS_TIMEOUT anyway.
        with _shielded(keep_sigterm_ignored=True):
            if not print_uncaught(exc_type, exc, tb):
                previous(exc_type, exc, tb)
        # A Ctrl-C ends a process with 130 (128 + SIGINT), also a rank's.
        _exit_without_teardown(130 if isinstance(exc, KeyboardInterrupt) else 1)

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
