"""One writer per save folder: a lease with a run id and a heartbeat, on any storage.

Two runs writing into one save folder overwrite each other's checkpoints and metrics. A run
that trains holds a lease on its save folder; a second run is refused with a message naming
the first, and a lease whose holder is dead is taken over.

The lease lives in ``{save_folder}/.olmolike-lease/`` as numbered records
(``0000000001.json``, ``0000000002.json``, ...). The record with the highest number is the
current lease. A run takes the lease by *creating* the next number, exclusively:

* on a local or shared disk with a hard link (which fails if the name exists);
* on S3 with ``If-None-Match: *``, on GCS with ``ifGenerationMatch=0`` (conditional writes).

So when two runs start together, or both find the same stale lease, exactly one creates the
next record and the other is refused. Records are never reused: a clean exit marks its
record released instead of deleting it, and a new holder deletes only older records.

A store that ignores conditional writes (some S3-compatible servers, GCS emulators) lets both
writes land; the taker therefore waits a moment and reads its record back, and refuses if
another run's record replaced it or another live lease appeared. The residual risk there is a
race narrower than that moment (a run that listed the folder before the first wrote, and wrote
after the first read back); the heartbeat re-reads the record and stops the loser's saves.

A lease is stale (its run dead) when its heartbeat is older than its timeout. Heartbeats
compare wall clocks of different machines: keep clocks synchronised (NTP) to well under the
timeout. Two shortcuts take a lease over at once, so that a restarted run does not wait for
the timeout:

* its holder ran on this host (and in this pid namespace: containers that share a host name
  cannot see each other's processes) and its process is gone: no process with its pid, or
  one that started at another time (its pid was reused, or the machine rebooted), or a
  zombie (or it is this process, which no longer holds it);
* its holder ran on another host with this run's id: the same run, restarted by its
  scheduler, which ends a run's processes before it starts them again.

A run's id (:func:`run_id`) is ``OLMOLIKE_RUN_ID``, else the SLURM job and step
(``slurm-job-J-step-S``, kept by a requeued job), else torchrun's rendezvous id
(``TORCHELASTIC_RUN_ID``: shared by the restarts of one ``torchrun --max-restarts``, a fresh
uuid per ``torchrun --standalone``; the default ``none`` of a multi-node ``torchrun`` without
``--rdzv-id`` names no run and is not used), else a token of this process. ``olmolike train
--max-restarts`` gives its ranks a run id of its own launch. A run id names one run *of one
save folder*: the lease is the folder's.

The rule for two jobs given the same run id by mistake: on one host they are two runs (a
holder whose process is alive is never taken over, whatever its id: two ``srun`` steps of one
allocation, two trainers started with one ``OLMOLIKE_RUN_ID``). On two hosts the second is
taken for a restart of the first: it takes the lease over, and the first stops writing there
before its next marker (each commit renews the lease first, which finds it taken) with an
error naming the second and the id they share. Give every job its own id.

The heartbeat thread only reads and writes the lease record; it runs no collective.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import asdict, dataclass, replace
from dataclasses import fields as dataclass_fields
from datetime import datetime, timezone
from pathlib import Path

import torch.distributed as dist

from ... import io
from ...distributed.utils import broadcast_object, get_rank
from ...exceptions import CheckpointError

__all__ = [
    "LeaseRecord",
    "SaveFolderInUseError",
    "SaveFolderLease",
    "acquire_lease",
    "current_lease",
    "run_id",
]

log = logging.getLogger(__name__)

LEASE_DIR = ".olmolike-lease"
DEFAULT_TIMEOUT = 120.0
# How long a taker waits before reading its record back (stores without conditional writes).
SETTLE_SECONDS = 1.0


# Run ids of the leases this process holds or is taking now (a release that could not reach the store
# leaves a record behind that names this process; it must not block a later run here).
_HELD_HERE: set[str] = set()


class SaveFolderInUseError(CheckpointError):
    """Another live run holds the save folder's lease (or took it over from this run)."""


def run_id() -> str:
    """This run's id: ``OLMOLIKE_RUN_ID``, else the SLURM job and step (``slurm-job-J-step-S``:
    two ``srun`` steps of one allocation are two runs), else torchrun's rendezvous id
    (``torchrun-ID``, unless it is torchrun's default ``none``), else host, pid and a token."""
    explicit = os.environ.get("OLMOLIKE_RUN_ID")
    if explicit:
        return explicit
    job = os.environ.get("SLURM_JOB_ID")
    if job:
        step = os.environ.get("SLURM_STEP_ID")
        return f"slurm-job-{job}" + (f"-step-{step}" if step else "")
    rendezvous = os.environ.get("TORCHELASTIC_RUN_ID")
    if rendezvous and rendezvous != "none":
        return f"torchrun-{rendezvous}"
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


