"""Bookkeeping off the training thread: metric reductions, cancel checks, uploads.

Distributed bookkeeping ops run one at a time, in submission order, on a single worker thread
that uses its own (gloo) process group. Since every rank submits the same ops at the same
steps, every rank runs the same collectives in the same order, and none of them ever touches
the training process group: no deadlock with the training step's own collectives.

Results are handed back to the training thread by :meth:`BookkeepingRunner.poll`, at a step
fixed at submission (the same on every rank); that is also where an exception raised inside
an op is re-raised, with its original traceback.

Worker threads are daemons: a collective stuck because a peer died must not keep the process
alive at exit (``concurrent.futures.ThreadPoolExecutor`` joins its threads at exit).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..distributed.utils import (
    backend_supports_cpu,
    destroy_group,
    get_world_size,
    is_distributed,
    new_group,
    using_group,
)
from ..exceptions import ConfigurationError
from ..threads import DaemonThreadPool

__all__ = ["BookkeepingRunner", "build_bookkeeping"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class _PendingOp:
    __slots__ = ("callback", "due_step", "future", "name")

    def __init__(
        self,
        name: str,
        future: Future[Any],
        callback: Callable[[Any], None] | None,
        due_step: int,
    ) -> None:
        self.name = name
        self.future = future
        self.callback = callback
        self.due_step = due_step


class BookkeepingRunner:
    """Runs bookkeeping ops, asynchronously when the trainer has a CPU-capable group for them.

    When results reach the training thread is fixed, so that every rank sees them at the same
    step: a distributed op submitted during step ``s`` (or before the first step, ``s = 0``) is
    delivered at the end of step ``s + 1``, :meth:`poll` waiting for it if it is still running.
    A callback may then change which collectives run (stop, skip a save) and all ranks do the
    same. Non-distributed ops (``distributed=False``) are delivered once they are done, which
    may be a different step on each rank: their callbacks must not change collectives.

    ``allow_multiple=False`` keeps one invocation of an op name at a time (OLMo-core's option).
    A non-distributed op cancels the earlier invocations still queued, or is itself ignored if
    one is running. A distributed op is ignored while an earlier invocation has not been
    delivered, and cancels nothing: whether an op has started differs from rank to rank,
    whether it has been delivered does not, so every rank ignores the same invocations and
    runs the same collectives.
    """

    DELIVERY_DELAY = 1
    """Steps between the submission of a distributed op and the delivery of its result."""

    def __init__(
        self,
        *,
        asynchronous: bool,
        distributed: bool,
        soft_timeout: float,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.asynchronous = asynchronous
        self.distributed = distributed
        self.soft_timeout = soft_timeout
        self.group = group
        """The bookkeeping thread's own process group, used by no other thread."""
        self.step = 0
        """The step in progress; the trainer sets it at the start of each step."""
        self._single: DaemonThreadPool | None = None
        self._multi: DaemonThreadPool | None = None
        self._agreed: deque[_PendingOp] = deque()
        self._local: deque[_PendingOp] = deque()
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
        soft_timeout: float | None = None,
        distributed: bool = True,
        allow_multiple: bool = True,
        cancel_in_progress: bool | None = None,
        **kwargs: Any,
    ) -> Future[T]:
        """Run ``op(*args, **kwargs)``; ``cb(result)`` later runs on the training thread (see
        the class docstring for the step: for a distributed op, a step every rank agrees on),
        and an exception in ``op`` is raised there.

        :param op_name: names the op in logs and for ``allow_multiple`` (default: the op's
            qualified name, as in OLMo-core).
        :param allow_multiple: ``False`` runs one invocation of ``op_name`` at a time; an
            invocation that is skipped returns a cancelled future. For a distributed op, "at a
            time" means until its result is delivered, the same step on every rank.
        :param cancel_in_progress: OLMo-core's former name for ``not allow_multiple``.
        """
        if cancel_in_progress is not None:
            warnings.warn(
                "run_bookkeeping_op(cancel_in_progress=...) is deprecated (as in OLMo-core): "
                "use allow_multiple=not cancel_in_progress",
                DeprecationWarning,
                stacklevel=3,
            )
            allow_multiple = not cancel_in_progress
        name = op_name or str(getattr(op, "__qualname__", "bookkeeping op"))
        if not allow_multiple and self._another_in_the_way(name, distributed):
            log.warning(
                "Bookkeeping op %r was submitted while an earlier invocation is still %s; with "
                "allow_multiple=False this one is skipped (if this repeats, the op takes longer "
                "than its interval).",
                name,
                "undelivered" if distributed else "running",
            )
            ignored: Future[T] = Future()
            ignored.cancel()
            return ignored
        timeout = self.soft_timeout if soft_timeout is None else soft_timeout
        group = self.group if distributed else _NO_GROUP
        if not self.asynchronous:
            future: Future[T] = Future()
            future.set_running_or_notify_cancel()
            try:
                future.set_result(_run_op(op, name, timeout, group, args, kwargs))
            except Exception as e:
                future.set_exception(e)
        else:
            pool = self.single_thread_pool if distributed else self.multi_thread_pool
            future = pool.submit(_run_op, op, name, timeout, group, args, kwargs)
        with self._lock:
            queue_ = self._agreed if distributed else self._local
            queue_.append(_PendingOp(name, future, cb, self.step + self.DELIVERY_DELAY))
        return future

    def _another_in_the_way(self, name: str, distributed: bool) -> bool:
        """For ``allow_multiple=False``: cancel the queued earlier invocations of a local op;
        whether an earlier one (running, or for a distributed op undelivered) makes this one be
        ignored (see the class docstring)."""
        with self._lock:
            if distributed:
                return any(p.name == name for p in self._agreed)
            for pending in self._local:  # in submission order: those running come first
                if pending.name != name or pending.future.cancel():
                    continue  # another op, or a queued one, now cancelled
                if not pending.future.done():
                    return True  # running
        return False

    def poll(self, step: int) -> None:
        """At the end of ``step``: deliver every distributed op due by now, waiting for it, and
        every finished non-distributed op; each in submission order. Re-raises failures."""
        if not self._agreed and not self._local:
            return  # most steps: asked without the lock (only this thread takes ops off)
        while True:
            with self._lock:
                if not self._agreed or self._agreed[0].due_step > step:
                    break
                pending = self._agreed.popleft()
            self._deliver(pending)
        while True:
            with self._lock:
                if not self._local or not self._local[0].future.done():
                    return
                pending = self._local.popleft()
            self._deliver(pending)

    def wait_all(self) -> None:
        """Block until every submitted op has finished, delivering results in order."""
        for ops in (self._agreed, self._local):
            while True:
                with self._lock:
                    if not ops:
                        break
                    pending = ops.popleft()
                self._deliver(pending)

    def shutdown(self, *, wait: bool) -> None:
        """Stop the workers. Without ``wait`` a stuck op is abandoned (its thread is a daemon)."""
        if not wait:
            with self._lock:
                for pending in (*self._agreed, *self._local):
                    pending.future.cancel()
                self._agreed.clear()
                self._local.clear()
        for pool in (self._single, self._multi):
            if pool is not None:
                pool.shutdown(wait=wait)
        self._single = self._multi = None

    def close(self, *, clean: bool) -> None:
        """When the trainer is done: stop the workers and destroy the group. ``clean`` (every
        rank got here without an error) waits for running ops and for the peers' last ops on
        the group; otherwise a stuck op is abandoned and the group destroyed at once."""
        self.shutdown(wait=clean)
        destroy_group(self.group, barrier=clean)

    @staticmethod
    def _deliver(pending: _PendingOp) -> None:
        if pending.future.cancelled():
            return
        error = pending.future.exception()  # blocks until done
        if error is not None:
            if hasattr(error, "add_note"):
                error.add_note(f"(raised in the bookkeeping op {pending.name!r})")
            raise error
        if pending.callback is not None:
            pending.callback(pending.future.result())


