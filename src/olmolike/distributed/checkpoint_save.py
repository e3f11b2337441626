"""One DCP save of every rank's shards into a local directory: the directory's preparation,
the writer, the agreement on each rank's failure, blocking or in the background.

Everything a save does below the train checkpoint's commit protocol is here, so a save enters
one module of :mod:`olmolike.distributed` besides the on-disk format: saves to an object store
(:mod:`.checkpoint_upload`) and OLMo-core's API (:mod:`~olmolike.distributed.checkpoint`) are
built on it.

Writing: torch's ``FileSystemWriter`` splits a rank's tensors into ``thread_count`` files
written by as many threads; :func:`dcp_writer` picks that count (:func:`default_thread_count`
unless given) and can report each finished file, so that a save to an object store uploads a
shard while the next ones are still being written. The disk starts on each file's bytes as
they are written (:class:`_ShardFile`), so a save does not end waiting for all of them.
The bytes on disk are DCP's own: checkpoints stay readable by plain DCP.

Failures: a save is a sequence of collectives (agreements, DCP's planning and writing). A rank
that fails on its own (copying its state to CPU memory, writing a file, uploading) and then
skips to a later collective leaves the others waiting in an earlier one until the group's
timeout, and its error reaches nobody. So a failing rank never skips: it keeps its error and
hands it to the next collective that every rank runs anyway, :func:`agree_on_failures`, where
each rank tells the others which ranks failed and why. Every rank then raises the same
:class:`SaveFailedError`, naming the failed ranks and their original errors.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import io as io_
import os
import shutil
import socket
from collections.abc import Callable, Generator, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol, cast

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions
from torch.distributed.checkpoint.stateful import Stateful
from torch.futures import Future as TorchFuture

from .. import io
from ..exceptions import CheckpointError, ConfigurationError
from ..threads import DaemonThreadPool
from .utils import all_agree, get_rank, get_world_size, is_distributed

__all__ = [
    "MAX_DEFAULT_THREADS",
    "SaveFailedError",
    "ShardWritten",
    "agree_on_failures",
    "check_checkpoint_backend",
    "dcp_writer",
    "default_thread_count",
    "describe_error",
    "failures_of",
    "in_background",
    "prepare_local_dir",
    "save_local",
    "write_shards",
    "write_synced",
]

ShardWritten = Callable[[Path], None]
"""Called by DCP's writer (see :func:`dcp_writer`) with each finished shard."""


class Write(Protocol):
    """A save's writing, given the (staged) state and this rank's earlier failure, if any."""

    def __call__(self, state_dict: dict[str, Any], *, failed: BaseException | None) -> None: ...


MAX_DEFAULT_THREADS = 8
"""Cap of :func:`default_thread_count`: past a few streams a disk or a store gains nothing."""

SHARD_SUFFIX = ".distcp"


def default_thread_count() -> int:
    """Threads per rank for checkpoint I/O when none is set: the CPUs this process may use,
    at least 2 (one thread serializes while another waits on the disk), at most
    :data:`MAX_DEFAULT_THREADS`."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(2, min(MAX_DEFAULT_THREADS, cpus or 1))


def _libc_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """Linux's ``sync_file_range`` from the C library, or ``None`` where there is none."""
    name = ctypes.util.find_library("c")
    function = getattr(ctypes.CDLL(name), "sync_file_range", None) if name else None
    if function is None:
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return cast(Callable[[int, int, int, int], int], function)


_SYNC_FILE_RANGE = _libc_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # start writing the range's dirty pages; do not wait
_WRITEBACK_BYTES = 16 << 20