@dataclass(frozen=True)
class LeaseRecord:
    """What a lease record says about its holder."""

    run_id: str
    """The holding run's id (``OLMOLIKE_RUN_ID``, else one made when it started): a restart of the
    same job has the same."""
    host: str
    """The host name of the holding process."""
    pid: int
    """The process id of the holder on its host."""
    started_at: float
    """When the holder took the lease, in seconds since the epoch (UTC)."""
    heartbeat_at: float
    """The holder's latest heartbeat, in seconds since the epoch; a lease whose heartbeat is older
    than ``timeout`` is stale."""
    timeout: float
    """Seconds without a heartbeat after which the lease may be taken over."""
    released: bool = False
    """Whether the holder gave the lease up when it ended (the folder is free at once)."""
    process_started: int | None = None
    """When the holder's process started (clock ticks after boot, Linux): tells it from a
    later process that got its pid. ``None`` where unknown (other systems, older records)."""
    boot_id: str | None = None
    """The holder's machine's boot (Linux): a process of an earlier boot is gone."""
    pid_namespace: str | None = None
    """The holder's pid namespace (Linux): containers that share a host name (host network)
    see one another's pids as other processes, or none; a holder in another namespace is
    judged as one on another host."""

    def age(self) -> float:
        return max(0.0, time.time() - self.heartbeat_at)

    def is_live(self, for_run: str | None = None) -> bool:
        """Whether the holder may still be writing (seen from the run ``for_run``)."""
        return self.ended(for_run) is None

    def ended(self, for_run: str | None = None) -> str | None:
        """Why the holder cannot be writing any more (seen from the run ``for_run``), or
        ``None`` while it may be.

        On this host a holder is live while its process runs and beats; one on another host
        with ``for_run``'s id is the same run's previous attempt (its scheduler ended it).
        """
        if self.released:
            return "it released it"
        if self._on_this_host():
            if self.boot_id is not None and self.boot_id != _boot_id():
                return "its host rebooted since"
            if self.pid == os.getpid():  # this process: live only while it holds the lease
                if self.run_id not in _HELD_HERE:
                    return "this process let it go"
            elif not _process_runs(self.pid, self.process_started):
                return "its process is gone"
        elif self.run_id == for_run:
            return "it is this run, restarted (it has this run's id)"
        if self.age() > self.timeout:  # e.g. a process stopped, or on a dead node
            return f"its last heartbeat is older than lease_timeout={self.timeout:g}s"
        return None

    def _on_this_host(self) -> bool:
        """Whether the holder's process can be looked up here: same host, same pid namespace."""
        if self.host != socket.gethostname():
            return False
        return self.pid_namespace is None or self.pid_namespace == _pid_namespace()

    def describe(self) -> str:
        started = datetime.fromtimestamp(self.started_at, timezone.utc).strftime("%Y-%m-%d %H:%M")
        return (
            f"run {self.run_id} (host {self.host}, pid {self.pid}, running since {started} UTC, "
            f"last heartbeat {self.age():.0f}s ago)"
        )


