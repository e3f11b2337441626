"""Reading a DCP checkpoint never runs code from it.

DCP unpickles two things with plain ``pickle``: the ``.metadata`` file
(``FileSystemReader.read_metadata``) and every non-tensor value
(``DefaultLoadPlanner.load_bytes``, with ``weights_only=False``). A crafted file runs any
code it likes there, and can then return real metadata so that the load goes on as if
nothing happened. (Tensors are safe already: DCP reads them with ``weights_only=True``.)

Every DCP read of olmolike goes through this module instead:

* :func:`unpickle_metadata` reads ``.metadata`` with an unpickler that admits only the classes
  DCP metadata is made of (found in torch's ``metadata.py`` and ``filesystem.py`` and in real
  saves of torch, older torch and OLMo-core) and refuses anything else, naming it, before
  it is imported or called;
* :class:`WeightsOnlyLoadPlanner` is DCP's load planner with non-tensor values read by
  ``torch.load(weights_only=True)`` (numbers, strings, tuples and the like: all an optimizer's
  ``param_groups`` hold).
* :func:`stored_tensor` reads the header of a tensor's record (its ``data.pkl``) for the
  readers that read the tensor's bytes straight into place: an unpickler that calls nothing
  of torch's and admits only the names a plain tensor's header holds.

The readers of :mod:`.checkpoint_loading` use the first and accept no other planner than the
second, so a load cannot take the unsafe path by accident.
"""

from __future__ import annotations

import collections
import io as io_
import math
import pathlib
import pickle
from dataclasses import dataclass
from typing import IO, Any

import torch
import torch.distributed._shard.sharded_tensor.metadata as old_metadata
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import ReadItem

from ..exceptions import CheckpointError

__all__ = ["StoredTensor", "WeightsOnlyLoadPlanner", "stored_tensor", "unpickle_metadata"]


def _metadata_classes() -> dict[tuple[str, str], Any]:
    """``(module, name)`` as a pickle names it, to the object it may stand for."""
    admitted: dict[tuple[str, str], Any] = {
        ("torch", "Size"): torch.Size,
        # torch.layout pickles as a call of this lookup by name (see torch/serialization.py).
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
        # FileSystemWriter records the checkpoint's path; Python 3.13 moved the class.
        ("pathlib", "PosixPath"): pathlib.PosixPath,
        ("pathlib._local", "PosixPath"): pathlib.PosixPath,
        ("collections", "OrderedDict"): collections.OrderedDict,
        # The one place of each item in the shard files (torch's FileSystemWriter).
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
        # OLMo-core's writer pickles its own copy of it (without transform_descriptors, which
        # torch's class defaults to None): read as torch's, so OLMo-core need not be installed.
        ("olmo_core.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
        # Older torch releases pickled TensorProperties from the sharded-tensor module.
        **{
            (old_metadata.__name__, name): getattr(old_metadata, name)
            for name in ("TensorProperties", "MEM_FORMAT_ENCODING")
        },
    }
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    ):
        admitted[(dcp_metadata.__name__, name)] = getattr(dcp_metadata, name)
    for name, value in vars(torch).items():  # dtypes, layouts, memory formats: constants
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            admitted[("torch", name)] = value
    # Plain values that pickle names as a class (sets before protocol 4, for one); harmless.
    for kind in (set, frozenset, bytearray, complex):
        admitted[("builtins", kind.__name__)] = kind
    return admitted


_ADMITTED = _metadata_classes()


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the names in :data:`_ADMITTED` (pickle's own way to
    restrict what a file may construct or call: every global goes through ``find_class``)."""

    def __init__(self, file: IO[bytes], source: str) -> None:
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ADMITTED[(module, name)]
        except KeyError:
            raise CheckpointError(
                f"refusing to unpickle {module}.{name} from {self._source}: DCP metadata is "
                "made of DCP's own classes only, and loading anything else could run code. "
                "Do not load this checkpoint unless you know who wrote it and why"
            ) from None


def unpickle_metadata(file: IO[bytes], source: str) -> dcp_metadata.Metadata:
    """DCP's ``Metadata`` unpickled from ``file`` (read from ``source``, named in errors).

    :raises CheckpointError: if the file names anything but what DCP metadata is made of (it is
        never imported or called), or holds something other than ``Metadata``.
    """
    metadata = _MetadataUnpickler(file, source).load()
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointError(
            f"{source} holds a {type(metadata).__name__}, not DCP metadata; is it a checkpoint?"
        )
    return metadata


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, with non-tensor values unpickled by ``weights_only=True``.

    Takes the arguments of ``DefaultLoadPlanner``; values land in the state dict given to
    ``dcp.load``, nested (``flatten_state_dict=True``) or flat (keyed as saved).
    """

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        key = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True, map_location="cpu")
        except pickle.UnpicklingError as e:
            raise CheckpointError(
                f"refusing to load checkpoint value {key!r}: it is not plain data "
                f"({_reason(e)}), and loading it could run code"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[key], loaded)
        else:
            # Not into self.state_dict as DCP's does: that is a copy (see _flatten_sharded_tensors).
            self.original_state_dict[key] = loaded


