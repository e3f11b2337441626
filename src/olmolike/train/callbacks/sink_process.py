"""A metrics sink (W&B, Aim) in a child process, so its Python work never slows training.

Tracker SDKs do a lot of Python per logged step: W&B ~0.6 ms (protobuf records, a round trip
to its service through an asyncio thread), Aim ~0.2 ms per scalar. In the training process
that time is either spent on the training thread or, on a helper thread, taken from it through
the GIL. In a child process it overlaps with training for the cost of queueing a small dict
for a pipe.

The child builds the sink with ``factory()`` and then runs its methods in the order they were
sent. :meth:`SinkProcess.send` does not wait; :meth:`SinkProcess.call` waits for the result.
:meth:`SinkProcess.buffer` keeps calls until the next send, call or :meth:`SinkProcess.flush`,
so that a collect interval's steps cost one write to the pipe.
A failed ``send`` is reported once, and raised in the parent at the next ``send`` or ``call``;
the child then ignores further sends (a tracker that failed once would only fail again).

Training never waits for a sink that is behind, up to a bound. Messages are written to the pipe
without waiting (``MSG_DONTWAIT``); what the pipe cannot take yet stays in the parent, up to
``max_pending_bytes``, and goes down with the next message. Only a sink that falls further
behind than that makes training wait (with a warning), and one that then takes nothing for
``stall_timeout`` seconds counts as hung: a :class:`SinkError`. A slow sink catches up when
the cores are idle, at the latest at :meth:`SinkProcess.close`. What is still queued in the
parent is lost if the training process is killed outright (SIGKILL); a resume logs the steps
after its checkpoint again anyway.

The child is a fresh interpreter (``python -c``) that imports only what the sink needs, not
the user's training script: ``multiprocessing``'s spawn would run a script without an
``if __name__ == "__main__"`` guard again in the child, training and all. It ignores SIGINT
and SIGTERM, which a terminal or a scheduler sends to the whole process group: the trainer
turns them into a graceful stop and still finishes the sink's run; a child whose parent is
gone sees the pipe close and exits. It runs in Linux's ``SCHED_IDLE`` class (elsewhere at
``nice`` +19): it gets a core only when nothing else wants one, and never preempts training.
Its own children (W&B's service) inherit that.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.connection as mpc
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

from ...exceptions import OLMoLikeError

__all__ = ["SinkError", "SinkProcess"]

log = logging.getLogger(__name__)

SINK_NICENESS = 19
"""How much lower the sink process's CPU priority is where ``SCHED_IDLE`` does not exist."""

MAX_PENDING_BYTES = 4 * 1024 * 1024
"""How much may wait in the parent for a sink that is behind: some 15,000 steps of a dozen
metrics, which a tracker at ~2 ms per step works off in half a minute."""

STALL_TIMEOUT_S = 600.0
"""How long training waits for a sink that is ``max_pending_bytes`` behind to take the next
message before the sink counts as hung and a :class:`SinkError` stops the wait."""

_SEND_FLAGS = socket.MSG_DONTWAIT | getattr(socket, "MSG_NOSIGNAL", 0)
_SEND, _CALL, _STOP = "send", "call", "stop"
_REPLY, _ERROR = "reply", "error"


class SinkError(OLMoLikeError):
    """A metrics sink failed in its process (the message holds its traceback)."""


