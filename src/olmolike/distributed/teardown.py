"""The end of a distributed process: nothing that uses a process group is left running at exit.

A rank that exits with process groups alive may abort with SIGABRT ("terminate called without
an active exception") instead of exiting with its own status: a gloo worker thread that
releases a finished op after the interpreter began to shut down needs the GIL, and CPython
ends it from inside a C++ destructor (see :mod:`.quiesce`). :func:`teardown_distributed` ends
the groups in a fixed order so that cannot happen. :func:`teardown_at_exit` runs it when the
interpreter exits, unless it ran already: a script that never reaches its own teardown (it
has none, ``fit()`` raised ``SystemExit(143)`` after a SIGTERM, it called ``sys.exit``)
still exits with its intended status.
"""

from __future__ import annotations

import atexit
import logging

import torch.distributed as dist

from ..exceptions import RankLostError
from .failure import (
    exiting_on_error,
    find_lost_ranks,
    let_others_report,
    rank_failed,
    stop_failure_monitor,
)
from .quiesce import wait_for_idle_gloo_workers
from .utils import barrier_every_group, get_rank, is_distributed

__all__ = ["teardown_at_exit", "teardown_distributed"]

log = logging.getLogger(__name__)


def teardown_distributed(*, every_rank: bool = True) -> None:
    """End every process group of this process, so that nothing that uses one is left running.

    With ``every_rank`` (every rank ends its run too), first a barrier on every group: no
    collective this rank started is still running. Then the rank-failure monitor stops (a
    peer exiting is no longer a failure), every group is destroyed, and the wait for gloo's
    worker threads to finish releasing their last ops (:mod:`.quiesce`); the rank whose
    process holds the job's store first waits (briefly) for the others to be done with it. Pass
    ``every_rank=False`` after a failure: other ranks may be gone or stuck, and a barrier
    would fail or wait for the whole timeout. A barrier that fails because a rank died ends
    the groups without it and raises :class:`~olmolike.exceptions.RankLostError` naming it.
    """
    if not is_distributed():
        return
    rank = get_rank()  # before the groups end: then every process is rank 0
    if every_rank:
        try:
            barrier_every_group()
        except Exception as e:  # a peer is gone: end the groups without it, and say who
            teardown_distributed(every_rank=False)
            lost = find_lost_ranks(e)
            if lost is None:
                raise
            raise RankLostError(f"{lost}; rank {rank} was ending its run") from e
    stop_failure_monitor()
    let_others_report()  # if this process holds the job's store, which ends with the group
    dist.destroy_process_group()
    wait_for_idle_gloo_workers()


_registered = False


def teardown_at_exit() -> None:
    """Make :func:`teardown_distributed` run when the interpreter exits (once per process).

    ``atexit`` runs it after every non-daemon thread has ended (including the pools of
    ``concurrent.futures``, such as DCP's async-save executor, whose saves still use the
    groups) and after the ``atexit`` handlers registered later than this call (a logger's
    ``finish``, the script's own); before those registered earlier (``logging``'s
    shutdown), while the interpreter still works. A teardown that already ran leaves
    nothing to do. After this rank failed, no barrier (the other ranks may be gone); a
    barrier that fails because a peer is gone is logged and the groups are ended without
    it; the failure monitor ends a rank whose peer reported a failure while it waits. The
    process's exit status stays the one the script chose.
    """
    global _registered
    if not _registered:
        atexit.register(_teardown_at_exit)
        _registered = True


def _teardown_at_exit() -> None:
    # An uncaught error ends the rank with os._exit (failure.install_exit_on_error): the
    # interpreter's teardown that could abort never runs, and a peer may be stuck.
    if exiting_on_error() or not is_distributed():
        return
    try:
        teardown_distributed(every_rank=not rank_failed())
    except Exception as e:  # a peer is gone: the barrier failed (and the groups are ended)
        log.warning("Ended the process groups without the other ranks at exit: %s", e)
