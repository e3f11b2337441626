"""Which rank of a job is gone, and how, when a collective failed because a peer vanished.

A rank killed by SIGKILL (or by the out-of-memory killer) reports nothing: the ranks left see
only gloo's "Connection closed by peer [127.0.0.1]:7578", which names no rank. So every rank
enters its host, pid and the pid's start time into the job's key-value store when its failure
monitor starts, and the monitor keeps a heartbeat there. After a failure a surviving rank
looks for the ranks that are gone (:func:`describe_lost_ranks`): on its own host by their
processes (with the exit status, read from ``/proc`` while the process is not yet reaped by
its launcher), on other hosts by heartbeats that stopped.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

__all__ = ["RankProcess", "Roster", "describe_lost_ranks", "process_end", "process_exiting"]


@dataclass(frozen=True)
class RankProcess:
    """A rank's process: enough to tell, from the same host, whether it still runs."""

    host: str
    """The host name the rank runs on."""
    pid: int
    """The rank's process id on that host."""
    started: str
    """The process's start time in clock ticks since boot (``/proc/PID/stat``): a pid reused
    by another process after this one ended has another."""

    @classmethod
    def this(cls) -> RankProcess:
        """This process."""
        return cls(socket.gethostname(), os.getpid(), _stat(os.getpid())[19])

    def encode(self) -> str:
        """As the store keeps it: ``host pid started``."""
        return f"{self.host} {self.pid} {self.started}"

    @classmethod
    def decode(cls, text: str) -> RankProcess:
        """The process :meth:`encode` wrote as ``text``."""
        host, pid, started = text.split()
        return cls(host, int(pid), started)


def _stat(pid: int) -> list[str]:
    """The fields of ``/proc/PID/stat`` from the third (state) on: the name may hold spaces."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def process_end(process: RankProcess) -> str | None:
    """How ``process`` ended ("was killed by SIGKILL", "exited with status 3", "is gone"), or
    ``None`` while it runs or when it is on another host (nothing to tell from here)."""
    if process.host != socket.gethostname():
        return None
    try:
        fields = _stat(process.pid)
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return "is gone"  # already reaped by its launcher: its exit status went with it
    except OSError:  # no /proc here
        return None
    if fields[19] != process.started:
        return "is gone"  # the pid now belongs to another process
    if fields[0] not in ("Z", "X"):
        return None
    if len(fields) < 50:  # a kernel older than 3.5 keeps no exit code here
        return "is gone"
    code = os.waitstatus_to_exitcode(int(fields[49]))
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


_PF_EXITING = 0x4
"""The kernel's flag of a process that has begun to exit (``/proc/PID/stat``, field 9): set
before it closes its sockets, so before its peers see a closed connection."""


def process_exiting(process: RankProcess) -> bool:
    """Whether ``process``, on this host, has ended or begun to end."""
    if process.host != socket.gethostname():
        return False
    try:
        fields = _stat(process.pid)
    except (OSError, IndexError):
        return True  # gone (or no /proc: then process_end says nothing either)
    return (
        fields[19] != process.started
        or fields[0] in ("Z", "X")
        or (int(fields[6]) & _PF_EXITING != 0)
    )


class Roster:
    """The ranks' processes and heartbeats in the job's store, kept by the failure monitor.

    ``store_rank`` is the rank whose process holds the store (rank 0 when the ranks were
    started with ``MASTER_ADDR``/``MASTER_PORT`` alone), ``None`` when a launcher holds it
    (torchrun's agent). Once that rank is seen gone on this host, the store is not asked
    again: each call to a dead store prints a C++ stack trace.
    """

    def __init__(
        self, store: dist.Store, prefix: str, rank: int, world_size: int, store_rank: int | None
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.store_rank = store_rank
        self.processes: dict[int, RankProcess] = {}
        self._store = store
        self._prefix = prefix

    def _key(self, kind: str, rank: int) -> str:
        return f"{self._prefix}/{kind}/{rank}"

    def store_gone(self) -> bool:
        """Whether the process holding the store is known to have ended or to be ending."""
        holder = self.processes.get(self.store_rank) if self.store_rank is not None else None
        return holder is not None and process_exiting(holder)

    def enter(self) -> None:
        """Enter this rank's process (once, at the monitor's start)."""
        self.processes[self.rank] = RankProcess.this()
        self._store.set(self._key("process", self.rank), self.processes[self.rank].encode())
        # The ranks enter together (the process group has just joined them): learn them all
        # now, so that a rank killed early is known, and its store with it, before anyone
        # asks that store again.
        keys = [self._key("process", r) for r in range(self.world_size)]
        with contextlib.suppress(Exception):  # a slow rank is learned by a later heartbeat
            self._store.wait(keys, datetime.timedelta(seconds=10))
            self.learn()

    def beat(self) -> None:
        """One heartbeat; and read the other ranks' processes until all are known (once they
        are, a store that went away with rank 0 still leaves them known here)."""
        self._store.add(self._key("beat", self.rank), 1)
        self.learn()

    def learn(self) -> None:
        """Read the processes of the ranks not known yet, once all have entered theirs."""
        missing = [r for r in range(self.world_size) if r not in self.processes]
        if missing and self._store.check([self._key("process", r) for r in missing]):
            for r in missing:
                self.processes[r] = RankProcess.decode(
                    self._store.get(self._key("process", r)).decode()
                )

    def mark_failed(self) -> None:
        """Note that this rank failed on its own (and will stop beating)."""
        self._store.set(self._key("failed", self.rank), "1")

    def silent(self, before: dict[int, int]) -> list[int] | None:
        """The other ranks whose heartbeat did not move since ``before`` and that reported no
        failure of their own; ``None`` if the store is unreachable."""
        try:
            return [
                r
                for r in range(self.world_size)
                if r != self.rank
                and self._store.add(self._key("beat", r), 0) == before[r]
                and not self._store.check([self._key("failed", r)])
            ]
        except Exception:  # the store went away with its host
            return None

    def beats(self) -> dict[int, int] | None:
        """Every rank's heartbeat count, or ``None`` if the store is unreachable."""
        if self.store_gone():
            return None
        try:
            return {r: self._store.add(self._key("beat", r), 0) for r in range(self.world_size)}
        except Exception:  # the store went away with its host
            return None


def describe_lost_ranks(roster: Roster, *, wait: float = 3.0) -> str | None:
    """One phrase naming the ranks that are gone and how, or ``None`` if every rank seems alive.

    Waits up to ``wait`` seconds: a killed process may still be ending when its peers see the
    closed connection, and a heartbeat needs time to be seen missing.
    """
    others = [r for r in range(roster.world_size) if r != roster.rank]
    if not roster.store_gone():
        with contextlib.suppress(Exception):  # a rank that died at once is not known yet
            roster.learn()
    before = roster.beats()
    deadline = time.monotonic() + wait
    while True:
        ended = {
            r: end
            for r in others
            if r in roster.processes and (end := process_end(roster.processes[r])) is not None
        }
        if ended or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    if ended:
        return "; ".join(
            f"rank {r} (pid {roster.processes[r].pid}) {end}" for r, end in sorted(ended.items())
        )
    silent = roster.silent(before) if before is not None else None
    if silent is None:
        holder = "torchrun's agent" if roster.store_rank is None else f"rank {roster.store_rank}"
        return f"{holder}, which holds the job's key-value store, stopped responding"
    if not silent:
        return None
    names = ", ".join(f"rank {r}" for r in silent)
    hosts = {roster.processes[r].host for r in silent if r in roster.processes}
    where = f" (on {', '.join(sorted(hosts))})" if hosts else ""
    return f"{names}{where} stopped responding"
