"""Wait until gloo's worker threads hold nothing that needs the interpreter, before it exits.

A gloo process group runs its collectives on worker threads of its own. When a worker is done
with an op, it drops the op's tensors; a tensor that Python let go of first has its Python
object freed there, which takes the GIL. If that happens after the interpreter has begun to
shut down, CPython ends the thread with ``pthread_exit`` from inside a C++ destructor, and the
C++ runtime aborts the process ("terminate called without an active exception", SIGABRT):
a finished run reported as failed. ``destroy_process_group`` does not stop these workers; only
freeing the group does, and the trainer, a DDP model or the user's script may still hold it.

So the end of a run waits, with the GIL released, until every gloo worker thread is asleep
and has not woken for a while: idle workers block on a condition variable without a timeout,
while one that still has work (or waits for the GIL, which CPython polls every 5 ms) keeps
waking up. Linux only (it reads ``/proc``); elsewhere it returns at once.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

__all__ = ["gloo_worker_threads", "wait_for_idle_gloo_workers"]

log = logging.getLogger(__name__)

_WORKER_NAME = "pt_gloo_runloop"
"""The name torch gives each worker thread of a ``ProcessGroupGloo``."""

_TASKS = Path("/proc/self/task")


def gloo_worker_threads() -> list[int]:
    """The thread ids of this process's gloo worker threads (none where ``/proc`` is missing)."""
    if not _TASKS.is_dir():
        return []
    found = []
    for task in _TASKS.iterdir():
        try:
            if (task / "comm").read_text().strip() == _WORKER_NAME:
                found.append(int(task.name))
        except OSError:  # the thread ended meanwhile
            continue
    return found


def _activity(tid: int) -> tuple[str, int] | None:
    """The thread's state letter and how often it has blocked so far (None once it is gone)."""
    try:
        status = (_TASKS / str(tid) / "status").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return fields["State"].split()[0], int(fields["voluntary_ctxt_switches"])


def wait_for_idle_gloo_workers(timeout: float = 30.0, window: float = 0.05) -> bool:
    """Wait until every gloo worker thread sleeps through a whole ``window`` of seconds.

    Returns whether they did within ``timeout`` (a warning says so when not). ``window`` is
    several times CPython's 5 ms GIL poll, so a worker waiting for the GIL is seen waking.
    """
    deadline = time.monotonic() + timeout
    while True:
        before = {tid: _activity(tid) for tid in gloo_worker_threads()}
        time.sleep(window)  # releases the GIL: a worker waiting for it gets it now
        busy = [
            tid
            for tid, seen in before.items()
            if seen is not None and (seen[0] != "S" or _activity(tid) != seen)
        ]
        if not busy:
            return True
        if time.monotonic() > deadline:
            log.warning(
                "%d gloo worker thread(s) still busy %.0fs after the end of the run "
                "(pid %d); the process may abort as it exits",
                len(busy),
                timeout,
                os.getpid(),
            )
            return False
