"""Worker threads that never keep the process alive.

``concurrent.futures.ThreadPoolExecutor`` joins its threads at interpreter exit, so a worker
stuck in a collective whose peer died (or in a network call) would hang the exit. The pool
here uses daemon threads instead. It sits below every package that runs background work (the
trainer's bookkeeping, the checkpointer's writer, logging callbacks), and imports nothing of
olmolike.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

__all__ = ["DaemonThreadPool"]

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
            # An idle worker must not keep the last task (and what it holds) alive.
            del item, future, fn, args, kwargs
