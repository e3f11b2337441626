"""DCP storage with several threads: the writer and readers every checkpoint save and load uses.

Writing: torch's ``FileSystemWriter`` splits a rank's tensors into ``thread_count`` files
written by as many threads; :func:`dcp_writer` picks that count (:func:`default_thread_count`
unless given) and can report each finished file, so that a save to an object store uploads a
shard while the next ones are still being written. Reading: torch's readers read one item
after another; the readers here split a load plan into byte-balanced parts read by a thread
pool (each part opens its own file handles), also for a checkpoint written as a single file,
and never run code from the checkpoint (:mod:`.checkpoint_unpickle`).
The bytes on disk are DCP's own: checkpoints stay readable by plain DCP, and older ones here.

Checking: every record DCP wrote (a tensor, or a pickled value) is a ``torch.save`` archive,
whose records carry CRC-32s that torch writes but never checks, so a garbled shard would load
as wrong numbers. The readers here check them (:func:`archive_problem`) as they read, from the
bytes read for the load anyway, and raise :class:`~olmolike.exceptions.DamagedCheckpointError`
naming the shard.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io as io_
import os
import struct
import zipfile
import zlib
from collections.abc import Callable, Generator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any, cast

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from .. import io
from ..exceptions import DamagedCheckpointError
from .checkpoint_unpickle import WeightsOnlyLoadPlanner, unpickle_metadata

__all__ = [
    "MAX_DEFAULT_THREADS",
    "archive_problem",
    "dcp_reader",
    "dcp_writer",
    "default_thread_count",
]

MAX_DEFAULT_THREADS = 8
"""Cap of :func:`default_thread_count`: past a few streams a disk or a store gains nothing."""

SHARD_SUFFIX = ".distcp"


def default_thread_count() -> int:
    """Threads per rank for checkpoint I/O when none is set: the CPUs this process may use,
    at least 2 (one thread serializes while another waits on the disk), at most
    :data:`MAX_DEFAULT_THREADS`."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(2, min(MAX_DEFAULT_THREADS, cpus or 1))


class _CheckedFileSystem(FileSystem):
    """DCP's local file system that keeps the error of any stream that failed, instead of
    letting it end the writing thread (see :class:`_CheckedWriter`); and calls
    ``on_written(path)`` once a shard file is closed (DCP has fsynced it by then, when asked
    to)."""

    def __init__(self, on_written: Callable[[Path], None] | None = None) -> None:
        super().__init__()
        self._on_written = on_written
        self.errors: list[Exception] = []

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io_.IOBase]:
        opened = False
        try:
            with super().create_stream(path, mode) as stream:
                opened = True
                yield stream
        except Exception as e:  # raised by the writer once every thread is done
            self.errors.append(_first_os_error(e))
            if not opened:
                yield io_.BytesIO()  # the thread goes on with its other files, into a sink
            return
        if self._on_written is not None and "w" in mode and str(path).endswith(SHARD_SUFFIX):
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

    def write_data(self, plan: Any, planner: Any) -> Future[Any]:
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
    rank), failing if any thread failed; ``on_shard_written(path)`` runs, on a writing thread,
    as each shard file is done."""
    writer = _CheckedWriter(
        str(dir), thread_count=thread_count or default_thread_count(), sync_files=True
    )
    writer.fs = _CheckedFileSystem(on_shard_written)
    return writer


def _split(items: list[ReadItem], sizes: list[int], parts: int) -> list[list[ReadItem]]:
    """``items`` in at most ``parts`` groups of similar byte counts (largest first)."""
    groups: list[list[ReadItem]] = [[] for _ in range(min(parts, len(items)))]
    loads = [0] * len(groups)
    for index in sorted(range(len(items)), key=lambda i: -sizes[i]):
        lightest = loads.index(min(loads))
        groups[lightest].append(items[index])
        loads[lightest] += sizes[index]
    return [group for group in groups if group]


def _read_in_parallel(
    reader: FileSystemReader,
    read: Callable[[LoadPlan, LoadPlanner], Future[None]],
    plan: LoadPlan,
    planner: LoadPlanner,
    thread_count: int,
) -> Future[None]:
    storage: dict[Any, Any] = reader.storage_data
    sizes = [storage[item.storage_index].length for item in plan.items]
    groups = _split(plan.items, sizes, thread_count)
    if len(groups) <= 1:
        return read(plan, planner)
    with ThreadPoolExecutor(len(groups), thread_name_prefix="checkpoint-read") as pool:
        parts = [pool.submit(read, dataclasses.replace(plan, items=g), planner) for g in groups]
        for part in parts:
            part.result().wait()
    done: Future[None] = Future()
    done.set_result(None)
    return done


_LOCAL_HEADER = struct.Struct("<4s2xH18xHH")  # signature, flags, name and extra lengths
_CHUNK = 1 << 20


def archive_problem(archive_file: IO[bytes]) -> str | None:
    """Why the seekable ``archive_file`` is not a whole ``torch.save`` archive whose every
    record matches its CRC-32 (``None`` if it is one).

    ``torch.load`` never checks these CRCs: a flipped byte in a tensor's data loads as a wrong
    value. The records are streamed through ``zlib.crc32`` in chunks of a reused buffer
    (torch stores them uncompressed; a compressed one is read through ``zipfile``).
    """
    try:
        with zipfile.ZipFile(archive_file) as archive:
            for info in archive.infolist():
                if info.compress_type != zipfile.ZIP_STORED:
                    archive.read(info)  # raises on a CRC mismatch
                    continue
                archive_file.seek(info.header_offset)
                header = archive_file.read(_LOCAL_HEADER.size)
                signature, flags, name, extra = _LOCAL_HEADER.unpack(header)
                named = archive_file.read(name)
                archive_file.seek(extra, os.SEEK_CUR)
                # The central directory's copy of what the local header says, as torch reads it.
                if (
                    signature != b"PK\x03\x04"
                    or (flags, info.volume) != (info.flag_bits, 0)
                    or named != info.orig_filename.encode()
                    or info.compress_size != info.file_size
                ):
                    return f"record {info.filename!r} has a damaged header"
                crc, left = 0, info.file_size
                buffer = memoryview(bytearray(min(_CHUNK, left)))
                while left:
                    got = archive_file.readinto(buffer[: min(left, _CHUNK)])  # type: ignore[attr-defined]
                    if not got:
                        return f"record {info.filename!r} is cut short"
                    crc, left = zlib.crc32(buffer[:got], crc), left - got
                if crc != info.CRC:
                    return f"record {info.filename!r} does not match its CRC-32"
    except Exception as e:  # any way of failing to parse the bytes means they are damaged
        return f"{type(e).__name__}: {e}"
    return None


class _Window(io_.RawIOBase):
    """The bytes ``[start, start + length)`` of a seekable binary file, as a file of their own
    (torch's view of a record cannot seek from its end, which ``zipfile`` needs)."""

    def __init__(self, file: Any, start: int, length: int) -> None:
        super().__init__()
        self._file, self._start, self._length, self._pos = file, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._length}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b: Any) -> int:
        size = max(0, min(len(b), self._length - self._pos))
        if size == 0:
            return 0
        self._file.seek(self._start + self._pos)
        got = int(self._file.readinto(memoryview(b)[:size]) or 0)
        self._pos += got
        return got


