"""Reading DCP checkpoints with several threads, checking every record, never running code.

torch's readers read one item after another, each tensor into a new tensor that is then
copied into its destination; the readers here split a load plan into byte-balanced parts
read by a thread pool (each part opens its own file handles), also for a checkpoint written
as a single file, read a saved tensor straight into its destination where it fits as it is,
check every record's CRC-32 before or as they interpret it (:mod:`.checkpoint_archive`), and
never run code from the checkpoint nor let it change anything in the process
(:mod:`.checkpoint_unpickle`, :mod:`.checkpoint_metadata`): ``torch.load`` is not called.
"""

from __future__ import annotations

import dataclasses
import errno
import io as io_
import os
import stat
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any, cast

import torch
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from .. import io
from ..exceptions import CheckpointError, DamagedCheckpointError
from .checkpoint_archive import Archive, StoredTensor
from .checkpoint_metadata import unpickle_metadata
from .checkpoint_records import Window
from .checkpoint_save import default_thread_count

__all__ = [
    "ParallelFileSystemReader",
    "ParallelFsspecReader",
    "WeightsOnlyLoadPlanner",
    "checkpoint_error_of",
    "dcp_reader",
    "open_regular_file",
]


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, given non-tensor values decoded as plain data by
    :class:`~.checkpoint_archive.Archive` (numbers, strings, tuples and the like: all an
    optimizer's ``param_groups`` hold), never unpickled by ``torch.load``.

    Takes the arguments of ``DefaultLoadPlanner``; values land in the state dict given to
    ``dcp.load``, nested (``flatten_state_dict=True``) or flat (keyed as saved).
    """

    def load_bytes(self, read_item: ReadItem, value: io_.BytesIO) -> None:
        where = f"checkpoint value {read_item.dest_index.fqn!r}"
        self.load_value(read_item, Archive(value, where).value())

    def load_value(self, read_item: ReadItem, loaded: Any) -> None:
        """Put the decoded value of ``read_item`` in its place."""
        key = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[key], loaded)
        else:
            # Not into self.state_dict as DCP's does: that is a copy (see _flatten_sharded_tensors).
            self.original_state_dict[key] = loaded


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


def _where(sinfo: Any, item: ReadItem | None = None) -> str:
    start, length = int(sinfo.offset), int(sinfo.length)
    what = "" if item is None else f" of {item.storage_index.fqn!r}"
    return f"{sinfo.relative_path} (the record{what} at bytes {start}-{start + length})"


def _read_item(file: IO[bytes], sinfo: Any, item: ReadItem, planner: LoadPlanner) -> None:
    """Read ``item`` from its record in ``file`` (a window of the record's bytes) into its
    destination: a value through the planner, a tensor straight into place where it fits as
    it is (see :func:`_destination`), else into a new tensor first (torch's way).

    Every record of the archive is checked against its CRC-32 before it is interpreted, or as
    it is read (:class:`~.checkpoint_archive.Archive`): damage is
    :class:`DamagedCheckpointError`, whichever record it is in.
    """
    archive = Archive(file, _where(sinfo, item))
    if item.type == LoadItemType.BYTE_IO:
        cast(WeightsOnlyLoadPlanner, planner).load_value(item, archive.value())
        return
    stored = archive.header()
    target = _destination(planner, item, stored)
    if target is not None:
        archive.read_into(stored, target)
        torch.autograd.graph.increment_version(target)  # written in place, as copy_ would count it
    else:
        loaded = archive.tensor(stored)
        target = planner.resolve_tensor(item).detach()
        offsets, lengths = item.storage_offsets, item.lengths
        if len(offsets) != loaded.dim() or any(
            o + n > size for o, n, size in zip(offsets, lengths, loaded.shape, strict=True)
        ):
            raise CheckpointError(
                f"{archive.where} holds a tensor of shape {list(stored.size)}, which does not "
                "match its chunk in the checkpoint's metadata"
            )
        for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
            loaded = loaded.narrow(dim, offset, length)
        target.copy_(loaded)
    planner.commit_tensor(item, target)


def _destination(planner: LoadPlanner, item: ReadItem, stored: StoredTensor) -> Tensor | None:
    """Where ``item`` loads to, if the bytes of ``stored`` can be read into it as they are."""
    if any(item.storage_offsets) or tuple(item.lengths) != stored.size:
        return None
    if not stored.contiguous_whole:
        return None
    target = planner.resolve_tensor(item).detach()
    plain = type(target) is Tensor and target.layout == torch.strided
    if (
        plain
        and target.device.type == "cpu"
        and target.dtype == stored.dtype
        and target.shape == stored.size
        and target.is_contiguous()
        and not (target.is_conj() or target.is_neg())
    ):
        return target
    return None


class _CheckedRecords(FileSystemReader):
    """Reads each item of a plan from its record (:func:`_read_item`): each shard file opened
    once per part of the plan, its records read in the order of their bytes.

    In place, a 773 MB load of a model and its AdamW state takes ~0.4 s of CPU time on the
    2-core test box, against ~1.5 s torch's way (plus ``torch.load``'s ~0.3 GB of new
    tensors). Every byte is read once, and checked against its record's CRC-32 as it is
    read. A remote record (``read_once``) is read into memory whole, in one request.
    """

    read_once = False

    def _read_checked(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            name = self.storage_data[item.storage_index].relative_path
            per_file.setdefault(name, []).append(item)
        for relative_path, items in per_file.items():
            with self._shard(relative_path) as file:
                for item in sorted(items, key=lambda i: self.storage_data[i.storage_index].offset):
                    sinfo = self.storage_data[item.storage_index]
                    if sinfo.transform_descriptors:
                        raise CheckpointError(
                            f"{_where(sinfo)} was written through storage transforms "
                            f"({', '.join(sinfo.transform_descriptors)[:100]}), which "
                            "olmolike's readers do not read: save it without them"
                        )
                    _read_item(self._window(file, sinfo), sinfo, item, planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _window(self, file: Any, sinfo: Any) -> IO[bytes]:
        start, length = int(sinfo.offset), int(sinfo.length)
        if not self.read_once:
            return cast(IO[bytes], Window(file, start, length))
        file.seek(start)
        return io_.BytesIO(file.read(length))  # at most what the file holds

    def _shard(self, name: str) -> IO[bytes]:
        """The shard file ``name``, opened; a missing one is damage (one line, not DCP's
        traceback of a FileNotFoundError)."""
        try:
            return self._open(name)
        except FileNotFoundError:
            raise DamagedCheckpointError(
                f"shard {name} of {self.path} is missing: the checkpoint is incomplete"
            ) from None

    def _open(self, name: str) -> IO[bytes]:
        """The checkpoint's file ``name`` (a plain name: see
        :func:`~.checkpoint_metadata.check_shard_name`), opened for reading; a local one
        only if it is a regular file, not a symbolic link (which could lead outside)."""
        path = self.fs.concat_path(self.path, name)
        if self.read_once:
            return cast(IO[bytes], self.fs.create_stream(path, "rb"))
        return open_regular_file(str(path))


def open_regular_file(path: str) -> IO[bytes]:
    """The local file ``path``, opened for reading, if it is a regular file (not a symbolic
    link, which could lead outside the checkpoint, nor a pipe or device).

    :raises CheckpointError: if it is not.
    """
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK  # a pipe must not block the open
    try:
        descriptor = os.open(path, flags)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        descriptor = -1
    if descriptor < 0 or not stat.S_ISREG(os.fstat(descriptor).st_mode):
        if descriptor >= 0:
            os.close(descriptor)
        raise CheckpointError(
            f"{path} is a symbolic link or not a regular file: a checkpoint's files are "
            "read only where they are, inside it. Copy the file it stands for in its place"
        )
    return os.fdopen(descriptor, "rb")


class _SafeParallelReading(_CheckedRecords):
    """What olmolike's readers add to torch's: ``.metadata`` read by the policed unpickler
    and checked (:func:`~.checkpoint_metadata.unpickle_metadata`), only
    :class:`WeightsOnlyLoadPlanner` accepted (so that no value reaches ``torch.load``), every
    record checked against its CRC-32 (:class:`_CheckedRecords`), a plan's items read with
    several threads."""

    thread_count: int

    known_metadata: Metadata | None = None
    """The checkpoint's metadata, when it was read already (by a check before the load)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # torch's FileSystemReader.read_metadata, with pickle.load made safe.
        path = self._get_metadata_path(kwargs.get("rank"))
        metadata = self.known_metadata
        if metadata is None or kwargs.get("rank") is not None:
            with self._open(os.path.basename(path)) as file:
                metadata = unpickle_metadata(file, str(path))
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if not isinstance(planner, WeightsOnlyLoadPlanner):
            raise TypeError(
                f"olmolike's checkpoint readers load with WeightsOnlyLoadPlanner, not "
                f"{type(planner).__name__}: the default unpickles values with torch.load"
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


def dcp_reader(
    dir: str | Path, thread_count: int | None = None, metadata: Metadata | None = None
) -> FileSystemReader:
    """A DCP storage reader for the DCP directory ``dir``, local or remote; given ``metadata``
    (the directory's, read already), it does not read ``.metadata`` again."""
    reader: _SafeParallelReading
    if io.is_url(dir):
        # Reading needs no rename, so DCP's fsspec reader works on object stores as they are.
        reader = ParallelFsspecReader(str(dir), thread_count)
    else:
        reader = ParallelFileSystemReader(str(io.local_path(dir)), thread_count)
    reader.known_metadata = metadata
    return reader


def checkpoint_error_of(error: BaseException) -> CheckpointError | None:
    """The error of olmolike's readers behind DCP's ``error`` (the lowest failed rank's, which
    every rank finds alike), as its own class and message, if it is one of theirs: so that a
    load says one line (DCP's exception carries every rank's traceback), and a damaged
    checkpoint stays a :class:`~olmolike.exceptions.DamagedCheckpointError`."""
    if isinstance(error, CheckpointError):
        return error
    if not isinstance(error, CheckpointException) or not error.failures:
        return None
    failure = error.failures[min(error.failures)]
    cause = failure[0] if isinstance(failure, tuple) else failure
    if isinstance(cause, CheckpointError):
        return type(cause)(str(cause))
    if isinstance(cause, AssertionError) and "metadata read failed: " in str(cause):
        # dcp.load reads .metadata in its planning step, and words what it raised.
        reason = str(cause).split("metadata read failed: ", 1)[1].split("; rank local", 1)[0]
        return CheckpointError(reason)
    return None
