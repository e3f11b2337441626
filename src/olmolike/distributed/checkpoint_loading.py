"""Reading DCP checkpoints with several threads, checking every record, never running code.

torch's readers read one item after another; the readers here split a load plan into
byte-balanced parts read by a thread pool (each part opens its own file handles), also for a
checkpoint written as a single file, check every record's CRC-32 as they read it
(:mod:`.checkpoint_records`), and never run code from the checkpoint
(:mod:`.checkpoint_unpickle`).
"""

from __future__ import annotations

import dataclasses
import io as io_
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any, cast

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from .. import io
from ..exceptions import DamagedCheckpointError
from .checkpoint_records import (
    CHUNK,
    CheckingWindow,
    Record,
    Window,
    archive_problem,
    parse_archive,
)
from .checkpoint_storage import default_thread_count
from .checkpoint_unpickle import WeightsOnlyLoadPlanner, unpickle_metadata

__all__ = ["ParallelFileSystemReader", "ParallelFsspecReader", "dcp_reader"]


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


class _CheckedRecords(FileSystemReader):
    """Checks each record (:func:`archive_problem`) as torch loads it.

    A local tensor's record is checked from the bytes torch reads to load it
    (:class:`CheckingWindow`), once ``torch.load`` is done with it: when the same thread
    starts on its next record, or has read its part of the plan (:meth:`_read_checked`). That
    is one read of each byte instead of two (the second read cost ~0.1 s of CPU time in a
    773 MB load on a 2-core machine; ``zlib.crc32`` itself, ~0.25 s, remains). Records under
    1 MB (pickled values, small tensors) are checked before torch reads them, and a remote one
    (``read_once``) is read into memory once, checked there and loaded from there.
    """

    read_once = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._being_read = threading.local()

    def _slice_file(self, file: Any, sinfo: Any) -> IO[bytes]:
        self._check_last_read()
        if sinfo.transform_descriptors:  # transformed (compressed, say): no archive to check
            return super()._slice_file(file, sinfo)
        start, length = int(sinfo.offset), int(sinfo.length)
        what = f"{sinfo.relative_path} (its record at bytes {start}-{start + length})"
        if self.read_once:
            file.seek(start)
            record = io_.BytesIO(file.read(length))
            _raise_if(what, archive_problem(record))
            record.seek(0)
            return record
        window = Window(file, start, length)
        if length < CHUNK:  # a pickled value, say: checked before anything reads it
            _raise_if(what, archive_problem(cast(IO[bytes], window)))
            return super()._slice_file(file, sinfo)
        records = parse_archive(cast(IO[bytes], window))
        if isinstance(records, str):
            _raise_if(what, records)
        path = Path(self.fs.concat_path(self.path, sinfo.relative_path))
        checking = CheckingWindow(file, start, length, cast(list[Record], records), path)
        self._being_read.record = (what, checking)
        return cast(IO[bytes], checking)

    def _check_last_read(self) -> None:
        """Raise if the record this thread read last does not match its CRC-32s."""
        last = getattr(self._being_read, "record", None)
        self._being_read.record = None
        if last is not None:
            _raise_if(last[0], last[1].problem())

    def _read_checked(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """torch's reading of ``plan``, every record checked before it returns."""
        self._being_read.record = None
        done = super().read_data(plan, planner)
        self._check_last_read()
        return done


def _raise_if(what: str, problem: str | None) -> None:
    if problem is not None:
        raise DamagedCheckpointError(f"{what} is garbled ({problem})")


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
        return _read_in_parallel(self, self._read_checked, plan, planner, self.thread_count)


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