class SinkProcess:
    """Runs the object built by ``factory`` (picklable, e.g. a class) in a child process."""

    def __init__(
        self,
        factory: Callable[[], Any],
        name: str,
        max_pending_bytes: int = MAX_PENDING_BYTES,
        stall_timeout: float = STALL_TIMEOUT_S,
    ) -> None:
        self.name = name
        self._max_pending_bytes = max_pending_bytes
        self._stall_timeout = stall_timeout
        self._unsent = bytearray()
        self._child_gone = False
        self._closed = False
        self._warned_behind = False
        self._failure: str | None = None
        self._buffered: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        parent_end, child_end = socket.socketpair()
        try:
            fd = child_end.fileno()
            command = f"from {__name__} import serve_fd; serve_fd({fd})"
            self._process = subprocess.Popen([sys.executable, "-c", command], pass_fds=[fd])
        except BaseException:
            parent_end.close()
            raise
        finally:
            child_end.close()
        self._socket = parent_end  # writes, framed as multiprocessing.Connection reads them
        self._conn = mpc.Connection(os.dup(parent_end.fileno()))  # reads
        # poll(), not select(): select() cannot watch a descriptor numbered 1024 or higher.
        self._can_write = select.poll()
        self._can_write.register(self._socket.fileno(), select.POLLOUT)
        self._can_read = select.poll()
        self._can_read.register(self._conn.fileno(), select.POLLIN)
        try:
            # The import path first: unpickling the factory may import modules found there.
            self._post(list(sys.path))
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
        self._post((_CALL, method, args, kwargs), deadline, what)
        self._write_all(deadline, what)
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
                self._post((_STOP, "", (), {}), deadline, "stopping")
                self._write_all(deadline, "stopping")
            self._process.wait(max(deadline - time.monotonic(), 0.0))
        except (SinkError, subprocess.TimeoutExpired):
            log.warning("%s did not finish within %.0f s; killing it", self.name, timeout)
        finally:
            self._stop_child()

    @property
    def failure(self) -> str | None:
        """The traceback of a failed ``send``, once the parent has seen it."""
        self._poll_reports()
        return self._failure

    def _stop_child(self) -> None:
        """Kill the child if it still runs, reap it, and close both descriptors."""
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()
        self._closed = True
        self._socket.close()
        self._conn.close()

    def _post_buffered(self, deadline: float | None = None) -> None:
        if self._buffered:
            calls, self._buffered = self._buffered, []
            self._post((_SEND, "", calls, {}), deadline)

    def _post(self, message: Any, deadline: float | None = None, what: str = "a send") -> None:
        """Hand ``message`` to the pipe, as much as it takes now. Waits only while more than
        ``max_pending_bytes`` would be left over, until ``deadline`` (by default for
        ``stall_timeout`` seconds, after which the sink counts as hung)."""
        if self._closed:
            raise SinkError(f"{self.name} is closed")
        if self._child_gone:
            return  # its end is reported by _poll_reports or _receive
        data = ForkingPickler.dumps(message)
        # multiprocessing.Connection's framing, which the child reads: a 4-byte length, or -1
        # and an 8-byte one.
        if len(data) <= 0x7FFFFFFF:
            self._unsent += struct.pack("!i", len(data))
        else:
            self._unsent += struct.pack("!iQ", -1, len(data))
        self._unsent += data
        self._write()
        if len(self._unsent) > self._max_pending_bytes:
            if not self._warned_behind:
                self._warned_behind = True
                behind = len(self._unsent) / 2**20
                log.warning("%s is %.1f MiB behind; training waits for it", self.name, behind)
            if deadline is None:
                deadline = time.monotonic() + self._stall_timeout
            self._write_all(deadline, what, down_to=self._max_pending_bytes)

    def _write(self) -> None:
        """Write what the pipe takes without waiting. A child that is gone takes nothing more
        (the parent learns of its end from the pipe or its exit code)."""
        while self._unsent and not self._child_gone:
            try:
                written = self._socket.send(self._unsent, _SEND_FLAGS)
            except BlockingIOError:
                return
            except OSError:
                self._child_gone = True
                self._unsent.clear()
                return
            del self._unsent[:written]

    def _write_all(self, deadline: float, what: str, down_to: int = 0) -> None:
        """Write until at most ``down_to`` bytes are left; a :class:`SinkError` at ``deadline``
        (the sink then counts as failed)."""
        self._write()
        while len(self._unsent) > down_to and not self._child_gone:
            wait = deadline - time.monotonic()
            if wait <= 0:
                raise self._timed_out(what)
            self._can_write.poll(wait * 1000)
            self._write()

    def _timed_out(self, what: str) -> SinkError:
        self._failure = self._failure or f"{what} timed out: the sink process took too long"
        return SinkError(f"{self.name}: {what} did not finish in time")

    def _raise_reported_failure(self) -> None:
        if self._closed:
            raise SinkError(f"{self.name} is closed")
        if self.failure is not None:
            raise SinkError(f"{self.name} failed in the sink process:\n{self._failure}")

    def _poll_reports(self) -> None:
        while self._failure is None and not self._closed and self._readable(0):
            try:
                kind, payload = self._conn.recv()
            except (EOFError, OSError):  # OSError: a reset, when it died with data unread
                self._failure = self._exited("while it was running")
                return
            if kind == _ERROR:
                self._failure = payload

    def _receive(self, deadline: float, what: str) -> tuple[str, Any]:
        while not self._readable(0.1):
            if self._process.poll() is not None:
                raise SinkError(self._exited(f"before {what} returned"))
            if time.monotonic() > deadline:
                raise self._timed_out(what)
        try:
            result: tuple[str, Any] = self._conn.recv()
        except (EOFError, OSError):
            raise SinkError(self._exited(f"before {what} returned")) from None
        return result

    def _readable(self, timeout: float) -> bool:
        # One poll() call: Connection.poll() builds and tears down a selector each time,
        # several times the cost, and this runs at every flush.
        return bool(self._can_read.poll(timeout * 1000))

    def _exited(self, when: str) -> str:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(5)  # its exit code is known once it is reaped
        return f"{self.name} exited (code {self._process.returncode}) {when}"


def serve_fd(fd: int) -> None:
    """The child's entry point: serve the parent on the socket ``fd``."""
    _lower_cpu_priority()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = mpc.Connection(fd)
    sys.path[:] = conn.recv()
    _serve(conn)


def _lower_cpu_priority() -> None:
    """Where the cores are busy, training runs first and the sink catches up in the gaps."""
    if hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            return
        except OSError:  # e.g. refused in a sandbox
            pass
    with contextlib.suppress(OSError):
        os.nice(SINK_NICENESS)


def _serve(conn: mpc.Connection) -> None:
    """Build the sink, then run what the parent sends until told to stop."""
    sink: Any = None
    failed = False
    try:
        factory = conn.recv()
        sink = factory()
    except EOFError:
        return
    except Exception:
        failed = True
        conn.send((_ERROR, traceback.format_exc()))
    while True:
        try:
            kind, method, args, kwargs = conn.recv()
        except EOFError:  # the parent is gone
            return
        if kind == _STOP:
            return
        if kind == _SEND:
            for name, call_args, call_kwargs in args:
                if failed:
                    break
                try:
                    getattr(sink, name)(*call_args, **call_kwargs)
                except Exception:
                    failed = True
                    conn.send((_ERROR, traceback.format_exc()))
            continue
        try:
            if sink is None:
                raise SinkError("the sink could not be built (see the error reported before)")
            conn.send((_REPLY, (True, getattr(sink, method)(*args, **kwargs))))
        except Exception:
            conn.send((_REPLY, (False, traceback.format_exc())))
