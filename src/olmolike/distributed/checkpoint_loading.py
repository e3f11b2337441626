"""Reading DCP checkpoints with several threads, checking every record, never running code.

torch's readers read one item after another, each tensor into a new tensor that is then
copied into its destination; the readers here split a load plan into byte-balanced parts
read by a thread pool (each part opens its own file handles), also for a checkpoint written
as a single file, read a saved tensor straight into its destination where it fits as it is,
check every record's CRC-32 as they read it (:mod:`.checkpoint_records`), and never run code
from the checkpoint (:mod:`.checkpoint_unpickle`).
"""

from __future__ import annotations

import dataclasses
import io as io_
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any, cast

import torch
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from .. import io
from ..exceptions import DamagedCheckpointError
from .checkpoint_records import (
    CHUNK,
    CheckingWindow,
    Record,
    Window,
    archive_problem,
    first_problem,
    parse_archive,
)
from .checkpoint_save import default_thread_count
from .checkpoint_unpickle import (
    StoredTensor,
    WeightsOnlyLoadPlanner,
    stored_tensor,
    unpickle_metadata,
)

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


def _where(sinfo: Any) -> str:
    start, length = int(sinfo.offset), int(sinfo.length)
    return f"{sinfo.relative_path} (its record at bytes {start}-{start + length})"


def _read_into_destination(
    file: IO[bytes], sinfo: Any, item: ReadItem, planner: LoadPlanner
) -> bool:
    """Read the tensor of ``item`` from its record in ``file`` straight into its destination,
    checking every record of the archive; ``False`` (nothing written) unless the record holds
    a plain tensor whose bytes are the whole destination, as they are.

    torch's way is ``torch.load`` on the record (a new tensor: its memory allocated and
    faulted in, the bytes copied into it) and then a copy into the destination: this reads
    each byte once, into place. What decides it is read, never assumed: the tensor's header
    (by :func:`.checkpoint_unpickle.stored_tensor`, which runs no code), the byte order, and
    the destination's dtype, shape and layout; anything else (a part of a saved tensor, a
    cast, a non-contiguous destination) is left to torch's way.
    """
    window = cast(IO[bytes], Window(file, int(sinfo.offset), int(sinfo.length)))
    records = parse_archive(window)
    if isinstance(records, str):
        _raise_if(_where(sinfo), records)
    named = {record.name.partition("/")[2]: record for record in cast(list[Record], records)}
    header, byteorder = named.get("data.pkl"), named.get("byteorder")
    if header is None or byteorder is None or byteorder.read(window) != _BYTEORDER:
        return False
    stored = stored_tensor(header.read(window))
    data = None if stored is None else named.get(f"data/{stored.key}")
    if stored is None or data is None or data.size != stored.numel * stored.dtype.itemsize:
        return False
    target = _destination(planner, item, stored)
    if target is None:
        return False
    _raise_if(_where(sinfo), first_problem([r for r in named.values() if r is not data], window))
    if target.numel():
        data.read_into(window, target.reshape(-1).view(torch.uint8).numpy().data)
    _raise_if(_where(sinfo), data.problem(window))
    torch.autograd.graph.increment_version(target)  # written in place, as copy_ would count it
    planner.commit_tensor(item, target)
    return True


_BYTEORDER = sys.byteorder.encode()


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
    """Reads each local tensor into its destination where it fits as it is
    (:func:`_read_into_destination`), and checks each record (:func:`archive_problem`) as it
    is read, also those that torch loads.

    In place, a 773 MB load of a model and its AdamW state takes ~0.4 s of CPU time on the
    2-core test box, against ~1.5 s torch's way (plus ``torch.load``'s ~0.3 GB of new
    tensors). A record torch loads is checked from the bytes torch reads to load it
    (:class:`CheckingWindow`), once ``torch.load`` is done with it: when the same thread
    starts on its next record, or has read its part of the plan (:meth:`_read_checked`): one
    read of each byte, not two. Records under 1 MB (pickled values, small tensors) are checked
    before torch reads them, and a remote one (``read_once``) is read into memory once,
    checked there and loaded from there.
    """

    read_once = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._being_read = threading.local()

    def _slice_file(self, file: Any, sinfo: Any) -> IO[bytes]:
        self._check_last_read()
        if sinfo.transform_descriptors:  # transformed (compressed, say): no archive to check
            return super()._slice_file(file, sinfo)
        start, length, what = int(sinfo.offset), int(sinfo.length), _where(sinfo)
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
        """Reading of ``plan``, every record checked before it returns: into the
        destinations (:func:`_read_into_destination`) where they fit, else torch's way."""
        rest = plan.items if self.read_once else self._read_in_place(plan.items, planner)
        self._being_read.record = None
        done = super().read_data(dataclasses.replace(plan, items=rest), planner)
        self._check_last_read()
        return done

    def _read_in_place(self, items: list[ReadItem], planner: LoadPlanner) -> list[ReadItem]:
        """Read what :func:`_read_into_destination` can of ``items``, each file in the order
        of its bytes; returns the others."""
        rest: list[ReadItem] = []
        per_file: dict[str, list[tuple[int, ReadItem]]] = {}
        for item in items:
            sinfo = self.storage_data[item.storage_index]
            if item.type == LoadItemType.TENSOR and not sinfo.transform_descriptors:
                per_file.setdefault(sinfo.relative_path, []).append((sinfo.offset, item))
            else:
                rest.append(item)
        for relative_path, located in per_file.items():
            with self.fs.create_stream(self.fs.concat_path(self.path, relative_path), "rb") as file:
                for _, item in sorted(located, key=lambda pair: pair[0]):
                    sinfo = self.storage_data[item.storage_index]
                    if not _read_into_destination(cast(IO[bytes], file), sinfo, item, planner):
                        rest.append(item)
        return rest


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
