"""``olmolike train --nproc-per-node N``: the ranks of one machine, started by olmolike itself.

torchrun ends every failed job with its own report: its agent's traceback and a block per
failed rank (28-51 lines), after the ranks' own one-line messages. On one machine olmolike
starts the ranks itself, as ``torchrun --standalone`` would, and adds nothing to what they
say. It also keeps a rank that died unreaped until the others have ended, so they can read
how it ended (``/proc``, see :mod:`olmolike.distributed.lost_ranks`) and name the signal.
Several machines need torchrun (or another launcher) still.

Like torchrun's agent, it holds the job's key-value store itself (``TORCHELASTIC_USE_AGENT_STORE``
tells the ranks so): the store outlives every rank, so the ranks left can always tell each
other who failed first (one line per job, not one per rank), and a rank 0 that freezes does
not freeze the store with it.

Signals: the ranks run in their own sessions, so a Ctrl-C in the terminal reaches the
launcher alone, which passes each SIGINT and SIGTERM on to every rank once: the first stops
the run gracefully, a second SIGINT aborts it, as in a single process.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed import TCPStore

__all__ = ["GRACE_SECONDS", "launch"]

GRACE_SECONDS = 30.0
"""How long the ranks left get to end on their own after one failed (they see it at once
and say why), before the launcher ends them with SIGTERM, then SIGKILL."""


def launch(nproc: int, argv: Sequence[str]) -> int:
    """Run ``python -m olmolike *argv`` as ``nproc`` ranks on this machine; the exit status
    of the first rank that failed (128 + the signal for a signal), else 0."""
    store = _job_store()  # held until every rank has ended
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port)}
    env.update(WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc))
    env.update(TORCHELASTIC_USE_AGENT_STORE="True")
    ranks = [
        subprocess.Popen(
            [sys.executable, "-m", "olmolike", *argv],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        for rank in range(nproc)
    ]

    def forward(signum: int, frame: FrameType | None) -> None:
        del frame
        for rank in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank.pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        status = _wait(ranks)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for rank in ranks:
            if rank.poll() is None:  # the launcher itself was interrupted
                rank.kill()
            rank.wait()
    return status


def _wait(ranks: list[subprocess.Popen[bytes]]) -> int:
    """Wait until every rank ended, without reaping any; the first failure's status."""
    ended: dict[int, int] = {}
    first_failure: int | None = None
    deadline = float("inf")
    terminated = False
    while len(ended) < len(ranks):
        for i, rank in enumerate(ranks):
            if i not in ended and (status := _ended(rank.pid)) is not None:
                ended[i] = status
                if status != 0 and first_failure is None:
                    first_failure, deadline = i, time.monotonic() + GRACE_SECONDS
        if time.monotonic() > deadline:
            sig = signal.SIGKILL if terminated else signal.SIGTERM
            for i, rank in enumerate(ranks):
                if i not in ended:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(rank.pid, sig)
            terminated, deadline = True, time.monotonic() + 10
        time.sleep(0.1)
    if first_failure is None:
        return 0
    status = ended[first_failure]
    if all(code < 0 for code in ended.values()):  # no rank was left to say what happened
        name = signal.Signals(-status).name
        print(f"error: rank {first_failure} was killed by {name}", file=sys.stderr)
    return status if status > 0 else 128 - status


def _ended(pid: int) -> int | None:
    """How ``pid`` ended (its exit status, or minus its signal), leaving it unreaped; ``None``
    while it runs."""
    info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    if info is None or info.si_pid == 0:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _die_with_parent() -> None:
    """In a rank, before it runs: end with SIGTERM if the launcher dies (Linux)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _job_store() -> TCPStore:
    """The job's store, on a free port of this machine, for the ranks to connect to."""
    from torch.distributed import TCPStore

    return TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(minutes=15),
    )