def build_bookkeeping(
    asynchronous: bool | None, device: torch.device, soft_timeout: float
) -> tuple[BookkeepingRunner, bool]:
    """The trainer's runner, with its own process group when distributed, and whether it is
    asynchronous (``None`` chooses: yes unless a single process trains on the CPU)."""
    cpu_capable = backend_supports_cpu() if is_distributed() else True
    if asynchronous is None:
        # One process on the CPU has nothing to overlap: the ops are cheap host work with
        # no collective, and a worker thread would only contend for the GIL with training.
        single_cpu = not is_distributed() and device.type == "cpu"
        asynchronous = cpu_capable and not single_cpu
    elif asynchronous and not cpu_capable:
        raise ConfigurationError(
            "needs a CPU-capable backend for its separate process group; initialize with "
            "backend='cpu:gloo,cuda:nccl' or set async_bookkeeping=False",
            path="async_bookkeeping",
        )
    runner = BookkeepingRunner(
        asynchronous=asynchronous,
        distributed=is_distributed() and get_world_size() > 1,
        soft_timeout=soft_timeout,
        group=new_group("bookkeeping"),  # never the training group
    )
    return runner, asynchronous


_NO_GROUP = object()


def _run_op(
    op: Callable[..., T],
    name: str,
    soft_timeout: float,
    group: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> T:
    if group is _NO_GROUP:
        return _slow_op_watch.run(op, name, soft_timeout, args, kwargs)
    with using_group(group, "bookkeeping"):
        return _slow_op_watch.run(op, name, soft_timeout, args, kwargs)


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
