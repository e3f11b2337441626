"""A metrics sink (W&B, Aim) in a child process, so its Python work never slows training.

Tracker SDKs do a lot of Python per logged step: W&B ~0.6 ms (protobuf records, a round trip
to its service through an asyncio thread), Aim ~0.2 ms per scalar. In the training process
that time is either spent on the training thread or, on a helper thread, taken from it through
the GIL. In a child process it overlaps with training for the cost of queueing a small message.

The child builds the sink with ``factory()`` and then runs its methods in the order they were
sent. :meth:`SinkProcess.send` does not wait; :meth:`SinkProcess.call` waits for the result.
:meth:`SinkProcess.buffer` keeps calls until the next send, call or :meth:`SinkProcess.flush`,
so that a collect interval's steps are one message. A failed ``send`` is reported once, and
raised in the parent at the next ``send`` or ``call``; the child then ignores further sends (a
tracker that failed once would only fail again).

Training never waits for a sink that is behind, up to a bound. Messages are pickled on the
calling thread into a queue of at most ``max_pending`` messages; a feeder thread writes them to
the child's pipe, and it is the one that waits while the child is behind. Only a sink more than
``max_pending`` messages behind makes training wait (with a warning), and one that then takes
nothing for ``stall_timeout`` seconds counts as hung: a :class:`SinkError`. What is still
queued is lost if the training process is killed outright (SIGKILL); a resume logs the steps
after its checkpoint again anyway.

The child is a fresh interpreter (``python -c``) that imports only what the sink needs, not
the user's training script: ``multiprocessing``'s spawn would run a script without an
``if __name__ == "__main__"`` guard again in the child, training and all. It ignores SIGINT
and SIGTERM, which a terminal or a scheduler sends to the whole process group: the trainer
turns them into a graceful stop and still finishes the sink's run; a child whose parent is
gone sees the pipe close and exits. It runs at ``nice`` +5 (see :data:`SINK_NICENESS`), which
its own children (W&B's service) inherit.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.connection as mpc
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

from ...exceptions import OLMoLikeError

__all__ = ["SinkError", "SinkProcess"]

log = logging.getLogger(__name__)

SINK_NICENESS = 5
"""How much lower the sink's CPU priority is than training's. Where both want a core, Linux
gives a process at +5 about a third of the CPU time of one at +0: training keeps most of it,
and a tracker (a few percent of a step's CPU) still keeps up on a machine whose cores are busy
with other work. ``SCHED_IDLE`` or +19 would starve it there: a ``SCHED_IDLE`` child on 2 cores
at load 15 made no progress for minutes."""

MAX_PENDING = 10_000
"""How many messages (one per metrics collection, a few hundred bytes each) may wait in the
training process for a sink that is behind: thousands of steps, which a tracker at ~2 ms per
step works off in seconds."""

STALL_TIMEOUT_S = 600.0
"""How long training waits for a sink that is ``max_pending`` messages behind to take the next
one before the sink counts as hung and a :class:`SinkError` stops the wait."""

_SEND, _CALL = "send", "call"
_REPLY, _ERROR = "reply", "error"


class SinkError(OLMoLikeError):
    """A metrics sink failed in its process (the message holds its traceback)."""


class SinkProcess:
    """Runs the object built by ``factory`` (picklable, e.g. a class) in a child process."""

    def __init__(
        self,
        factory: Callable[[], Any],
        name: str,
        max_pending: int = MAX_PENDING,
        stall_timeout: float = STALL_TIMEOUT_S,
    ) -> None:
        self.name = name
        self._stall_timeout = stall_timeout
        self._closed = False
        self._warned_behind = False
        self._failure: str | None = None
        self._buffered: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self._outbox: queue.Queue[memoryview | None] = queue.Queue(max_pending)
        parent_end, child_end = socket.socketpair()
        with child_end:
            fd = child_end.fileno()
            command = f"from {__name__} import serve_fd; serve_fd({fd})"
            # The import path as arguments: unpickling the factory may import from it.
            argv = [sys.executable, "-c", command, *sys.path]
            try:
                self._process = subprocess.Popen(argv, pass_fds=[fd])
            except BaseException:
                parent_end.close()
                raise
        self._socket = parent_end  # shut down by the feeder at the end: the child's EOF
        self._conn = mpc.Connection(os.dup(parent_end.fileno()))
        # poll(), not select(): select() cannot watch a descriptor numbered 1024 or higher.
        self._can_read = select.poll()
        self._can_read.register(self._conn.fileno(), select.POLLIN)
        self._feeder = threading.Thread(target=self._feed, name=f"{name}-feeder", daemon=True)
        self._feeder.start()
        try:
            self._post(factory)
        except BaseException:
            self._stop_child()
            raise

    def send(self, method: str, *args: Any, **kwargs: Any) -> None:
        """Run ``sink.method(*args, **kwargs)`` in the child, without waiting for it."""
        self.buffer(method, *args, **kwargs)
        self.flush()

    def buffer(self, method: str, *args: Any, **kwargs: Any) -> None:
        """Like :meth:`send`, but kept here until the next send, call or flush."""
        self._buffered.append((method, args, kwargs))

    def flush(self) -> None:
        """Send the buffered calls, in one message."""
        self._raise_reported_failure()
        self._post_buffered()

    def call(self, method: str, *args: Any, timeout: float = 300.0, **kwargs: Any) -> Any:
        """Run ``sink.method(*args, **kwargs)`` in the child after everything sent before, and
        return its result (its exception is raised here as a :class:`SinkError`).

        A call that does not return within ``timeout`` seconds leaves the sink failed: its
        late reply would otherwise answer the next call."""
        self.flush()
        deadline = time.monotonic() + timeout
        what = f"{method}()"
        self._post((_CALL, [(method, args, kwargs)]), deadline, what)
        while True:
            kind, payload = self._receive(deadline, what)
            if kind == _ERROR:
                self._failure = self._failure or payload
                continue
            ok, value = payload
            self._raise_reported_failure()
            if not ok:
                raise SinkError(f"{self.name}: {what} failed in the sink process:\n{value}")
            return value

    def close(self, timeout: float = 120.0) -> None:
        """Let the child finish what was sent, then stop it (killed after ``timeout`` s)."""
        if self._closed:
            return
        deadline = time.monotonic() + timeout
        try:
            if self._process.poll() is None:
                self._post_buffered(deadline)
                self._post(None, deadline, "stopping")  # the child stops at the end of the pipe
            self._process.wait(max(deadline - time.monotonic(), 0.0))
        except (SinkError, subprocess.TimeoutExpired):
            log.warning("%s did not finish within %.0f s; killing it", self.name, timeout)
        finally:
            self._stop_child()

    @property
    def failure(self) -> str | None:
        """The traceback of a failed ``send``, once the parent has seen it."""
        while self._failure is None and not self._closed and self._can_read.poll(0):
            try:
                kind, payload = self._conn.recv()
            except (EOFError, OSError):  # OSError: a reset, when it died with data unread
                self._failure = self._exited("while it was running")
                break
            if kind == _ERROR:
                self._failure = payload
        return self._failure

    def _feed(self) -> None:
        """The feeder thread: writes the queued messages to the child, waiting while it is
        behind. Once the child is gone it drops them (the parent sees the end on the pipe)."""
        gone = False
        while (data := self._outbox.get()) is not None:
            if not gone:
                try:
                    self._conn.send_bytes(data)
                except OSError:
                    gone = True
        with contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_WR)

    def _stop_child(self) -> None:
        """Kill the child if it still runs, reap it, end the feeder and close the pipe."""
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()
        self._closed = True
        # Only this thread puts: once emptied here, the queue has room for the feeder's stop.
        with contextlib.suppress(queue.Empty):
            while True:
                self._outbox.get_nowait()
        self._outbox.put_nowait(None)
        self._feeder.join()  # a write it is in fails: the child is gone
        self._conn.close()
        self._socket.close()

    def _post_buffered(self, deadline: float | None = None) -> None:
        if self._buffered:
            calls, self._buffered = self._buffered, []
            self._post((_SEND, calls), deadline)

    def _post(self, message: object, deadline: float | None = None, what: str = "a send") -> None:
        """Queue ``message`` for the child (``None``: the end). Waits only while
        ``max_pending`` messages wait already, until ``deadline`` (by default for
        ``stall_timeout`` seconds, after which the sink counts as hung)."""
        if self._closed:
            raise SinkError(f"{self.name} is closed")
        data = None if message is None else ForkingPickler.dumps(message)
        try:
            self._outbox.put_nowait(data)
            return
        except queue.Full:
            pass
        if not self._warned_behind:
            self._warned_behind = True
            behind = self._outbox.maxsize
            log.warning("%s is %d messages behind; training waits for it", self.name, behind)
        if deadline is None:
            deadline = time.monotonic() + self._stall_timeout
        try:
            self._outbox.put(data, timeout=max(deadline - time.monotonic(), 0.0))
        except queue.Full:
            raise self._timed_out(what) from None

    def _timed_out(self, what: str) -> SinkError:
        self._failure = self._failure or f"{what} timed out: the sink process took too long"
        return SinkError(f"{self.name}: {what} did not finish in time")

    def _raise_reported_failure(self) -> None:
        if self._closed:
            raise SinkError(f"{self.name} is closed")
        if self.failure is not None:
            raise SinkError(f"{self.name} failed in the sink process:\n{self._failure}")

    def _receive(self, deadline: float, what: str) -> tuple[str, Any]:
        while not self._can_read.poll(100):
            if self._process.poll() is not None:
                raise SinkError(self._exited(f"before {what} returned"))
            if time.monotonic() > deadline:
                raise self._timed_out(what)
        try:
            result: tuple[str, Any] = self._conn.recv()
        except (EOFError, OSError):
            raise SinkError(self._exited(f"before {what} returned")) from None
        return result

    def _exited(self, when: str) -> str:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(5)  # its exit code is known once it is reaped
        return f"{self.name} exited (code {self._process.returncode}) {when}"


def serve_fd(fd: int) -> None:
    """The child's entry point: serve the parent on the socket ``fd``."""
    os.set_inheritable(fd, False)  # its own children must not keep the pipe open
    with contextlib.suppress(OSError):
        os.nice(SINK_NICENESS)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.path[:] = sys.argv[1:]
    _serve(mpc.Connection(fd))


def _serve(conn: mpc.Connection) -> None:
    """Build the sink, then run what the parent sends until the end of the pipe."""
    sink: Any = None
    try:
        sink = conn.recv()()
    except EOFError:
        return
    except Exception:
        conn.send((_ERROR, traceback.format_exc()))
    failed = sink is None  # a failed sink takes no more sends: it would only fail again
    while True:
        try:
            kind, calls = conn.recv()
        except EOFError:  # the end of what was sent, or the parent is gone
            return
        for method, args, kwargs in calls:
            if kind == _SEND and failed:
                break
            try:
                if sink is None:
                    raise SinkError("the sink could not be built (see the error reported before)")
                ok, value = True, getattr(sink, method)(*args, **kwargs)
            except Exception:
                ok, value = False, traceback.format_exc()
            if kind == _CALL:
                conn.send((_REPLY, (ok, value)))
            elif not ok:
                failed = True
                conn.send((_ERROR, value))
