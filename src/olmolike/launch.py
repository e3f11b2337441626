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

Restarts (``--max-restarts K``, as torchrun's): when a rank fails, the launcher waits for every
rank to end, then starts them all again, up to K times; each start resumes from the save
folder's newest complete checkpoint, as running the same command again would. A run the user
stopped (SIGINT, SIGTERM to the launcher) is not restarted. Every start of one launch shares
one run id (``OLMOLIKE_RUN_ID``, unless the environment gives one: see
:mod:`olmolike.train.checkpoint.lease`), so a restart takes its own save folder's lease back at
once; ``OLMOLIKE_RESTART_COUNT`` tells the ranks how many restarts came before them.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed import TCPStore

__all__ = ["GRACE_SECONDS", "launch", "shared_run_id", "without_option"]

GRACE_SECONDS = 30.0
"""How long the ranks left get to end on their own after one failed (they see it at once
and say why), before the launcher ends them with SIGTERM, then SIGKILL."""


def launch(nproc: int, argv: Sequence[str], *, max_restarts: int = 0) -> int:
    """Run ``python -m olmolike *argv`` as ``nproc`` ranks on this machine, again after a
    failure up to ``max_restarts`` times; the exit status of the first rank that failed in
    the last start (128 + the signal for a signal), else 0."""
    env = {**os.environ, **shared_run_id(os.environ)}
    ranks: list[subprocess.Popen[bytes]] = []  # those of the current start
    stopped: list[int] = []  # the signals the user sent the launcher

    def forward(signum: int, frame: FrameType | None) -> None:
        del frame
        stopped.append(signum)
        for rank in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank.pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for restart in range(max_restarts + 1):
            if stopped:  # between two starts
                return 128 + stopped[0]
            start_env = {**env, "OLMOLIKE_RESTART_COUNT": str(restart)}
            status, failed = _start(nproc, argv, start_env, ranks)
            if status == 0 or stopped or restart == max_restarts:
                return status
            print(
                f"olmolike: {failed}; restarting the {nproc} rank(s) from the latest "
                f"checkpoint (restart {restart + 1} of {max_restarts})",
                file=sys.stderr,
                flush=True,
            )
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    raise AssertionError("unreachable: the last start returns")


def without_option(argv: Sequence[str], option: str, shortest: int) -> list[str]:
    """``argv`` without ``option`` and its value (``--opt V``, ``--opt=V``, or a prefix of
    it at least ``shortest`` characters long, as argparse accepts): the command line a rank
    runs once the launcher has used the option."""
    out: list[str] = []
    skip = False
    for item in argv:
        key, equals, _ = item.partition("=")
        if skip:
            skip = False
        elif len(key) >= shortest and option.startswith(key):
            skip = not equals
        else:
            out.append(item)
    return out


def shared_run_id(environ: Mapping[str, str]) -> dict[str, str]:
    """``OLMOLIKE_RUN_ID`` for the ranks of every start of one launch, unless ``environ``
    names the run already (``OLMOLIKE_RUN_ID``, or a SLURM job whose requeued attempts keep
    its id): the lease then knows a restart for the same run."""
    if environ.get("OLMOLIKE_RUN_ID") or environ.get("SLURM_JOB_ID"):
        return {}
    return {
        "OLMOLIKE_RUN_ID": f"{socket.gethostname()}-launch-{os.getpid()}-{secrets.token_hex(4)}"
    }


def _start(
    nproc: int, argv: Sequence[str], env: dict[str, str], ranks: list[subprocess.Popen[bytes]]
) -> tuple[int, str]:
    """One start of the ranks (kept in ``ranks`` while they run, for the signal handler): the
    exit status (as :func:`launch`'s) and which rank failed first, and how."""
    store = _job_store()  # held until every rank of this start has ended
    env = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port)}
    env.update(WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc))
    env.update(TORCHELASTIC_USE_AGENT_STORE="True")
    ranks.clear()
    try:
        for rank in range(nproc):
            ranks.append(
                subprocess.Popen(
                    [sys.executable, "-m", "olmolike", *argv],
                    env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                    start_new_session=True,
                    preexec_fn=_die_with_parent,
                )
            )
        return _wait(ranks)
    finally:
        for process in ranks:
            if process.poll() is None:  # the launcher itself was interrupted
                process.kill()
            process.wait()
        ranks.clear()


def _wait(ranks: list[subprocess.Popen[bytes]]) -> tuple[int, str]:
    """Wait until every rank ended, without reaping any; the first failure's status, and
    which rank it was and how it ended."""
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
        return 0, ""
    status = ended[first_failure]
    how = f"exited with status {status}"
    if status < 0:
        how = f"was killed by {signal.Signals(-status).name}"
        if all(code < 0 for code in ended.values()):  # no rank was left to say what happened
            print(f"error: rank {first_failure} {how}", file=sys.stderr)
    return (status if status > 0 else 128 - status), f"rank {first_failure} {how}"


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
