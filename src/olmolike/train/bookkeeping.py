"""Bookkeeping off the training thread: metric reductions, cancel checks, uploads.

Distributed bookkeeping ops run one at a time, in submission order, on a single worker thread
that uses its own (gloo) process group. Since every rank submits the same ops at the same
steps, every rank runs the same collectives in the same order, and none of them ever touches
the training process group: no deadlock with the training step's own collectives.

Results are handed back to the training thread, in submission order, by :meth:`poll`; that is
also where an exception raised inside an op is re-raised, with its original traceback.

Worker threads are daemons: a collective stuck because a peer died must not keep the process
alive at exit (``concurrent.futures.ThreadPoolExecutor`` joins its threads at exit).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

from ..exceptions import BookkeepingError

__all__ = ["BookkeepingRunner", "DaemonThreadPool"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_STOP = object()


class DaemonThreadPool(Executor):
    """A minimal executor whose worker threads are daemons."""

    def __init__(self, max_workers: int, name: str) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(max_workers)
        ]
        self._shutdown = False
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        if self._shutdown:
            raise RuntimeError("cannot submit to a pool that was shut down")
        future: Future[T] = Future()
        self._queue.put((future, fn, args, kwargs))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if self._shutdown:
            return
        self._shutdown = True
        for _ in self._threads:
            self._queue.put(_STOP)
        if wait:
            for thread in self._threads:
                thread.join()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            future, fn, args, kwargs = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as e:
                future.set_exception(e)


class _PendingOp:
    __slots__ = ("callback", "future", "name")

    def __init__(self, name: str, future: Future[Any], callback: Callable[[Any], None] | None):
        self.name = name
        self.future = future
        self.callback = callback


class BookkeepingRunner:
    """Runs bookkeeping ops, asynchronously when the trainer has a CPU-capable group for them."""

    def __init__(self, *, asynchronous: bool, distributed: bool, soft_timeout: float) -> None:
        self.asynchronous = asynchronous
        self.distributed = distributed
        self.soft_timeout = soft_timeout
        self._single: DaemonThreadPool | None = None
        self._multi: DaemonThreadPool | None = None
        self._pending: deque[_PendingOp] = deque()
        self._lock = threading.Lock()

    @property
    def single_thread_pool(self) -> DaemonThreadPool:
        if self._single is None:
            self._single = DaemonThreadPool(1, "bookkeeping-collectives")
        return self._single

    @property
    def multi_thread_pool(self) -> DaemonThreadPool:
        if self._multi is None:
            self._multi = DaemonThreadPool(4, "bookkeeping")
        return self._multi

    def submit(
        self,
        op: Callable[..., T],
        *args: Any,
        cb: Callable[[T], None] | None = None,
        op_name: str | None = None,
        allow_multiple: bool = True,
        soft_timeout: float | None = None,
        distributed: bool = True,
        **kwargs: Any,
    ) -> Future[T]:
        """Run ``op(*args, **kwargs)``; ``cb(result)`` later runs on the training thread."""
        name = op_name or str(getattr(op, "__name__", "bookkeeping op"))
        timeout = self.soft_timeout if soft_timeout is None else soft_timeout
        if not allow_multiple:
            if distributed and self.distributed:
                raise BookkeepingError(
                    f"op {name!r}: allow_multiple=False cannot be used with a distributed op, "
                    "because ranks could drop different invocations and then deadlock; make the "
                    "op non-distributed or allow multiple invocations"
                )
            running = self._dedupe(name)
            if running is not None:
                return running
        if not self.asynchronous:
            future: Future[T] = Future()
            future.set_running_or_notify_cancel()
            try:
                future.set_result(_slow_op_watch.run(op, name, timeout, args, kwargs))
            except Exception as e:
                future.set_exception(e)
        else:
            pool = self.single_thread_pool if distributed else self.multi_thread_pool
            future = pool.submit(_slow_op_watch.run, op, name, timeout, args, kwargs)
        with self._lock:
            self._pending.append(_PendingOp(name, future, cb))
        return future

    def poll(self) -> None:
        """Deliver finished results in submission order; re-raise the first failure."""
        while True:
            with self._lock:
                if not self._pending or not self._pending[0].future.done():
                    return
                pending = self._pending.popleft()
            self._deliver(pending)

    def wait_all(self) -> None:
        """Block until every submitted op has finished, delivering results in order."""
        while True:
            with self._lock:
                if not self._pending:
                    return
                pending = self._pending.popleft()
            if not pending.future.cancelled():
                pending.future.exception()  # blocks until done
            self._deliver(pending)

    def shutdown(self, *, wait: bool) -> None:
        """Stop the workers. Without ``wait`` a stuck op is abandoned (its thread is a daemon)."""
        if not wait:
            with self._lock:
                for pending in self._pending:
                    pending.future.cancel()
                self._pending.clear()
        for pool in (self._single, self._multi):
            if pool is not None:
                pool.shutdown(wait=wait)
        self._single = self._multi = None

    def _dedupe(self, name: str) -> Future[Any] | None:
        """Cancel queued ops named ``name``; return the running one, if any."""
        with self._lock:
            running = None
            for pending in self._pending:
                unfinished = pending.name == name and not pending.future.done()
                if unfinished and not pending.future.cancel():
                    running = pending.future
            return running

    @staticmethod
    def _deliver(pending: _PendingOp) -> None:
        if pending.future.cancelled():
            return
        error = pending.future.exception()
        if error is not None:
            if hasattr(error, "add_note"):
                error.add_note(f"(raised in the bookkeeping op {pending.name!r})")
            raise error
        if pending.callback is not None:
            pending.callback(pending.future.result())


class _SlowOpWatch:
    """Warns about ops running past their soft timeout, from one long-lived daemon thread.

    A ``threading.Timer`` per op would start a thread every collect interval (~150 us each).
    """

    def __init__(self, poll_interval: float = 0.5) -> None:
        self._running: dict[int, tuple[str, float, float]] = {}
        self._lock = threading.Lock()
        self._tokens = itertools.count()
        self._poll_interval = poll_interval
        self._thread: threading.Thread | None = None

    def run(
        self,
        op: Callable[..., T],
        name: str,
        soft_timeout: float,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> T:
        with self._lock:
            token = next(self._tokens)
            self._running[token] = (name, time.monotonic() + soft_timeout, soft_timeout)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._watch, name="bookkeeping-watch", daemon=True
                )
                self._thread.start()
        try:
            return op(*args, **kwargs)
        finally:
            with self._lock:
                self._running.pop(token, None)

    def _watch(self) -> None:
        while True:
            time.sleep(self._poll_interval)
            now = time.monotonic()
            with self._lock:
                overdue = [(t, entry) for t, entry in self._running.items() if entry[1] <= now]
                for token, (name, _, timeout) in overdue:
                    self._running[token] = (name, float("inf"), timeout)  # warn once per op
            for _, (name, _, timeout) in overdue:
                log.warning(
                    "Bookkeeping op %r has been running for more than %.0fs "
                    "(bookkeeping_soft_timeout); a rank may be stalled or a collective unmatched.",
                    name,
                    timeout,
                )


_slow_op_watch = _SlowOpWatch()
