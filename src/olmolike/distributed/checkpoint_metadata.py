"""DCP's ``.metadata``, read as data: the classes it may name, and the checks that make what it
says safe to act on.

:func:`unpickle_metadata` runs :mod:`.checkpoint_unpickle`'s policed unpickler with the names
DCP metadata is made of (found in torch's ``metadata.py`` and ``filesystem.py`` and in real
saves of torch, older torch and OLMo-core), then builds DCP's ``Metadata`` anew from the
records it made, every field's type checked (:class:`_Builder`), and checks what the readers
rely on (:func:`_check_layout`):

* each mutable object (a record, list or dict) is used once: no cycles, and no list of a
  million references to one chunk (counts are bounded by the bytes of the file);
* every shard named is a plain file name inside the checkpoint (:func:`check_shard_name`);
* every tensor is tiled by its chunks, each inside the tensor, and each chunk's record holds
  at least its bytes; the records of a file do not overlap. So a tensor's size is bounded by
  the bytes of the shard files its records are in, which the readers check against the
  files' lengths (:func:`~.checkpoint_format.shard_files_problem`) before allocating it.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import pathlib
from collections.abc import Mapping
from typing import IO, Any

import torch
import torch.distributed._shard.sharded_tensor.metadata as old_metadata
from torch.distributed.checkpoint import metadata as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo

from ..exceptions import CheckpointError
from .checkpoint_archive import TENSOR_DTYPES
from .checkpoint_unpickle import PATH_NAMES, PLAIN_NAMES, DataClass, Factory, Fields, unpickle

__all__ = ["check_shard_name", "unpickle_metadata"]

_MAX_DEPTH = 32
"""How deeply ``planner_data`` may nest (DCP's default planner: a tuple in a dict)."""
_MAX_DIMS = 64
"""The most dimensions a tensor may have (torch's own limit for most kernels)."""


def _data_class(cls: type, positional: bool = False) -> DataClass:
    return DataClass(cls, tuple(f.name for f in dataclasses.fields(cls)), positional)


_MEMORY_FORMATS = (torch.contiguous_format, torch.channels_last, torch.preserve_format)


def _memory_format(arguments: tuple[Any, ...], unpickler: Any) -> torch.memory_format:
    """``_MEM_FORMAT_ENCODING(n)``, which TensorProperties pickles instead of a memory format."""
    if len(arguments) != 1 or type(arguments[0]) is not int or arguments[0] not in (0, 1, 2):
        raise unpickler.refuse("names a memory format DCP does not encode")
    return _MEMORY_FORMATS[arguments[0]]


def _names() -> dict[tuple[str, str], Any]:
    properties = _data_class(dcp.TensorProperties, positional=True)  # its __getstate__ is a tuple
    storage_info = _data_class(_StorageInfo)
    names: dict[tuple[str, str], Any] = {
        **PLAIN_NAMES,
        **PATH_NAMES,
        (dcp.__name__, "TensorProperties"): properties,
        # Older torch releases pickled TensorProperties from the sharded-tensor module.
        (old_metadata.__name__, "TensorProperties"): properties,
        (dcp.__name__, "_MEM_FORMAT_ENCODING"): Factory("_MEM_FORMAT_ENCODING", _memory_format),
        (old_metadata.__name__, "MEM_FORMAT_ENCODING"): Factory("MEM_FORMAT", _memory_format),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): storage_info,
        # OLMo-core's writer pickles its own copy of it (without transform_descriptors, which
        # torch's class defaults to None): read as torch's, so OLMo-core need not be installed.
        ("olmo_core.distributed.checkpoint.filesystem", "_StorageInfo"): storage_info,
    }
    for cls in (
        dcp.Metadata,
        dcp.MetadataIndex,
        dcp.StorageMeta,
        dcp.TensorStorageMetadata,
        dcp.BytesStorageMetadata,
        dcp.ChunkStorageMetadata,
    ):
        names[(dcp.__name__, cls.__name__)] = _data_class(cls)
    return names


_NAMES = _names()


