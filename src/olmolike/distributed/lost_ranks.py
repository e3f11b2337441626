"""Which rank of a job is gone, and how, when a collective failed because a peer vanished.

A rank killed by SIGKILL (or by the out-of-memory killer) reports nothing: the ranks left see
only gloo's "Connection closed by peer [127.0.0.1]:7578", which names no rank. So every rank
enters its host, pid and the pid's start time into the job's key-value store when its failure
monitor starts, and the monitor keeps a heartbeat there. After a failure a surviving rank
looks for the ranks that are gone (:func:`describe_lost_ranks`): on its own host by their
processes (with the exit status, read from ``/proc`` while the process is not yet reaped by
its launcher), on other hosts by heartbeats that stopped.

A rank that does not die but freezes (SIGSTOP, a debugger's stop, a thread that holds Python's
lock while stuck in uninterruptible I/O on a dead mount) closes no connection: the ranks left
wait in their collectives until the group's timeout. Its heartbeat stops at once, though, so
each rank's monitor watches one other rank's (:class:`SilenceWatch`, the next rank of a ring,
so that every rank is watched and the store is asked O(world size) times per beat) and names
a rank silent for longer than a bound (:func:`describe_frozen`). Every call the monitor makes
to the store has a deadline (:class:`BoundedStore`): a TCPStore client waits for an answer
with no limit, and a store held by a frozen process never answers.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..threads import DaemonThreadPool

__all__ = [
    "BoundedStore",
    "RankProcess",
    "Roster",
    "SilenceWatch",
    "StoreUnresponsive",
    "StuckThreads",
    "describe_frozen",
    "describe_lost_ranks",
    "process_end",
    "process_exiting",
    "process_state",
]

log = logging.getLogger(__name__)


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


_FROZEN_STATES = ("T", "t", "D")
"""Stopped by a signal, stopped by a debugger, in uninterruptible (disk) sleep."""


def process_state(process: RankProcess) -> str | None:
    """How the kernel sees ``process``, as ``/proc/PID/status`` says it ("T (stopped)", "D (disk
    sleep)", "R (running)"), with a thread in disk sleep named when the process itself is not;
    ``None`` on another host, or once it is gone."""
    if process.host != socket.gethostname():
        return None
    try:
        if _stat(process.pid)[19] != process.started:
            return None
        status = Path(f"/proc/{process.pid}/status").read_text()
    except (OSError, IndexError):
        return None
    state = next(
        (
            line.split(":", 1)[1].strip()
            for line in status.splitlines()
            if line.startswith("State:")
        ),
        "?",
    )
    if state[:1] != "D":
        stuck = _threads_in_disk_sleep(process.pid)
        if stuck:
            state += f", thread {stuck[0]} in D (disk sleep)"
    return state


def _threads_in_disk_sleep(pid: int) -> list[str]:
    names = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, IndexError):
                text = (task / "stat").read_text()
                if text.rsplit(")", 1)[1].split()[0] == "D":
                    names.append(repr(text[text.index("(") + 1 : text.rindex(")")]))
    return names


def _cpu_seconds(process: RankProcess) -> float | None:
    """CPU time ``process`` used so far (all its threads), if readable from here."""
    try:
        fields = _stat(process.pid)
        if fields[19] != process.started:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


class StoreUnresponsive(ConnectionError):
    """The job's store did not answer a call within its deadline."""


class BoundedStore:
    """The job's key-value store, each call given up after ``deadline`` seconds (``None``:
    calls wait as long as the store takes).

    A TCPStore client waits for the answer to ``add``, ``set`` or ``check`` with no limit (its
    timeout covers waiting for keys only): against a store held by a stopped process, a call
    never returns. Here each call runs on a worker thread and raises
    :class:`StoreUnresponsive` after ``deadline``; from then on every call raises at once (the
    store is taken for gone, and the worker stays stuck in the call it made).
    """

    SLICE = 0.5
    """Seconds of each wait for an answer."""
    MAX_GAP = 5.0
    """Seconds a wait may wake up late before the delay counts as this process's own pause."""

    def __init__(self, store: dist.Store, deadline: float | None) -> None:
        self.store = store
        self.deadline = deadline
        self.unresponsive = False
        self._pool: DaemonThreadPool | None = None

    def _call(self, method: Callable[..., Any], *args: Any, extra: float = 0.0) -> Any:
        if self.deadline is None:
            return method(*args)
        if self.unresponsive:
            raise StoreUnresponsive("the job's key-value store stopped answering")
        if self._pool is None:
            self._pool = DaemonThreadPool(1, "store-calls")
        future = self._pool.submit(method, *args)
        left = self.deadline + extra
        last = time.monotonic()
        while True:
            try:
                return future.result(timeout=max(0.0, min(left, self.SLICE)))
            except FutureTimeout:
                now = time.monotonic()
                # A wait that woke up long after its slice: this process was held up itself
                # (Ctrl-Z and fg, starved of CPU), and the time was not the store's to answer.
                waited, last = now - last, now
                left -= waited if waited <= self.SLICE + self.MAX_GAP else self.SLICE
                if left <= 0:
                    break
        self.unresponsive = True
        raise StoreUnresponsive(
            f"the job's key-value store did not answer for {self.deadline:.0f}s"
        ) from None

    def add(self, key: str, value: int) -> int:
        return int(self._call(self.store.add, key, value))

    def set(self, key: str, value: str) -> None:
        self._call(self.store.set, key, value)

    def get(self, key: str) -> bytes:
        return bytes(self._call(self.store.get, key))

    def check(self, keys: list[str]) -> bool:
        return bool(self._call(self.store.check, keys))

    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None:
        self._call(self.store.wait, keys, timeout, extra=timeout.total_seconds())


