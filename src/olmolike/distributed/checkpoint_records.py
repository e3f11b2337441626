"""Checking the ``torch.save`` archives DCP writes: every record against its CRC-32.

Every record DCP wrote (a tensor, or a pickled value) is a ``torch.save`` archive, whose
records carry CRC-32s that torch writes but never checks, so a garbled shard would load as
wrong numbers. The readers of :mod:`.checkpoint_loading` check them (:func:`archive_problem`)
as they read, from the bytes read for the load anyway, and raise
:class:`~olmolike.exceptions.DamagedCheckpointError` naming the shard. The CRC-32s are
computed by ISA-L (``isal``): ~4x the speed of the zlib 1.2 many Pythons come with, which
cost a load of 773 MB ~0.3 s of CPU time.
"""

from __future__ import annotations

import dataclasses
import io as io_
import os
import struct
import zipfile
from pathlib import Path
from typing import IO, Any, cast

from isal.isal_zlib import crc32

__all__ = [
    "CHUNK",
    "CheckingWindow",
    "Record",
    "Window",
    "archive_problem",
    "first_problem",
    "parse_archive",
    "stored_records",
]

_LOCAL_HEADER = struct.Struct("<4s2xH18xHH")  # signature, flags, name and extra lengths
CHUNK = 1 << 20


class _Damaged(Exception):
    """Why an archive is not whole (internal: becomes a problem string)."""


@dataclasses.dataclass
class Record:
    """A stored (uncompressed) record of an archive: where its bytes are, their CRC-32, and
    the CRC-32 of the bytes read so far from its start (``checked`` of them)."""

    name: str
    """The record's name in the archive (``data/0``, say)."""
    start: int
    """Where the record's bytes start in the file (bytes)."""
    size: int
    """The record's length in bytes."""
    crc: int
    """The CRC-32 the archive stores for the record."""
    running: int = 0
    """The CRC-32 of the bytes checked so far, continued as more are read."""
    checked: int = 0
    """How many of the record's bytes, from its start, have been read and added to ``running``."""

    def take(self, position: int, data: memoryview) -> None:
        """Add ``data``, read at ``position``, if it continues the bytes checked so far."""
        offset = self.start + self.checked - position
        if 0 <= offset < len(data):
            part = data[offset : offset + self.size - self.checked]
            self.running = crc32(part, self.running)
            self.checked += len(part)

    def read_into(self, archive_file: IO[bytes], buffer: memoryview | None = None) -> None:
        """Read the bytes not checked yet, a chunk at a time, each checked while it is in the
        CPU's cache: into ``buffer`` (as large as the record, which must be unread) or
        through a scratch buffer. Stops at the file's end (the record is then cut short)."""
        archive_file.seek(self.start + self.checked)
        filling = buffer is not None
        if buffer is None:
            buffer = memoryview(bytearray(min(CHUNK, self.size - self.checked)))
        while self.checked < self.size:
            want = min(CHUNK, self.size - self.checked)
            part = buffer[self.checked :][:want] if filling else buffer[:want]
            got = archive_file.readinto(part)  # type: ignore[attr-defined]
            if not got:
                return
            self.running = crc32(part[:got], self.running)
            self.checked += got

    def read(self, archive_file: IO[bytes]) -> bytes:
        """The record's bytes (a small one's), checked as they are read."""
        data = bytearray(self.size)
        self.read_into(archive_file, memoryview(data))
        return bytes(data[: self.checked])

    def problem(self, archive_file: IO[bytes]) -> str | None:
        """Why the record does not match its CRC-32; what was not read yet is read now."""
        self.read_into(archive_file)
        if self.checked < self.size:
            return f"record {self.name!r} is cut short"
        if self.running != self.crc:
            return f"record {self.name!r} does not match its CRC-32"
        return None


def stored_records(archive_file: IO[bytes]) -> list[Record]:
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
            records.append(Record(info.filename, start, info.file_size, info.CRC))
    return records


def parse_archive(archive_file: IO[bytes]) -> list[Record] | str:
    """:func:`stored_records`, or why the bytes are not a whole archive."""
    try:
        return stored_records(archive_file)
    except Exception as e:  # any way of failing to parse the bytes means they are damaged
        return str(e) if isinstance(e, _Damaged) else f"{type(e).__name__}: {e}"


def archive_problem(archive_file: IO[bytes]) -> str | None:
    """Why the seekable ``archive_file`` is not a whole ``torch.save`` archive whose every
    record matches its CRC-32 (``None`` if it is one).

    ``torch.load`` never checks these CRCs: a flipped byte in a tensor's data loads as a wrong
    value. The records are streamed through ``crc32`` in chunks of a reused buffer.
    """
    records = parse_archive(archive_file)
    if isinstance(records, str):
        return records
    try:
        return first_problem(records, archive_file)
    except Exception as e:
        return f"{type(e).__name__}: {e}"


class Window(io_.RawIOBase):
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


class CheckingWindow(Window):
    """A :class:`Window` over one archive in the local file ``path`` that computes its
    records' CRC-32s from the bytes it is read for (by ``torch.load``), straight from the
    reader's buffer: no second read.

    :meth:`problem` then compares them, reading only what was not read in order (records
    torch skips, if any) from ``path`` anew: the stream torch read through may be closed."""

    def __init__(
        self, file: Any, start: int, length: int, records: list[Record], path: Path
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
                return first_problem(self._records, cast(IO[bytes], self))
            with open(self._path, "rb") as file:
                rest = Window(file, self._start, self._length)
                return first_problem(self._records, cast(IO[bytes], rest))
        except Exception as e:
            return f"{type(e).__name__}: {e}"


def first_problem(records: list[Record], archive_file: IO[bytes]) -> str | None:
    """What is wrong with the first of ``records`` that does not match its CRC-32 (each read
    from ``archive_file``), or ``None`` if all match."""
    return next((p for r in records if (p := r.problem(archive_file))), None)
