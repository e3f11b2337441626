"""DCP storage readers with several threads: the readers every checkpoint load uses (the writer
is :mod:`.checkpoint_save`'s).

Reading: torch's readers read one item after another; the readers here split a load plan into
byte-balanced parts read by a thread pool (each part opens its own file handles), also for a
checkpoint written as a single file, and never run code from the checkpoint
(:mod:`.checkpoint_unpickle`).
The bytes on disk are DCP's own: checkpoints stay readable by plain DCP, and older ones here.

Checking: every record DCP wrote (a tensor, or a pickled value) is a ``torch.save`` archive,
whose records carry CRC-32s that torch writes but never checks, so a garbled shard would load
as wrong numbers. The readers here check them (:func:`archive_problem`) as they read, from the
bytes read for the load anyway, and raise :class:`~olmolike.exceptions.DamagedCheckpointError`
naming the shard.
"""

from __future__ import annotations

import dataclasses
import io as io_
import os
import struct
import threading
import zipfile
import zlib
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
from .checkpoint_save import default_thread_count
from .checkpoint_unpickle import WeightsOnlyLoadPlanner, unpickle_metadata

__all__ = ["ParallelFileSystemReader", "ParallelFsspecReader", "archive_problem", "dcp_reader"]


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


class _Damaged(Exception):
    """Why an archive is not whole (internal: becomes a problem string)."""


@dataclasses.dataclass
class _Record:
    """A stored (uncompressed) record of an archive: where its bytes are, their CRC-32, and
    the CRC-32 of the bytes read so far from its start (``checked`` of them)."""

    name: str
    start: int
    size: int
    crc: int
    running: int = 0
    checked: int = 0

    def take(self, position: int, data: memoryview) -> None:
        """Add ``data``, read at ``position``, if it continues the bytes checked so far."""
        offset = self.start + self.checked - position
        if 0 <= offset < len(data):
            part = data[offset : offset + self.size - self.checked]
            self.running = zlib.crc32(part, self.running)
            self.checked += len(part)

    def problem(self, archive_file: IO[bytes]) -> str | None:
        """Why the record does not match its CRC-32; what was not read yet is read now."""
        if self.checked < self.size:
            archive_file.seek(self.start + self.checked)
            buffer = memoryview(bytearray(min(_CHUNK, self.size - self.checked)))
            while self.checked < self.size:
                want = min(len(buffer), self.size - self.checked)
                got = archive_file.readinto(buffer[:want])  # type: ignore[attr-defined]
                if not got:
                    return f"record {self.name!r} is cut short"
                self.running = zlib.crc32(buffer[:got], self.running)
                self.checked += got
        if self.running != self.crc:
            return f"record {self.name!r} does not match its CRC-32"
        return None


def _stored_records(archive_file: IO[bytes]) -> list[_Record]:
    """The stored records of the seekable ``torch.save`` archive ``archive_file``, each local
    header checked against the central directory's copy (as torch reads it); raises if one is
    damaged. A compressed record (torch stores, but another writer may compress) is read and
    checked here."""
    records = []
    with zipfile.ZipFile(archive_file) as archive:
        for info in archive.infolist():
            if info.compress_type != zipfile.ZIP_STORED:
                archive.read(info)  # checked here: raises on a CRC mismatch
                continue
            archive_file.seek(info.header_offset)
            header = archive_file.read(_LOCAL_HEADER.size)
            signature, flags, name, extra = _LOCAL_HEADER.unpack(header)
            named = archive_file.read(name)
            if (
                signature != b"PK\x03\x04"
                or (flags, info.volume) != (info.flag_bits, 0)
                or named != info.orig_filename.encode()
                or info.compress_size != info.file_size
            ):
                raise _Damaged(f"record {info.filename!r} has a damaged header")
            start = info.header_offset + _LOCAL_HEADER.size + name + extra
            records.append(_Record(info.filename, start, info.file_size, info.CRC))
    return records


def _parse(archive_file: IO[bytes]) -> list[_Record] | str:
    """:func:`_stored_records`, or why the bytes are not a whole archive."""
    try:
        return _stored_records(archive_file)
    except Exception as e:  # any way of failing to parse the bytes means they are damaged
        return str(e) if isinstance(e, _Damaged) else f"{type(e).__name__}: {e}"


def archive_problem(archive_file: IO[bytes]) -> str | None:
    """Why the seekable ``archive_file`` is not a whole ``torch.save`` archive whose every
    record matches its CRC-32 (``None`` if it is one).

    ``torch.load`` never checks these CRCs: a flipped byte in a tensor's data loads as a wrong
    value. The records are streamed through ``zlib.crc32`` in chunks of a reused buffer.
    """
    records = _parse(archive_file)
    if isinstance(records, str):
        return records
    try:
        return _first_problem(records, archive_file)
    except Exception as e:
        return f"{type(e).__name__}: {e}"


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


class _CheckingWindow(_Window):
    """A :class:`_Window` over one archive in the local file ``path`` that computes its
    records' CRC-32s from the bytes it is read for (by ``torch.load``), straight from the
    reader's buffer: no second read.

    :meth:`problem` then compares them, reading only what was not read in order (records
    torch skips, if any) from ``path`` anew: the stream torch read through may be closed."""

    def __init__(
        self, file: Any, start: int, length: int, records: list[_Record], path: Path
    ) -> None:
        super().__init__(file, start, length)
        self._records, self._path = records, path

    def readinto(self, b: Any) -> int:
        position = self._pos
        got = super().readinto(b)
        if got:
            data = memoryview(b).cast("B")[:got]
            for record in self._records:
                record.take(position, data)
        return got

    def problem(self) -> str | None:
        try:
            if all(r.checked == r.size for r in self._records):
                return _first_problem(self._records, cast(IO[bytes], self))
            with open(self._path, "rb") as file:
                rest = _Window(file, self._start, self._length)
                return _first_problem(self._records, cast(IO[bytes], rest))
        except Exception as e:
            return f"{type(e).__name__}: {e}"


def _first_problem(records: list[_Record], archive_file: IO[bytes]) -> str | None:
    return next((p for r in records if (p := r.problem(archive_file))), None)


class _CheckedRecords(FileSystemReader):
    """Checks each record (:func:`archive_problem`) as torch loads it.

    A local tensor's record is checked from the bytes torch reads to load it
    (:class:`_CheckingWindow`), once ``torch.load`` is done with it: when the same thread
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
        window = _Window(file, start, length)
        if length < _CHUNK:  # a pickled value, say: checked before anything reads it
            _raise_if(what, archive_problem(cast(IO[bytes], window)))
            return super()._slice_file(file, sinfo)
        records = _parse(cast(IO[bytes], window))
        if isinstance(records, str):
            _raise_if(what, records)
        path = Path(self.fs.concat_path(self.path, sinfo.relative_path))
        checking = _CheckingWindow(file, start, length, cast(list[_Record], records), path)
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
