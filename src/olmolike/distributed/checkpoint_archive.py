"""Decoding ``torch.save`` archives without ``torch.load``: DCP's records and trainer states.

DCP writes every value as a ``torch.save`` archive: a zip of records, ``data.pkl`` (the
pickled value, whose tensors name their storages by key), ``data/{key}`` (each storage's
bytes), ``byteorder``, ``version`` and a few more. ``torch.load(weights_only=True)`` would
admit ``bytearray(n)`` and size each storage from a number in ``data.pkl``, and it checks no
CRC: a flipped bit in ``byteorder`` or ``data.pkl`` became torch's own error, not damage.
:class:`Archive` reads one instead:

* every record but the storages is read and checked against its CRC-32 before anything is
  interpreted, and a storage as it is read: damage anywhere in a record is
  :class:`~olmolike.exceptions.DamagedCheckpointError`, never a decoding error;
* ``data.pkl`` is unpickled by :mod:`.checkpoint_unpickle`'s policed unpickler with the names
  of plain values and of a plain tensor's header only; a tensor is first described
  (:class:`StoredTensor`): its storage record must hold exactly the bytes the header says,
  and its view must lie inside them;
* a storage is read into a new buffer of its record's size (which lies inside the file), or
  straight into a destination (:meth:`Archive.read_into`); the value must be a tree (each
  list, dict and set used once) nested at most 64 deep.
"""

from __future__ import annotations

import collections
import math
import sys
from dataclasses import dataclass
from typing import IO, Any

import torch

from ..exceptions import CheckpointError, DamagedCheckpointError
from .checkpoint_records import Record, first_problem, parse_archive
from .checkpoint_unpickle import PLAIN_NAMES, Factory, unpickle

__all__ = ["TENSOR_DTYPES", "Archive", "StoredTensor"]

_MAX_DEPTH = 64
_BYTEORDER = sys.byteorder.encode()


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """A plain tensor as its ``torch.save`` header describes it: its bytes are the archive's
    record ``data/{key}``, ``numel`` elements of ``dtype``, viewed from ``offset`` with
    ``size`` and ``stride``."""

    key: str
    """The archive record holding the tensor's storage (``data/{key}``)."""
    dtype: torch.dtype
    """The tensor's dtype (its storage's, or the one ``_rebuild_tensor_v3`` names)."""
    numel: int
    """Elements of ``dtype`` in the storage."""
    offset: int
    """Where the tensor starts in its storage, in elements."""
    size: tuple[int, ...]
    """The tensor's shape."""
    stride: tuple[int, ...]
    """The tensor's strides, in elements."""
    requires_grad: bool = False
    """Whether the saved tensor required gradients."""

    @property
    def contiguous_whole(self) -> bool:
        """Whether the tensor is all of its bytes, in row-major order (as DCP saves one)."""
        return (self.offset, self.numel, self.stride) == (
            0,
            math.prod(self.size),
            _row_major(self.size),
        )

    @property
    def nbytes(self) -> int:
        """The bytes of its storage."""
        return self.numel * self.dtype.itemsize