class Roster:
    """The ranks' processes and heartbeats in the job's store, kept by the failure monitor.

    ``store_rank`` is the rank whose process holds the store (rank 0 when the ranks were
    started with ``MASTER_ADDR``/``MASTER_PORT`` alone), ``None`` when a launcher holds it
    (torchrun's agent). Once that rank is seen gone on this host, the store is not asked
    again: each call to a dead store prints a C++ stack trace.
    """

    def __init__(
        self,
        store: dist.Store | BoundedStore,
        prefix: str,
        rank: int,
        world_size: int,
        store_rank: int | None,
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

    def mark_done(self) -> None:
        """Note that this rank ended its run (and will stop beating): its silence is no news."""
        self._store.set(self._key("done", self.rank), "1")

    def mark_following(self) -> None:
        """Note that this rank saw another's failure report: it will not report its own."""
        self._store.set(self._key("following", self.rank), "1")

    def ended(self, rank: int, *, following: bool = False) -> bool:
        """Whether ``rank`` reported a failure of its own or the end of its run (or, with
        ``following``, saw another rank's failure report)."""
        kinds = ("failed", "done", "following") if following else ("failed", "done")
        return any(self._store.check([self._key(kind, rank)]) for kind in kinds)

    def beat_count(self, rank: int) -> int:
        """How many heartbeats ``rank`` has given so far."""
        return self._store.add(self._key("beat", rank), 0)

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
        holder = "the launcher" if roster.store_rank is None else f"rank {roster.store_rank}"
        return f"{holder}, which holds the job's key-value store, stopped responding"
    if not silent:
        return None
    names = ", ".join(f"rank {r}" for r in silent)
    hosts = {roster.processes[r].host for r in silent if r in roster.processes}
    where = f" (on {', '.join(sorted(hosts))})" if hosts else ""
    return f"{names}{where} stopped responding"


class SilenceWatch:
    """One rank's watch over the heartbeat of the next rank (ring order), for the monitor.

    :meth:`look` is called at every poll; it returns how long the watched rank has been
    silent once that reaches ``timeout``. Silence counts only after the rank's first beat (a
    rank without a monitor never beats) and never while the watched rank reported its own
    failure or the end of its run. A look that comes long after the previous one (this
    process was itself stopped, or starved of CPU) starts the count afresh: the pause was
    this rank's, not the watched one's. On this host, a silent rank whose process is not
    stopped and used CPU meanwhile (a call that holds Python's lock for long, which silences
    its heartbeat thread) is not frozen: :meth:`look` logs it once and starts the count afresh.
    """

    BUSY_SHARE = 0.01
    """The share of a CPU above which a silent process on this host is busy, not frozen: a
    stopped process uses none at all, one whose every thread waits on a thread stuck in
    uninterruptible sleep next to none."""

    def __init__(self, roster: Roster, timeout: float, poll_interval: float) -> None:
        self.roster = roster
        self.timeout = timeout
        self.rank = (roster.rank + 1) % roster.world_size
        self._max_gap = max(5.0, 10 * poll_interval)
        self._count = 0
        self._since = 0.0
        self._cpu_since: float | None = None
        self._last_look: float | None = None
        self._warned = False

    def look(self, now: float) -> float | None:
        """Seconds the watched rank has been silent, once over the timeout; else ``None``."""
        if self.rank == self.roster.rank:
            return None
        count = self.roster.beat_count(self.rank)
        held_up = self._last_look is not None and now - self._last_look > self._max_gap
        self._last_look = now
        if count != self._count or held_up:
            self._restart(count, now)
            return None
        silent = now - self._since
        if count == 0 or silent < self.timeout or self.roster.ended(self.rank):
            return None
        if self._busy(silent):
            self._restart(count, now)
            return None
        return silent

    def _restart(self, count: int, now: float) -> None:
        self._count, self._since = count, now
        process = self.roster.processes.get(self.rank)
        self._cpu_since = _cpu_seconds(process) if process is not None else None

    def _busy(self, silent: float) -> bool:
        """Whether the watched rank's process, on this host, used CPU while it was silent."""
        process = self.roster.processes.get(self.rank)
        state = process_state(process) if process is not None else None
        if process is None or state is None or state[:1] in _FROZEN_STATES:
            return False
        cpu = _cpu_seconds(process)
        if (
            cpu is None
            or self._cpu_since is None
            or cpu - self._cpu_since <= self.BUSY_SHARE * silent
        ):
            return False
        if not self._warned:
            self._warned = True
            log.warning(
                "Rank %d's heartbeat has been silent for %.0fs, but its process runs (%s, "
                "%.1f CPU-seconds meanwhile): a call that holds Python's lock that long stops "
                "its heartbeat thread; not treated as frozen",
                self.rank,
                silent,
                state,
                cpu - self._cpu_since,
            )
        return True


class StuckThreads:
    """This process's own watch for a thread stuck in uninterruptible sleep (``D``).

    A thread that writes to a mount whose server went away (a hard NFS mount, a FUSE
    filesystem that stopped answering) sleeps in ``D`` until the server comes back. If that
    thread is an async save's writer, the rest of the process, and its heartbeat, run on,
    while every other rank waits for the save's agreement until the group's timeout. The
    kernel calls such a task hung when it stays in ``D`` without being switched in for
    ``hung_task_timeout_secs`` (120 s by default): :meth:`look` applies the same test, with the
    frozen-rank timeout, to every thread of this process (from ``/proc/self/task``).
    """

    def __init__(self, timeout: float, tasks: Path = Path("/proc/self/task")) -> None:
        self.timeout = timeout
        self._tasks = tasks
        self._seen: dict[str, tuple[int, float]] = {}  # tid -> (context switches, since)

    def look(self, now: float) -> str | None:
        """``thread 'name' (tid N) has been in D (disk sleep) for 121s without running``,
        for a thread stuck that long; ``None`` otherwise (or without ``/proc``)."""
        seen: dict[str, tuple[int, float]] = {}
        found = None
        with contextlib.suppress(OSError):
            for task in self._tasks.iterdir():
                with contextlib.suppress(OSError, IndexError, ValueError):
                    stat = (task / "stat").read_text()
                    if stat.rsplit(")", 1)[1].split()[0] != "D":
                        continue
                    switches = _context_switches((task / "status").read_text())
                    before = self._seen.get(task.name)
                    since = before[1] if before is not None and before[0] == switches else now
                    seen[task.name] = (switches, since)
                    if found is None and now - since >= self.timeout:
                        name = (
                            _thread_name(int(task.name))
                            or stat[stat.index("(") + 1 : stat.rindex(")")]
                        )
                        found = (
                            f"thread {name!r} (tid {task.name}) has been in D (disk sleep) "
                            f"for {now - since:.0f}s without running"
                        )
        self._seen = seen
        return found


def _thread_name(tid: int) -> str | None:
    """The Python name of this process's thread ``tid`` (the kernel's is "python" for all)."""
    return next((t.name for t in threading.enumerate() if t.native_id == tid), None)


def _context_switches(status: str) -> int:
    """How often a task was switched in (``/proc/PID/task/TID/status``): it stops counting
    while the task sleeps and is never woken."""
    return sum(
        int(line.split(":", 1)[1])
        for line in status.splitlines()
        if line.startswith(("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:"))
    )


def describe_frozen(roster: Roster, rank: int, silent: float, *, what: str = "heartbeat") -> str:
    """``rank 1 (pid 4242 on node-3, T (stopped)) is frozen: no heartbeat for 61s``: the
    process state only from the same host."""
    process = roster.processes.get(rank)
    if process is None:
        who = f"rank {rank}"
    else:
        state = process_state(process)
        where = f"pid {process.pid} on {process.host}" + (f", {state}" if state else "")
        who = f"rank {rank} ({where})"
    return f"{who} is frozen: no {what} for {silent:.0f}s"