def unpickle_metadata(file: IO[bytes], source: str) -> dcp.Metadata:
    """DCP's ``Metadata`` read from ``file`` (read from ``source``, named in errors): new
    objects, every field checked, nothing of the file's run or set on anything else.

    :raises CheckpointError: if the file names anything DCP metadata is not made of (it is
        never imported or called), acts on anything but its own new records, is not DCP
        metadata, or names a shard outside the checkpoint or sizes beyond its records.
    """
    data = file.read()
    found = unpickle(data, source, _NAMES)
    if type(found) is not Fields or found.kind.cls is not dcp.Metadata:
        kind = found.kind.cls.__name__ if type(found) is Fields else type(found).__name__
        raise CheckpointError(f"{source} holds a {kind}, not DCP metadata; is it a checkpoint?")
    metadata = _Builder(source, len(data)).metadata(found)
    _check_layout(metadata, source)
    return metadata


def check_shard_name(name: Any, source: str) -> str:
    """``name`` if it is a plain file name (a shard inside the checkpoint's directory)."""
    if (
        type(name) is not str
        or name in ("", ".", "..")
        or len(name) > 255
        or any(c in name for c in "/\\?#\x00")
        or not name.isprintable()
    ):
        raise CheckpointError(
            f"{source} names a shard file {str(name)[:80]!r}, which is not a plain file name "
            "inside the checkpoint: refusing to read outside it. The checkpoint was crafted or "
            "damaged; load another one"
        )
    return name


def _defaults(cls: type) -> tuple[tuple[str, Any, Any], ...]:
    """``(name, default, default_factory)`` of each field of the data class ``cls``."""
    return tuple((f.name, f.default, f.default_factory) for f in dataclasses.fields(cls))


_DEFAULTS: dict[type, tuple[tuple[str, Any, Any], ...]] = {
    cls: _defaults(cls)
    for cls in (
        dcp.Metadata,
        dcp.MetadataIndex,
        dcp.StorageMeta,
        dcp.TensorStorageMetadata,
        dcp.BytesStorageMetadata,
        dcp.ChunkStorageMetadata,
        dcp.TensorProperties,
        _StorageInfo,
    )
}
_NONE = type(None)