class _CheckedRecords(FileSystemReader):
    """Checks each record (:func:`archive_problem`) before torch loads it.

    A local file is checked in place, and torch then reads the same bytes from the page cache;
    a remote one (``read_once``) is read into memory once, checked there and loaded from there.
    """

    read_once = False

    def _slice_file(self, file: Any, sinfo: Any) -> IO[bytes]:
        if sinfo.transform_descriptors:  # transformed (compressed, say): no archive to check
            return super()._slice_file(file, sinfo)
        start, length = int(sinfo.offset), int(sinfo.length)
        what = f"{sinfo.relative_path} (its record at bytes {start}-{start + length})"
        record: IO[bytes] = _Window(file, start, length)  # type: ignore[assignment]
        if self.read_once:
            file.seek(start)
            record = io_.BytesIO(file.read(length))
        problem = archive_problem(record)
        if problem is not None:
            raise DamagedCheckpointError(f"{what} is garbled ({problem})")
        if self.read_once:
            record.seek(0)
            return record
        return super()._slice_file(file, sinfo)


class _SafeParallelReading(_CheckedRecords):
    """What olmolike's readers add to torch's: ``.metadata`` read by the restricted unpickler
    of :mod:`.checkpoint_unpickle`, only :class:`WeightsOnlyLoadPlanner` accepted (so that no
    non-tensor value is unpickled unrestricted), every record checked against its CRC-32
    (:class:`_CheckedRecords`), a plan's items read with several threads."""

    thread_count: int

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # torch's FileSystemReader.read_metadata, with pickle.load made safe.
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as file:
            metadata = unpickle_metadata(cast(IO[bytes], file), str(path))
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if not isinstance(planner, WeightsOnlyLoadPlanner):
            raise TypeError(
                f"olmolike's checkpoint readers load with WeightsOnlyLoadPlanner, not "
                f"{type(planner).__name__}: the default unpickles values unrestricted"
            )
        return _read_in_parallel(self, super().read_data, plan, planner, self.thread_count)


class ParallelFileSystemReader(_SafeParallelReading):
    """torch's local reader, made safe and reading with ``thread_count`` threads."""

    def __init__(self, path: str | os.PathLike[str], thread_count: int | None = None) -> None:
        super().__init__(path)
        self.thread_count = thread_count or default_thread_count()


class ParallelFsspecReader(_SafeParallelReading, FsspecReader):
    """torch's fsspec reader (object stores), made safe and reading with ``thread_count``
    threads."""

    read_once = True  # a second read of a record would be a second download

    def __init__(self, path: str, thread_count: int | None = None) -> None:
        super().__init__(path)
        self.thread_count = thread_count or default_thread_count()


def dcp_reader(dir: str | Path, thread_count: int | None = None) -> FileSystemReader:
    """A DCP storage reader for the DCP directory ``dir``, local or remote."""
    if io.is_url(dir):
        # Reading needs no rename, so DCP's fsspec reader works on object stores as they are.
        return ParallelFsspecReader(str(dir), thread_count)
    return ParallelFileSystemReader(str(io.local_path(dir)), thread_count)