class _ShardFile(io_.FileIO):
    """A checkpoint file being written: unbuffered, whole writes, and the disk starts on them
    as they come.

    Each 16 MB written is handed to the disk at once (Linux's ``sync_file_range``, which does
    not wait), so the disk writes while the next tensors are serialized and the fsync that
    makes the file durable waits only for the last writes: 0.21-0.24 s -> 0.02-0.03 s for a
    384 MB file on the 2-core test box, whose page cache would otherwise hold the whole
    checkpoint until that fsync. Unbuffered: DCP fsyncs the file descriptor before it closes
    the stream, so no byte may wait in a buffer (torch's writes are large or few).
    """

    _synced = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):  # one write() may take less (> 2 GB at once on Linux)
            done += super().write(view[done:]) or 0
        end = self.tell()
        if _SYNC_FILE_RANGE is not None and end - self._synced >= _WRITEBACK_BYTES:
            _SYNC_FILE_RANGE(
                self.fileno(), self._synced, end - self._synced, _SYNC_FILE_RANGE_WRITE
            )
            self._synced = end
        return done


class _CheckedFileSystem(FileSystem):
    """DCP's local file system, writing through :class:`_ShardFile`; it keeps the error of any
    stream that failed instead of letting it end the writing thread (see
    :class:`_CheckedWriter`), and calls ``on_written(path)`` once a shard file is closed (DCP
    has fsynced it by then)."""

    def __init__(self, on_written: Callable[[Path], None] | None = None) -> None:
        super().__init__()
        self._on_written = on_written
        self.errors: list[Exception] = []

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io_.IOBase]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        opened = False
        try:
            with _ShardFile(path, mode) as stream:
                opened = True
                yield stream
        except Exception as e:  # raised by the writer once every thread is done
            self.errors.append(_first_os_error(e))
            if not opened:
                yield io_.BytesIO()  # the thread goes on with its other files, into a sink
            return
        if self._on_written is not None and str(path).endswith(SHARD_SUFFIX):
            self._on_written(Path(path))


def _first_os_error(error: Exception) -> Exception:
    """The error that started ``error``: torch's archive writer fails again while closing
    ("unexpected pos") after a write failed on a full disk."""
    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__context__
    return cause if isinstance(cause, OSError) else error


class _CheckedWriter(FileSystemWriter):
    """torch's writer, failing when any writing thread failed.

    torch (2.13) lets its extra writing threads die on an error (a full disk), prints their
    tracebacks, and returns the results of the other threads as a successful write: the save
    would then be marked complete with tensors missing. Here every stream's error is kept
    (:class:`_CheckedFileSystem`) and the first one raised once the threads are done; a write
    that returns fewer results than it had items fails too.
    """

    fs: _CheckedFileSystem

    def write_data(self, plan: Any, planner: Any) -> TorchFuture[Any]:
        self.fs.errors.clear()
        future = super().write_data(plan, planner)
        if self.fs.errors:
            raise self.fs.errors[0]
        written = len(future.value())
        if written != len(plan.items):
            raise OSError(f"DCP wrote {written} of this rank's {len(plan.items)} items")
        return future


def dcp_writer(
    dir: Path,
    thread_count: int | None = None,
    on_shard_written: Callable[[Path], None] | None = None,
) -> FileSystemWriter:
    """DCP's writer into the local directory ``dir`` with ``thread_count`` threads (files per
    rank), fsyncing every file it writes (see :class:`_ShardFile`) and failing if any thread
    failed; ``on_shard_written(path)`` runs, on a writing thread, as each shard file is done."""
    writer = _CheckedWriter(
        str(dir), thread_count=thread_count or default_thread_count(), sync_files=True
    )
    writer.fs = _CheckedFileSystem(on_shard_written)
    return writer


def prepare_local_dir(
    dir: str | Path, group: dist.ProcessGroup | None, save_overwrite: bool
) -> Path:
    """Check on every rank that ``dir`` is a missing or empty local directory, or raise on
    every rank; DCP's writer creates it.

    Without ``save_overwrite`` a non-empty ``dir`` is a :class:`FileExistsError`; with it, the
    lowest rank of each host that sees ``dir`` clears it. Every rank passes an agreement (a
    barrier) before any writes, so no rank writes into a folder another is still clearing.
    """
    path = io.local_path(dir)
    error: str | None = None
    if save_overwrite:
        if _lowest_rank_seeing(path, group):
            with contextlib.suppress(OSError):  # what is left makes DCP's writer fail
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
    else:
        try:
            if path.exists() and (not path.is_dir() or any(path.iterdir())):
                error = f"{path} exists and is not empty; pass save_overwrite=True to replace it"
        except OSError as e:
            error = f"cannot save into {path}: {e}"
    if not all_agree(error is None, group):
        raise FileExistsError(error or f"{path} exists and is not empty on another rank")
    return path


