"""DCP storage with several threads: the writer and readers every checkpoint save and load uses.

Writing: torch's ``FileSystemWriter`` splits a rank's tensors into ``thread_count`` files
written by as many threads; :func:`dcp_writer` picks that count (:func:`default_thread_count`
unless given) and can report each finished file, so that a save to an object store uploads a
shard while the next ones are still being written. Reading: torch's readers read one item
after another; the readers here split a load plan into byte-balanced parts read by a thread
pool (each part opens its own file handles), also for a checkpoint written as a single file,
and never run code from the checkpoint (:mod:`.checkpoint_unpickle`).
The bytes on disk are DCP's own: checkpoints stay readable by plain DCP, and older ones here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io as io_
import os
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
from .checkpoint_unpickle import WeightsOnlyLoadPlanner, unpickle_metadata

__all__ = ["MAX_DEFAULT_THREADS", "dcp_reader", "dcp_writer", "default_thread_count"]

MAX_DEFAULT_THREADS = 8
"""Cap of :func:`default_thread_count`: past a few streams a disk or a store gains nothing."""

SHARD_SUFFIX = ".distcp"


def default_thread_count() -> int:
    """Threads per rank for checkpoint I/O when none is set: the CPUs this process may use,
    at least 2 (one thread serializes while another waits on the disk), at most
    :data:`MAX_DEFAULT_THREADS`."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(2, min(MAX_DEFAULT_THREADS, cpus or 1))


class _ReportingFileSystem(FileSystem):
    """DCP's local file system that calls ``on_written(path)`` once a shard file is closed
    (DCP has fsynced it by then, when asked to)."""

    def __init__(self, on_written: Callable[[Path], None]) -> None:
        super().__init__()
        self._on_written = on_written

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io_.IOBase]:
        with super().create_stream(path, mode) as stream:
            yield stream
        if "w" in mode and str(path).endswith(SHARD_SUFFIX):
            self._on_written(Path(path))


def dcp_writer(
    dir: Path,
    thread_count: int | None = None,
    on_shard_written: Callable[[Path], None] | None = None,
) -> FileSystemWriter:
    """DCP's writer into the local directory ``dir`` with ``thread_count`` threads (files per
    rank); ``on_shard_written(path)`` runs, on a writing thread, as each shard file is done."""
    writer = FileSystemWriter(
        str(dir), thread_count=thread_count or default_thread_count(), sync_files=True
    )
    if on_shard_written is not None:
        writer.fs = _ReportingFileSystem(on_shard_written)
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


class _SafeParallelReading(FileSystemReader):
    """What olmolike's readers add to torch's: ``.metadata`` read by the restricted unpickler
    of :mod:`.checkpoint_unpickle`, only :class:`WeightsOnlyLoadPlanner` accepted (so that no
    non-tensor value is unpickled unrestricted), a plan's items read with several threads."""

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

    def __init__(self, path: str, thread_count: int | None = None) -> None:
        super().__init__(path)
        self.thread_count = thread_count or default_thread_count()


def dcp_reader(dir: str | Path, thread_count: int | None = None) -> FileSystemReader:
    """A DCP storage reader for the DCP directory ``dir``, local or remote."""
    if io.is_url(dir):
        # Reading needs no rename, so DCP's fsspec reader works on object stores as they are.
        return ParallelFsspecReader(str(dir), thread_count)
    return ParallelFileSystemReader(str(io.local_path(dir)), thread_count)