def _process_runs(pid: int, started: int | None) -> bool:
    """Whether the process ``pid`` that started at ``started`` (if known) still runs on this
    host: not if there is none, if it is a zombie (dead, not yet reaped by its launcher), or
    if it started at another time (another process that got the pid)."""
    stat = _proc_stat(pid)
    if stat is None:  # no /proc (not Linux), or no such process
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    state, start = stat
    return state not in ("Z", "X") and (started is None or start == started)


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """A process's state letter and start time (clock ticks after boot) from ``/proc``."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (name) "
    return fields[0], int(fields[19])


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _lease_dir(folder: str) -> str:
    return io.join_path(folder, LEASE_DIR)


def _epochs(folder: str) -> list[int]:
    names = io.list_dir(_lease_dir(folder))
    return sorted(int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit())


def _record_path(folder: str, epoch: int) -> str:
    return io.join_path(_lease_dir(folder), f"{epoch:010d}.json")


def _write(folder: str, epoch: int, record: LeaseRecord) -> None:
    io.write_file(_lease_dir(folder), f"{epoch:010d}.json", _encode(record), overwrite=True)


def _read(folder: str, epoch: int) -> LeaseRecord | None:
    """The record, or ``None`` if it is gone or unreadable (treated as a dead holder)."""
    try:
        fields = json.loads(io.read_bytes(_record_path(folder, epoch)))
        # Fields a later version added are not this version's business.
        known = {f.name for f in dataclass_fields(LeaseRecord)}
        return LeaseRecord(**{k: v for k, v in fields.items() if k in known})
    except FileNotFoundError:
        return None
    except (ValueError, TypeError) as e:
        log.warning("Ignoring the malformed lease record %s: %s", _record_path(folder, epoch), e)
        return None


def current_lease(folder: str, for_run: str | None = None) -> LeaseRecord | None:
    """The live lease on ``folder`` held by a run other than ``for_run``, if there is one."""
    epochs = _epochs(folder)
    record = _read(folder, epochs[-1]) if epochs else None
    return record if record is not None and record.is_live(for_run) else None


def in_use_message(folder: str, holder: LeaseRecord) -> str:
    wait = max(0.0, holder.timeout - holder.age())
    return (
        f"the save folder {folder} is in use by {holder.describe()}. Two runs writing to one "
        "folder overwrite each other's checkpoints and metrics. Wait for that run to end, or "
        "give this run another save_folder. If that run is dead, its lease goes stale "
        f"{wait:.0f}s from now (lease_timeout={holder.timeout:g}s) and is then taken over; "
        f"to take it over now, delete {_lease_dir(folder)}."
    )


class SaveFolderLease:
    """Holds the lease on one save folder while a run writes there (see the module docstring)."""

    def __init__(
        self,
        folder: str,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        run: str | None = None,
        settle: float | None = None,
    ) -> None:
        self.folder = str(folder).rstrip("/")
        self.timeout = timeout
        self.run_id = run or run_id()
        self.settle = (
            (SETTLE_SECONDS if io.is_url(self.folder) else 0.0) if settle is None else settle
        )
        self._epoch: int | None = None
        self._record: LeaseRecord | None = None
        self.lost: SaveFolderInUseError | None = None
        """Set by the heartbeat once another run has taken the lease over: the error a save
        raises before it touches the folder and before its marker (a value, so that a save
        reads it without calling into the lease)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def held(self) -> bool:
        return self._epoch is not None and self.lost is None

    def acquire(self) -> None:
        """Take the lease, or raise :class:`SaveFolderInUseError` naming the live holder."""
        if self._epoch is not None:
            return
        _HELD_HERE.add(self.run_id)  # from the first write on, its record is live
        try:
            self._acquire()
        except BaseException:
            _HELD_HERE.discard(self.run_id)
            raise

    def _acquire(self) -> None:
        for _ in range(5):
            epochs = _epochs(self.folder)
            top = epochs[-1] if epochs else 0
            holder = _read(self.folder, top) if top else None
            if holder is not None and holder.is_live(self.run_id):
                raise SaveFolderInUseError(in_use_message(self.folder, holder))
            if holder is not None and not holder.released:
                log.warning(
                    "Taking over the lease on %s of %s: %s",
                    self.folder,
                    holder.describe(),
                    holder.ended(self.run_id),
                )
            now = time.time()
            stat = _proc_stat(os.getpid())
            record = LeaseRecord(
                self.run_id,
                socket.gethostname(),
                os.getpid(),
                now,
                now,
                self.timeout,
                process_started=stat[1] if stat else None,
                boot_id=_boot_id(),
                pid_namespace=_pid_namespace(),
            )
            if not io.create_file(_record_path(self.folder, top + 1), _encode(record)):
                continue  # another run took this number first: look at it again
            if self._confirm(top + 1, record):
                self._start(top + 1, record, [e for e in epochs if e <= top])
                return
        raise SaveFolderInUseError(f"could not take the lease on {self.folder}: runs keep racing")

    def _confirm(self, epoch: int, record: LeaseRecord) -> bool:
        """Read back after a moment: a store that ignored the condition may hold another record."""
        if self.settle:
            time.sleep(self.settle)
        mine = _read(self.folder, epoch)
        if mine is None or not _same_holder(mine, record):
            return False
        for other in _epochs(self.folder):
            if other == epoch:
                continue
            rival = _read(self.folder, other)
            if rival is not None and rival.is_live(self.run_id):
                _write(self.folder, epoch, replace(record, released=True))
                raise SaveFolderInUseError(in_use_message(self.folder, rival))
        return True

    def _start(self, epoch: int, record: LeaseRecord, older: list[int]) -> None:
        self._epoch, self._record, self.lost = epoch, record, None
        for old in older:
            io.remove(_record_path(self.folder, old))
        self._remove_leftovers()
        log.info("Holding the lease on %s as run %s", self.folder, self.run_id)
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="lease-heartbeat", daemon=True)
        self._thread.start()

    def _remove_leftovers(self) -> None:
        """Temporary files of record writes that a killed process left (local folders; an
        object store writes whole objects). A file younger than the timeout may be a racing
        taker's, about to become its record: it is left for the next holder."""
        if io.is_url(self.folder):
            return
        for tmp in Path(_lease_dir(self.folder)).glob(".*.tmp"):
            with contextlib.suppress(OSError):
                if time.time() - tmp.stat().st_mtime > self.timeout:
                    tmp.unlink()

    def _beat(self) -> None:
        interval = self.timeout / 6
        while not self._stop.wait(interval):
            try:
                self.heartbeat()
            except Exception as e:  # a store outage: keep trying, takers need the timeout
                log.warning("Renewing the lease on %s failed: %s", self.folder, e)

    def heartbeat(self) -> None:
        """Renew the lease now; notice if another run has taken it over."""
        with self._lock:
            if self._epoch is None or self._record is None or self.lost is not None:
                return
            epochs = _epochs(self.folder)
            current = _read(self.folder, self._epoch)
            newer = [e for e in epochs if e > self._epoch]
            if current is None or not _same_holder(current, self._record) or newer:
                taker = _read(self.folder, newer[-1]) if newer else current
                why = self._why_lost(taker)
                log.error("Lost the lease on %s: %s", self.folder, why)
                self.lost = SaveFolderInUseError(
                    f"another run took over the save folder {self.folder}: {why}; this run "
                    "stops writing there"
                )
                return
            self._record = replace(self._record, heartbeat_at=time.time())
            _write(self.folder, self._epoch, self._record)

    def _why_lost(self, taker: LeaseRecord | None) -> str:
        """Who took the lease over, and why it could (for :meth:`check`'s error)."""
        if taker is None:
            return "its record was removed (someone deleted the lease folder)"
        if taker.run_id == self.run_id:
            return (
                f"{taker.describe()} has this run's id, so it took over as a restart of this "
                "run would; give concurrent runs different OLMOLIKE_RUN_IDs"
            )
        return (
            f"{taker.describe()} found this run's heartbeats more than "
            f"lease_timeout={self.timeout:g}s old and considered it dead"
        )

    def check(self) -> None:
        """Raise if another run has taken the lease over (this run must stop writing)."""
        if self.lost is not None:
            raise self.lost.with_traceback(None)

    def release(self) -> None:
        """Stop the heartbeat and mark the lease released (the next run takes it at once)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        with self._lock:
            epoch, record, lost = self._epoch, self._record, self.lost
            self._epoch = self._record = None
            _HELD_HERE.discard(self.run_id)
        if epoch is None or record is None or lost is not None:
            return
        try:
            current = _read(self.folder, epoch)
            if current is not None and _same_holder(current, record):
                released = replace(record, heartbeat_at=time.time(), released=True)
                _write(self.folder, epoch, released)
            log.info("Released the lease on %s", self.folder)
        except Exception as e:
            log.warning(
                "Releasing the lease on %s failed (it goes stale instead): %s", self.folder, e
            )


def acquire_lease(
    folder: str, timeout: float, *, group: dist.ProcessGroup | None = None
) -> SaveFolderLease | None:
    """Rank 0 takes the lease on ``folder`` and holds it (returned there, ``None`` elsewhere);
    every rank raises :class:`SaveFolderInUseError` if another run holds it."""
    lease, error = None, None
    if get_rank() == 0:
        lease = SaveFolderLease(folder, timeout=timeout)
        try:
            lease.acquire()
        except CheckpointError as e:
            lease, error = None, str(e)
    error = broadcast_object(error, group=group)
    if error is not None:
        raise SaveFolderInUseError(error)
    return lease


def _same_holder(a: LeaseRecord, b: LeaseRecord) -> bool:
    """Whether two records name the same holder: a run is its id *and* its process."""
    return (a.run_id, a.host, a.pid) == (b.run_id, b.host, b.pid)


def _encode(record: LeaseRecord) -> str:
    return json.dumps(asdict(record))