class _Builder:
    """Builds DCP's metadata objects from the unpickler's records, checking every field."""

    def __init__(self, source: str, size: int) -> None:
        self.source, self.allowance = source, 2 * size + 4096
        self.seen: dict[int, Any] = {}  # (the objects kept alive, so that ids stay unique)

    def copies(self, value: Any) -> Any:
        """``value`` (a tuple or list that may be memoized, so shared), charged: what is built
        holds no more values than the file holds bytes."""
        self.allowance -= len(value)
        if self.allowance < 0:
            raise self.wrong("it repeats one sequence more often than it holds bytes")
        return value

    def wrong(self, what: str) -> CheckpointError:
        return CheckpointError(
            f"{self.source} is not DCP metadata as torch writes it: {what}. It was crafted or "
            "damaged; load another checkpoint"
        )

    def once(self, value: Any) -> None:
        if id(value) in self.seen:
            raise self.wrong(f"a {type(value).__name__} is used twice (or contains itself)")
        self.seen[id(value)] = value

    def fields(self, value: Any, cls: type) -> dict[str, Any]:
        """The fields of the record ``value`` of ``cls``, defaults filled in."""
        if type(value) is not Fields or value.kind.cls is not cls:
            raise self.wrong(f"a {_name(value)} where a {cls.__name__} belongs")
        self.once(value)
        found = value.values
        if len(found) == len(_DEFAULTS[cls]):
            return found
        found = dict(found)
        for name, default, factory in _DEFAULTS[cls]:
            if name in found:
                continue
            if default is not dataclasses.MISSING:
                found[name] = default
            elif factory is not dataclasses.MISSING:
                found[name] = factory()
            else:
                raise self.wrong(f"a {cls.__name__} lacks its {name}")
        return found

    def of(self, value: Any, *kinds: type, what: str) -> Any:
        if type(value) not in kinds:
            raise self.wrong(f"{what} is a {_name(value)}")
        return value

    def collection(self, value: Any, kind: type, what: str) -> Any:
        self.of(value, kind, what=what)
        self.once(value)
        return value

    def metadata(self, record: Fields) -> dcp.Metadata:
        f = self.fields(record, dcp.Metadata)
        items = self.collection(f["state_dict_metadata"], dict, what="state_dict_metadata")
        storage = self.of(f["storage_data"], dict, what="storage_data")
        meta = f["storage_meta"]
        return dcp.Metadata(
            state_dict_metadata={
                self.of(k, str, what="a key"): self.item(v, k) for k, v in items.items()
            },
            planner_data=self.plain(f["planner_data"], 0),
            storage_data=self.storage_data(storage),
            storage_meta=None if meta is None else self.storage_meta(meta),
            version=self.of(f["version"], str, _NONE, what="version"),
        )

    def item(self, value: Any, key: str) -> dcp.STORAGE_TYPES:
        if type(value) is Fields and value.kind.cls is dcp.BytesStorageMetadata:
            self.fields(value, dcp.BytesStorageMetadata)
            return dcp.BytesStorageMetadata()
        f = self.fields(value, dcp.TensorStorageMetadata)
        size = self.lengths(f["size"], f"the size of {key}")
        chunks = self.collection(f["chunks"], list, what=f"the chunks of {key}")
        return dcp.TensorStorageMetadata(
            properties=self.properties(f["properties"], key),
            size=size,
            chunks=[self.chunk(chunk, key, len(size)) for chunk in chunks],
        )

    def lengths(self, value: Any, what: str, ndim: int | None = None) -> torch.Size:
        size = self.of(value, torch.Size, what=what)
        if len(size) > _MAX_DIMS:
            raise self.wrong(f"{what} has {len(size)} dimensions")
        if ndim is not None and len(size) != ndim:
            raise self.wrong(f"{what} has {len(size)} dimensions, not {ndim}")
        return size

    def chunk(self, value: Any, key: str, ndim: int) -> dcp.ChunkStorageMetadata:
        f = self.fields(value, dcp.ChunkStorageMetadata)
        what = f"a chunk of {key}"
        return dcp.ChunkStorageMetadata(
            offsets=self.lengths(f["offsets"], f"{what}'s offsets", ndim),
            sizes=self.lengths(f["sizes"], f"{what}'s sizes", ndim),
        )

    def properties(self, value: Any, key: str) -> dcp.TensorProperties:
        f = self.fields(value, dcp.TensorProperties)
        what = f"a property of {key}"
        dtype = self.of(f["dtype"], torch.dtype, what=what)
        if dtype not in TENSOR_DTYPES:  # (quantized, bit-packed: no reader makes such tensors)
            raise self.wrong(f"{key} is a tensor of {dtype}, which a checkpoint does not hold")
        return dcp.TensorProperties(
            dtype=dtype,
            layout=self.of(f["layout"], torch.layout, what=what),
            requires_grad=self.of(f["requires_grad"], bool, what=what),
            memory_format=self.of(f["memory_format"], torch.memory_format, what=what),
            pin_memory=self.of(f["pin_memory"], bool, what=what),
        )

    def storage_data(self, value: dict[Any, Any]) -> dict[dcp.MetadataIndex, _StorageInfo]:
        self.once(value)
        built = {self.index(k): self.storage_info(v) for k, v in value.items()}
        if len(built) != len(value):
            raise self.wrong("two records stand for the same chunk")
        return built

    def index(self, value: Any) -> dcp.MetadataIndex:
        f = self.fields(value, dcp.MetadataIndex)
        offset = f["offset"]
        return dcp.MetadataIndex(
            fqn=self.of(f["fqn"], str, what="a record's key"),
            offset=None if offset is None else self.lengths(offset, "a record's offsets"),
            index=self.of(f["index"], int, _NONE, what="a record's index"),
        )

    def storage_info(self, value: Any) -> _StorageInfo:
        f = self.fields(value, _StorageInfo)
        transforms = f["transform_descriptors"]
        if transforms is not None:
            if type(self.of(transforms, list, tuple, what="transform_descriptors")) is list:
                self.once(transforms)
            transforms = [self.of(t, str, what="a transform") for t in self.copies(transforms)]
        offset = self.of(f["offset"], int, what="a record's offset")
        length = self.of(f["length"], int, what="a record's length")
        if offset < 0 or length < 0:
            raise self.wrong("a record starts or ends before its file")
        return _StorageInfo(
            relative_path=check_shard_name(f["relative_path"], self.source),
            offset=offset,
            length=length,
            transform_descriptors=transforms,
        )

    def storage_meta(self, value: Any) -> dcp.StorageMeta:
        f = self.fields(value, dcp.StorageMeta)
        modules = self.collection(f["modules"], list, what="modules")
        checkpoint_id = f["checkpoint_id"]
        if checkpoint_id is not None and not isinstance(checkpoint_id, (str, pathlib.PurePath)):
            raise self.wrong(f"checkpoint_id is a {_name(checkpoint_id)}")
        return dcp.StorageMeta(
            checkpoint_id=checkpoint_id,
            save_id=self.of(f["save_id"], str, _NONE, what="save_id"),
            load_id=self.of(f["load_id"], str, _NONE, what="load_id"),
            modules=[self.of(m, str, what="a module") for m in modules],
        )

    def plain(self, value: Any, depth: int) -> Any:
        """``value`` if it is plain data (DCP's default planner: paths of keys by key)."""
        if depth > _MAX_DEPTH:
            raise self.wrong("planner_data nests too deeply")
        if value is None or type(value) in (bool, int, float, str, bytes, torch.Size):
            return value
        if type(value) in (tuple, list):
            if type(value) is list:
                self.once(value)
            return type(value)(self.plain(v, depth + 1) for v in self.copies(value))
        if type(value) is dict:
            self.once(value)
            return {self.plain(k, depth + 1): self.plain(v, depth + 1) for k, v in value.items()}
        raise self.wrong(f"planner_data holds a {_name(value)}")


