"""Metrics as TensorBoard scalars, for ``tensorboard --logdir``."""

from __future__ import annotations

import math
import os
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ...distributed.utils import get_rank
from ...exceptions import ConfigurationError
from .save_folder_output import _SaveFolderOutput

__all__ = ["TensorBoardCallback"]


@dataclass(frozen=True)
class _Packages:
    event: Any
    """The ``Event`` protobuf class."""
    crc32c: Callable[[bytes], int]


def _packages() -> _Packages:
    """What writing event files needs, or a build-time error naming the extra."""
    try:
        import google_crc32c
        from tensorboard.compat.proto.event_pb2 import Event
    except ImportError as e:
        raise ConfigurationError(
            f"TensorBoardCallback needs the 'tensorboard' and 'google-crc32c' packages ({e}); "
            "install them with: pip install 'olmolike[tensorboard]' (or remove the callback)",
            path="tensorboard",
        ) from None
    return _Packages(Event, google_crc32c.value)


class _EventFile:
    """A TensorBoard event file: ``Event`` protobufs framed as TFRecords, appended in order.

    Written in the training process instead of through ``torch.utils.tensorboard``: its writer
    thread checksums every record with a pure-Python CRC32C (measured ~90 us for one step's
    record, while holding the GIL that training needs), and ``add_scalar`` makes a record per
    scalar. Here a step is one record, encoded by :func:`scalar_event`, checksummed in C,
    buffered until :meth:`flush`.
    """

    def __init__(self, folder: Path, packages: _Packages) -> None:
        self._packages = packages
        self._value_prefixes: dict[str, bytes] = {}
        folder.mkdir(parents=True, exist_ok=True)
        stem = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
        self.path, self._file = _create_new(folder, stem)
        header = packages.event(wall_time=time.time(), file_version="brain.Event:2")
        self._write(header.SerializeToString())

    def add_scalars(self, step: int, scalars: dict[str, float]) -> None:
        self._write(scalar_event(time.time(), step, scalars, self._value_prefixes))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def _write(self, data: bytes) -> None:
        header = _LENGTH.pack(len(data))
        self._file.write(
            header + _CRC.pack(self._masked_crc(header)) + data + _CRC.pack(self._masked_crc(data))
        )

    def _masked_crc(self, data: bytes) -> int:
        # The TFRecord format stores a rotated, offset CRC32C, so that a CRC of data that
        # itself holds CRCs stays well distributed.
        crc = self._packages.crc32c(data)
        return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


_LENGTH, _CRC = struct.Struct("<Q"), struct.Struct("<I")
_DOUBLE, _FLOAT = struct.Struct("<d"), struct.Struct("<f")


def scalar_event(
    wall_time: float, step: int, scalars: dict[str, float], value_prefixes: dict[str, bytes]
) -> bytes:
    """``Event(wall_time, step, summary=Summary(value=[Value(tag, simple_value), ...]))`` in
    protobuf's wire format, byte for byte what ``SerializeToString`` makes.

    Encoded by hand because building the protobuf objects costs ~2 us per scalar; here a scalar
    is a cached prefix (its tag) and 4 bytes. ``value_prefixes`` caches the prefixes by name.
    """
    values = b"".join(
        (value_prefixes.get(name) or _value_prefix(name, value_prefixes)) + _float32(value)
        for name, value in scalars.items()
    )
    event = bytearray(b"\x09" + _DOUBLE.pack(wall_time))  # field 1, wall_time: a double
    if step:  # field 2, step: a varint (proto3 leaves out a zero)
        event += b"\x10" + _varint(step & 0xFFFFFFFFFFFFFFFF)
    event += b"\x2a" + _varint(len(values)) + values  # field 5, summary: a message
    return bytes(event)


def _value_prefix(name: str, cache: dict[str, bytes]) -> bytes:
    """Summary field 1 (a Value of ``length`` bytes) with the Value's field 1 (``tag``) and the
    key of its field 2 (``simple_value``, a float): all but the value's 4 bytes."""
    tag = name.encode()
    tag_field = b"\x0a" + _varint(len(tag)) + tag if tag else b""
    cache[name] = b"\x0a" + _varint(len(tag_field) + 5) + tag_field + b"\x15"
    return cache[name]


def _float32(value: float) -> bytes:
    try:
        return _FLOAT.pack(value)
    except OverflowError:  # beyond float32's range: infinite, as protobuf stores it
        return _FLOAT.pack(math.copysign(math.inf, value))


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _create_new(folder: Path, stem: str) -> tuple[Path, IO[bytes]]:
    """Open a file named ``stem`` (or ``stem.1``, ...) that did not exist before."""
    for attempt in range(1000):
        path = folder / (stem if attempt == 0 else f"{stem}.{attempt}")
        try:
            return path, open(path, "xb")
        except FileExistsError:
            continue
    raise FileExistsError(f"no free event file name for {folder / stem}")


@dataclass
class TensorBoardCallback(_SaveFolderOutput, name="tensorboard"):
    """Writes every logged metric as a scalar at its step into ``{folder}/{subdir}`` (rank 0).

    The folder is the save folder when it is local, so the event files stay with the run;
    for a remote save folder it is ``work_dir``, and the event files are copied to the save
    folder at checkpoints and when training ends (TensorBoard reads ``gs://`` and ``s3://``).
    A resumed run adds a new event file; TensorBoard shows the re-trained steps' newest points.
    Events are flushed to the file once per ``metrics_collect_interval``, at checkpoints and at
    the end.
    """

    subdir: str = "tensorboard"
    """Folder of the event files, relative to the save folder."""
    enabled: bool = True
    """``False`` turns the callback off while keeping it in the config (an override can turn it back
    on)."""

    _writer: _EventFile | None = field(default=None, init=False, repr=False)

    priority = -1  # after evaluators and other producers of a step's metrics

    def validate(self) -> None:
        parts = Path(self.subdir).parts
        if not self.subdir or Path(self.subdir).is_absolute() or ".." in parts:
            raise ConfigurationError(
                f"must be a relative folder inside the save folder such as 'tensorboard', "
                f"got {self.subdir!r}",
                path="subdir",
            )

    def post_attach(self) -> None:
        if self.enabled and get_rank() == 0:
            _packages()  # a missing package fails at build time, not mid-run

    @property
    def log_dir(self) -> Path:
        """The local folder the event files are written to."""
        return self._local_path()

    def _output_name(self) -> str:
        return self.subdir

    def _flush(self) -> bool:
        if self._writer is not None:
            self._writer.flush()
        return self._writer is not None

    def pre_train(self) -> None:
        if not self.enabled or get_rank() != 0:
            return
        self._writer = _EventFile(self.log_dir, _packages())

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if self._writer is None:
            return
        self._writer.add_scalars(step, metrics)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