def _row_major(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for length in reversed(size):
        strides.append(step)
        step *= length
    return tuple(reversed(strides))


@dataclass(frozen=True, slots=True)
class _StorageReference:
    dtype: torch.dtype
    key: str
    numel: int


def _tensor_dtypes() -> frozenset[torch.dtype]:
    """The dtypes of plain dense tensors: floating point (float8 included), complex, integers
    of whole bytes and bool; not quantized, not bit-packed (``bits8``), not ``int4``."""
    whole = {torch.bool, torch.uint8, torch.uint16, torch.uint32, torch.uint64}
    whole |= {torch.int8, torch.int16, torch.int32, torch.int64}
    return frozenset(
        dtype
        for dtype in vars(torch).values()
        if isinstance(dtype, torch.dtype)
        and (dtype.is_floating_point or dtype.is_complex or dtype in whole)
    )


TENSOR_DTYPES = _tensor_dtypes()
"""The dtypes a checkpoint's tensors may have: what the readers make tensors of."""


def _storage_dtypes() -> dict[tuple[str, str], torch.dtype]:
    """The storage classes a header names (``torch.FloatStorage``), to the dtype of their
    elements: the typed ones of plain dtypes, and ``UntypedStorage`` (bytes), which
    ``_rebuild_tensor_v3`` views as its own dtype (float8, uint16 and the like)."""
    typed = {
        ("torch", name): dtype
        for dtype, name in torch.storage._dtype_to_storage_type_map().items()
        if dtype in TENSOR_DTYPES
    }
    return {**typed, ("torch.storage", "UntypedStorage"): torch.uint8}


def _plain_tensor(arguments: tuple[Any, ...], unpickler: Any) -> StoredTensor:
    """Stands for ``torch._utils._rebuild_tensor_v2(storage, offset, size, stride,
    requires_grad, hooks[, metadata])``: what it would build, described."""
    if len(arguments) == 7 and not arguments[6]:  # no conj or neg bits
        arguments = arguments[:6]
    if len(arguments) != 6:
        raise unpickler.refuse("rebuilds a tensor that is not plain")
    return _described(arguments, None, unpickler)


def _plain_tensor_v3(arguments: tuple[Any, ...], unpickler: Any) -> StoredTensor:
    """Stands for ``torch._utils._rebuild_tensor_v3(storage, offset, size, stride,
    requires_grad, hooks, dtype[, metadata])`` (torch.save's way for dtypes without a typed
    storage class, float8 say): the storage's bytes viewed as ``dtype``."""
    if len(arguments) == 8 and not arguments[7]:
        arguments = arguments[:7]
    if len(arguments) != 7 or type(arguments[6]) is not torch.dtype:
        raise unpickler.refuse("rebuilds a tensor that is not plain")
    return _described(arguments[:6], arguments[6], unpickler)


def _described(
    arguments: tuple[Any, ...], dtype: torch.dtype | None, unpickler: Any
) -> StoredTensor:
    """The tensor ``(storage, offset, size, stride, requires_grad, hooks)`` of ``dtype`` (by
    default its storage's), checked to be plain and to lie inside its storage's bytes."""
    storage, offset, size, stride, requires_grad, hooks = arguments
    if not (
        type(storage) is _StorageReference
        and type(offset) is int
        and _lengths(size)
        and _lengths(stride)
        and len(size) == len(stride) <= 64
        and type(requires_grad) is bool
        and type(hooks) is collections.OrderedDict
        and not hooks
        and (dtype is None or dtype in TENSOR_DTYPES)
    ):
        raise unpickler.refuse("rebuilds a tensor that is not plain")
    dtype = storage.dtype if dtype is None else dtype
    nbytes = storage.numel * storage.dtype.itemsize
    if nbytes % dtype.itemsize:
        raise unpickler.refuse(f"views a storage of {nbytes} bytes as {dtype}")
    numel = nbytes // dtype.itemsize
    stored = StoredTensor(storage.key, dtype, numel, offset, size, stride, requires_grad)
    # Inside its storage: every element it views, and no more elements than the storage holds
    # (so that nothing sized by the tensor outgrows the file).
    last = offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
    if math.prod(size) and (offset < 0 or last >= numel or math.prod(size) > numel):
        raise unpickler.refuse("views a tensor beyond its storage")
    return stored


def _lengths(value: Any) -> bool:
    return type(value) is tuple and all(type(n) is int and 0 <= n < 1 << 62 for n in value)


_NAMES = {
    **PLAIN_NAMES,
    **_storage_dtypes(),
    ("torch._utils", "_rebuild_tensor_v2"): Factory("_rebuild_tensor_v2", _plain_tensor),
    ("torch._utils", "_rebuild_tensor_v3"): Factory("_rebuild_tensor_v3", _plain_tensor_v3),
}


_STORAGE_DTYPES = frozenset(_storage_dtypes().values())


def _storage(pid: Any, where: str) -> _StorageReference:
    """A tensor's storage, as its header refers to it: by dtype, key and element count."""
    match pid:
        case ("storage", torch.dtype() as dtype, str(key), str(), int(numel)) if (
            dtype in _STORAGE_DTYPES and 0 <= numel < 1 << 62
        ):
            return _StorageReference(dtype, key, numel)
    raise CheckpointError(f"{where}: a tensor's header refers to something other than a storage")


class Archive:
    """One ``torch.save`` archive in the seekable ``file`` (named ``where`` in errors, which
    say it ``damage`` where it is damaged): its records parsed, and all but the storages read
    and checked against their CRC-32s.

    :raises DamagedCheckpointError: if the archive is not whole or a record does not match its
        CRC-32.
    """

    def __init__(self, file: IO[bytes], where: str, damage: str = "is garbled") -> None:
        self.file, self.where, self._damage = file, where, damage
        records = parse_archive(file)
        if isinstance(records, str):
            raise self.damaged(records)
        self.records = {record.name.partition("/")[2]: record for record in records}
        self.small = {
            name: record.read(file)
            for name, record in self.records.items()
            if not name.startswith("data/")
        }
        problem = first_problem([self.records[name] for name in self.small], file)
        if problem is not None:
            raise self.damaged(problem)
        if self.small.get("byteorder", b"little") != _BYTEORDER:
            raise CheckpointError(
                f"{where} was saved on a machine of the other byte order: load it there and "
                "save it again"
            )
        self._storages: dict[str, torch.Tensor] = {}
        self._seen: dict[int, Any] = {}
        self._tuples: dict[int, Any] = {}
        self._keys: dict[int, Any] = {}

    def damaged(self, problem: str) -> DamagedCheckpointError:
        return DamagedCheckpointError(f"{self.where} {self._damage} ({problem})")

    def _unpickle(self) -> Any:
        if "data.pkl" not in self.small:
            raise self.damaged("it has no data.pkl record")
        return unpickle(self.small["data.pkl"], self.where, _NAMES, self._storage)

    def _storage(self, pid: Any) -> _StorageReference:
        return _storage(pid, self.where)

    def header(self) -> StoredTensor:
        """The plain tensor the archive holds, described; its storage record checked to hold
        exactly its bytes."""
        stored = self._unpickle()
        if type(stored) is not StoredTensor:
            raise CheckpointError(f"{self.where} holds a {type(stored).__name__}, not a tensor")
        self._data_record(stored)
        return stored

    def _data_record(self, stored: StoredTensor) -> Record:
        record = self.records.get(f"data/{stored.key}")
        if record is None or record.size != stored.nbytes:
            raise CheckpointError(
                f"{self.where}: its tensor's header does not match its data record (a crafted "
                "or damaged archive)"
            )
        return record

    def read_into(self, stored: StoredTensor, target: torch.Tensor) -> None:
        """Read the bytes of ``stored`` (a contiguous whole) into the contiguous ``target``."""
        record = self._data_record(stored)
        if record.size:
            record.read_into(self.file, target.reshape(-1).view(torch.uint8).numpy().data)
        problem = record.problem(self.file)
        if problem is not None:
            raise self.damaged(problem)

    def tensor(self, stored: StoredTensor) -> torch.Tensor:
        """A new tensor of ``stored``'s values (its storage read once, checked as it is read)."""
        buffer = self._storages.get(stored.key)
        if buffer is None:
            record = self._data_record(stored)
            buffer = torch.empty(record.size, dtype=torch.uint8)
            if record.size:
                record.read_into(self.file, buffer.numpy().data)
            problem = record.problem(self.file)
            if problem is not None:
                raise self.damaged(problem)
            self._storages[stored.key] = buffer
        elif buffer.numel() != stored.nbytes:
            raise CheckpointError(f"{self.where}: two tensors read one storage as two sizes")
        try:
            tensor = torch.empty(0, dtype=stored.dtype)
            tensor.set_(buffer.untyped_storage(), stored.offset, stored.size, stored.stride)
            return tensor.requires_grad_(stored.requires_grad)
        except RuntimeError as e:  # requires_grad on integers, say
            raise CheckpointError(f"{self.where} holds a tensor torch cannot build ({e})") from None

    def value(self) -> Any:
        """The value the archive holds, its tensors read (plain data and plain tensors only)."""
        return self._tree(self._unpickle(), 0)

    def _tree(self, value: Any, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise CheckpointError(f"{self.where} holds a value nested too deeply")
        kind = type(value)
        if kind is StoredTensor:
            return self.tensor(value)
        if kind is tuple:  # immutable, so it may be shared: built once
            if id(value) not in self._tuples:
                self._tuples[id(value)] = (value, tuple(self._tree(v, depth + 1) for v in value))
            return self._tuples[id(value)][1]
        if kind in (list, dict, collections.OrderedDict, set):
            if id(value) in self._seen:
                raise CheckpointError(f"{self.where} holds a {kind.__name__} twice (or in itself)")
            self._seen[id(value)] = value  # (kept alive, so that ids stay unique)
        if kind is list:
            value[:] = [self._tree(v, depth + 1) for v in value]
        elif kind in (dict, collections.OrderedDict):
            for key, item in value.items():
                self._key(key, depth + 1)
                value[key] = self._tree(item, depth + 1)
        elif kind in (set, frozenset):
            self._key(frozenset(value) if kind is set else value, depth)
        elif not _leaf(value):
            raise CheckpointError(f"{self.where} holds a {kind.__name__}, not plain data")
        return value

    def _key(self, key: Any, depth: int) -> None:
        """Raise unless ``key`` is plain, hashable and holds no tensor."""
        if depth > _MAX_DEPTH or not (_leaf(key) or type(key) in (tuple, frozenset)):
            raise CheckpointError(f"{self.where} holds a key that is not plain data")
        if type(key) in (tuple, frozenset) and id(key) not in self._keys:
            self._keys[id(key)] = key  # (checked once: it may be shared)
            for part in key:
                self._key(part, depth + 1)


def _leaf(value: Any) -> bool:
    kinds = (bool, int, float, complex, str, bytes, torch.Size, torch.dtype, torch.layout)
    return value is None or type(value) in kinds or type(value) is torch.memory_format