def _lowest_rank_seeing(path: Path, group: dist.ProcessGroup | None) -> bool:
    if not is_distributed():
        return True
    where = (socket.gethostname(), str(path.resolve()))
    places: list[Any] = [None] * get_world_size(group)
    dist.all_gather_object(places, where, group=group)
    return places.index(where) == get_rank(group)


def write_synced(path: Path, data: bytes) -> None:
    """Write a local file and flush it to disk (before a marker vouches for it)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


_CPU_BACKENDS = ("gloo", "mpi")


def check_checkpoint_backend(backend: str) -> None:
    """Refuse a process-group backend that cannot run collectives on CPU tensors.

    Checkpoint collectives (DCP's planning, the checkpointer's agreement on success) exchange
    CPU tensors and objects, also from a background thread; ``"nccl"`` alone cannot. Accepted:
    a CPU backend (``"gloo"``) or a per-device string with a CPU part (``"cpu:gloo,cuda:nccl"``).
    """
    parts = [p.strip().lower() for p in str(backend).split(",") if p.strip()]
    for part in parts:
        device, _, name = part.rpartition(":")
        if device in ("", "cpu") and name in _CPU_BACKENDS:
            return
    raise ConfigurationError(
        f"checkpoints need a process-group backend with CPU collectives, but the backend is "
        f"{backend!r}. Initialize with backend='cpu:gloo,cuda:nccl' (e.g. "
        "prepare_training_environment(backend='cpu:gloo,cuda:nccl')), or pass a gloo group "
        "as checkpointer_pg to TrainerConfig.build()",
        path="backend",
    )


def save_local(
    dir: str | Path,
    state_dict: dict[str, Any],
    *,
    process_group: dist.ProcessGroup | None = None,
    save_overwrite: bool = False,
    thread_count: int | None = None,
    on_shard_written: ShardWritten | None = None,
    failed: BaseException | None = None,
) -> None:
    """Save every rank's shards of ``state_dict`` into the local directory ``dir``.

    ``dir`` must be empty or missing unless ``save_overwrite``. ``failed`` is this rank's error
    from before the save (building its state, say): the rank still calls this, so that every
    rank learns it at the save's first agreement instead of waiting for it in a collective.
    """
    agree_on_failures(f"saving {dir}", failed, process_group)
    local = prepare_local_dir(dir, process_group, save_overwrite)
    write_shards(local, state_dict, process_group, thread_count, on_shard_written, str(dir))


def write_shards(
    dir: Path,
    state_dict: dict[str, Any],
    group: dist.ProcessGroup | None,
    thread_count: int | None,
    on_shard_written: ShardWritten | None,
    what: str,
) -> None:
    """DCP's save into the prepared local ``dir``; DCP's failure (on every rank) becomes a
    :class:`SaveFailedError` naming the ranks that failed."""
    try:
        dcp.save(
            state_dict,
            storage_writer=dcp_writer(dir, thread_count, on_shard_written),
            process_group=group,
            no_dist=not is_distributed(),
        )
    except CheckpointException as e:  # DCP's, on every rank; a BaseException: an error
        raise SaveFailedError(f"saving {what}", failures_of(e, group)) from e


def in_background(
    write: Write,
    state_dict: dict[str, Any],
    *,
    process_group: dist.ProcessGroup | None = None,
    stager: AsyncStager | None = None,
    failed: BaseException | None = None,
) -> Future[None]:
    """Copy ``state_dict`` to CPU memory now (with ``stager``, else a stager of its own that is
    closed after the save), then ``write`` the copy on a thread of its own: the one way every
    save runs in the background. A rank whose copy fails passes its error on to ``write``, so
    that every rank's save raises it."""
    if is_distributed():
        check_checkpoint_backend(str(dist.get_backend(process_group)))
    own = stager is None
    stager = stager or DefaultStager(StagingOptions(False, False, False, False))  # DCP's
    staged: dict[str, Any] = {}
    if failed is None:
        try:
            staged = _stage(state_dict, stager)
        except Exception as e:  # MemoryError, say: one rank's only, so not raised here
            failed = e
    pool = DaemonThreadPool(1, "checkpoint-save")
    future = pool.submit(write, staged, failed=failed)
    pool.shutdown(wait=False)
    if own:
        future.add_done_callback(lambda _: stager.close())
    return future


