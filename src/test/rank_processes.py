"""Rank processes for the tests, started in a fraction of a second instead of several seconds.

A spawned rank imports torch and olmolike afresh: about 5 CPU seconds per rank, for hundreds
of ranks per run of the suite on 2 cores. :func:`context` forks ranks instead from a
multiprocessing fork server, started once per test process, that has imported
:mod:`testutils` (torch, olmolike) and nothing else: no thread, no process group, no state of
any test. A forked rank is then given what a spawned one has (:class:`AsSpawned`): the test
process's environment, stdout and stderr as they are when the rank starts (pytest captures
them per test), and its ``atexit`` handlers run when it ends (olmolike's teardown at exit
among them), which a fork server's child would skip (it ends with ``os._exit``).
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import sys
import threading
import weakref
from multiprocessing import forkserver, reduction
from multiprocessing.context import BaseContext
from typing import Any

LAZY_IN_OLMOLIKE = ["torch.distributed.pipelining"]
"""Modules olmolike imports only when a run needs them, which almost every rank then imports:
``torch.distributed.pipelining`` brings ``torch._dynamo``, which the first DTensor or FSDP
operation of a process imports otherwise (~1 CPU s per rank: a first FSDP step took 1.08 CPU s
without it in the server, 0.02 s with it)."""


def context() -> BaseContext:
    """The ``forkserver`` context, its server started with :mod:`testutils` and
    :data:`LAZY_IN_OLMOLIKE` imported."""
    ctx = mp.get_context("forkserver")
    if forkserver._forkserver._forkserver_pid is None:  # type: ignore[attr-defined]
        ctx.set_forkserver_preload(["testutils", *LAZY_IN_OLMOLIKE])
        # The server finds the preloaded modules where this process does (Python 3.11's
        # fork server ignores the sys.path it is given).
        saved = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        try:
            forkserver.ensure_running()
        finally:
            if saved is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = saved
    return ctx


class AsSpawned:
    """What a spawned process inherits from this one now, for a fork server's child: pass it
    first in the process's arguments (unpickled there, it gives the child what it holds,
    before the other arguments import anything), and call :meth:`exit` when the child ends."""

    def __init__(self) -> None:
        self.env = dict(os.environ)

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled when the process starts: the descriptors travel with it (as inheritance
        # would give them: the same open files, offsets shared).
        return _rebuild, (self.env, reduction.DupFd(1), reduction.DupFd(2))

    @staticmethod
    def exit() -> None:
        """End as the interpreter ends a spawned process: threads first, then ``atexit``."""
        threading._shutdown()  # type: ignore[attr-defined]
        skip_torch_library_finalizers()
        atexit._run_exitfuncs()


def skip_torch_library_finalizers() -> None:
    """Keep ``atexit`` from unregistering torch's operator libraries one by one, in a process
    that ends with ``os._exit`` next (a fork server's child): ~180 ``torch.library``
    finalizers that free what the process is about to drop anyway took 0.06 CPU s per rank
    and, beside other work, 0.5 s of a 2-rank call's 1.1 s. Any other finalizer still runs."""
    for finalizer, info in list(weakref.finalize._registry.items()):  # type: ignore[attr-defined]
        if getattr(info.func, "__module__", None) == "torch.library":
            finalizer.atexit = False


def _rebuild(env: dict[str, str], stdout: Any, stderr: Any) -> AsSpawned:
    os.environ.clear()
    os.environ.update(env)
    for target, fd in ((1, stdout), (2, stderr)):
        received = fd.detach()
        os.dup2(received, target)
        os.close(received)
    inherited = AsSpawned.__new__(AsSpawned)
    inherited.env = env
    return inherited