def _name(value: Any) -> str:
    return value.kind.cls.__name__ if type(value) is Fields else type(value).__name__


def _check_layout(metadata: dcp.Metadata, source: str) -> None:
    """Raise unless each tensor is tiled by its chunks and each chunk's record holds its bytes,
    and the records of a file do not overlap (see the module's notes)."""

    def wrong(what: str) -> CheckpointError:
        return CheckpointError(
            f"{source} does not describe its shards consistently: {what}. The checkpoint was "
            "crafted or damaged; load another one"
        )

    storage: Mapping[dcp.MetadataIndex, _StorageInfo] = metadata.storage_data
    for key, item in metadata.state_dict_metadata.items():
        if isinstance(item, dcp.BytesStorageMetadata):
            if dcp.MetadataIndex(key) not in storage:
                raise wrong(f"the value {key} has no record")
            continue
        volume = 0
        for chunk in item.chunks:
            ends = [o + s for o, s in zip(chunk.offsets, chunk.sizes, strict=True)]
            if any(end > size for end, size in zip(ends, item.size, strict=True)):
                raise wrong(f"a chunk of {key} lies outside its size {list(item.size)}")
            info = storage.get(dcp.MetadataIndex(key, chunk.offsets))
            if info is None:
                raise wrong(f"the chunk of {key} at {list(chunk.offsets)} has no record")
            chunk_bytes = math.prod(chunk.sizes) * item.properties.dtype.itemsize
            if chunk_bytes > info.length:
                raise wrong(
                    f"the chunk of {key} at {list(chunk.offsets)} is larger than its record"
                )
            volume += math.prod(chunk.sizes)
        if volume != math.prod(item.size):
            raise wrong(f"the chunks of {key} do not tile its size {list(item.size)}")
    per_file: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)
    for info in storage.values():
        per_file[info.relative_path].append((info.offset, info.offset + info.length))
    for name, spans in per_file.items():
        spans.sort()
        for (_, end), (start, _) in itertools.pairwise(spans):
            if start < end:
                raise wrong(f"two records overlap in {name}")