def _stage(state_dict: dict[str, Any], stager: AsyncStager) -> dict[str, Any]:
    """``stager``'s CPU copy of ``state_dict``, complete (as ``dcp.async_save`` stages)."""
    state = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}
    staged = stager.stage(state)
    if isinstance(staged, Future):
        staged = staged.result()
    if stager.should_synchronize_after_execute:
        stager.synchronize_staging()
    return staged


class SaveFailedError(CheckpointError):
    """A save failed on some ranks; every rank raises it, with the same message.

    ``failures`` maps each rank that failed (its rank in the save's process group) to one line
    naming its error.
    """

    def __init__(self, what: str, failures: Mapping[int, str], consequence: str = "") -> None:
        self.what = what
        self.failures = dict(sorted(failures.items()))
        self.consequence = consequence
        described = "; ".join(f"rank {rank}: {error}" for rank, error in self.failures.items())
        super().__init__(
            f"{what} failed on {described}" + (f"; {consequence}" if consequence else "")
        )

    def __reduce__(self) -> tuple[Any, ...]:  # pickles with its fields, not only its message
        return (type(self), (self.what, self.failures, self.consequence))


def failures_of(error: BaseException | None, group: dist.ProcessGroup | None) -> dict[int, str]:
    """The failures ``error`` tells of: an agreed :class:`SaveFailedError`'s or DCP's
    ``CheckpointException``'s (rank by rank), or else this rank's own error."""
    if error is None:
        return {}
    if isinstance(error, SaveFailedError):
        return dict(error.failures)
    if isinstance(error, CheckpointException):
        return {
            rank: describe_error(failure[0] if isinstance(failure, tuple) else failure)
            for rank, failure in error.failures.items()
        }
    return {get_rank(group): describe_error(error)}


def agree_on_failures(
    what: str,
    error: BaseException | None,
    group: dist.ProcessGroup | None,
    consequence: str = "",
) -> None:
    """Raise :class:`SaveFailedError` on every rank if ``what`` failed on any rank.

    A collective: every rank calls it at the same point with its own ``error`` (``None`` if
    its part succeeded), so its count never depends on what failed where. Where ranks tell of
    the same rank's failure, the failed rank's own account is kept (it has the original
    error; DCP may carry a copy that lost detail).
    """
    known = failures_of(error, group)
    reports: list[Any] = [known]
    if is_distributed():
        reports = [None] * get_world_size(group)
        dist.all_gather_object(reports, known, group=group)
    failures: dict[int, str] = {}
    for report in reports:
        failures.update(report)
    for rank, report in enumerate(reports):
        if rank in report:
            failures[rank] = report[rank]
    if failures:  # this rank's own error's traceback goes with it
        raise SaveFailedError(what, failures, consequence) from error


def describe_error(error: BaseException | None) -> str:
    """One line for an error; DCP's CheckpointException names each failed rank's error."""
    if isinstance(error, CheckpointException):
        failures = "; ".join(
            f"rank {rank}: {describe_error(f[0] if isinstance(f, tuple) else f)}"
            for rank, f in sorted(error.failures.items())
        )
        return f"CheckpointException ({failures})"
    if error is None:
        return "unknown error"
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[-1][:300]}" if lines else type(error).__name__