def _reason(error: pickle.UnpicklingError) -> str:
    """The line of torch's weights-only error that names what was refused."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return next((line for line in lines if "GLOBAL" in line), lines[0] if lines else "")


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """A plain tensor as its ``torch.save`` header describes it: its bytes are the archive's
    record ``data/{key}``, ``numel`` elements of ``dtype``, viewed from ``offset`` with
    ``size`` and ``stride``."""

    key: str
    """The archive record holding the tensor's storage (``data/{key}``)."""
    dtype: torch.dtype
    """The element dtype of the storage."""
    numel: int
    """Elements in the storage."""
    offset: int
    """Where the tensor starts in its storage, in elements."""
    size: tuple[int, ...]
    """The tensor's shape."""
    stride: tuple[int, ...]
    """The tensor's strides, in elements."""

    @property
    def contiguous_whole(self) -> bool:
        """Whether the tensor is all of its bytes, in row-major order (as DCP saves one)."""
        strides, step = [], 1
        for length in reversed(self.size):
            strides.append(step)
            step *= length
        return (self.offset, self.numel, self.stride) == (
            0,
            math.prod(self.size),
            tuple(reversed(strides)),
        )


class _NotPlain(pickle.UnpicklingError):
    """The header names something a plain tensor's header does not."""


def _storage_dtypes() -> dict[tuple[str, str], torch.dtype]:
    """The typed storage classes a header names (``torch.FloatStorage``), to their dtypes:
    the plain ones only (not quantized)."""
    plain = {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}
    return {
        ("torch", name): dtype
        for dtype, name in torch.storage._dtype_to_storage_type_map().items()
        if dtype.is_floating_point or dtype.is_complex or dtype in plain
    }


_STORAGE_DTYPES = _storage_dtypes()


@dataclass(frozen=True, slots=True)
class _StorageReference:
    dtype: torch.dtype
    key: str
    numel: int


def _plain_tensor(
    storage: Any,
    offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any,
    hooks: Any,
    metadata: Any = None,
) -> StoredTensor:
    """Stands for ``torch._utils._rebuild_tensor_v2``: what it would build, described."""
    if not (
        isinstance(storage, _StorageReference)
        and type(offset) is int
        and _int_tuple(size)
        and _int_tuple(stride)
        and type(requires_grad) is bool
        and isinstance(hooks, collections.OrderedDict)
        and not hooks
        and not metadata  # conj or neg bits
    ):
        raise _NotPlain("not a plain tensor")
    return StoredTensor(storage.key, storage.dtype, storage.numel, offset, size, stride)


def _int_tuple(value: Any) -> bool:
    return type(value) is tuple and all(type(n) is int and n >= 0 for n in value)


class _TensorHeaderUnpickler(pickle.Unpickler):
    """Unpickles a tensor's header into a :class:`StoredTensor`; every global it may name
    goes through ``find_class``, which resolves only harmless stand-ins."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _plain_tensor
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if (module, name) in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[(module, name)]
        raise _NotPlain(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> _StorageReference:
        match pid:
            case ("storage", torch.dtype() as dtype, str(key), str(), int(numel)) if numel >= 0:
                return _StorageReference(dtype, key, numel)
        raise _NotPlain("not a typed storage")


def stored_tensor(header: bytes) -> StoredTensor | None:
    """The plain tensor that ``header`` (a ``torch.save`` archive's ``data.pkl``) describes,
    or ``None`` for anything else (a tensor subclass, a quantized tensor, a value, damaged
    bytes): the caller then loads it the general way, with ``torch.load``."""
    try:
        found = _TensorHeaderUnpickler(io_.BytesIO(header)).load()
    except Exception:  # whatever the bytes do, they are not a plain tensor's header
        return None
    return found if isinstance(found, StoredTensor) else None
