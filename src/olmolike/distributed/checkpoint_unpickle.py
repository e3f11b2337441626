"""Reading a checkpoint changes nothing in the process: the one unpickler olmolike runs on
bytes from a checkpoint.

A pickle is a program for a small stack machine, and stock unpicklers run it with few
limits: ``find_class`` decides which names a file may reach, but what the file then does
with them is not asked. BUILD sets attributes on whatever object is on the stack (a class
that ``find_class`` returned, say ``pathlib.PosixPath``), REDUCE calls whatever is there,
APPEND(S), SETITEM(S) and ADDITEMS call ``append``, ``[]=`` and ``add`` on it, and lengths
in the file size allocations before anything is read (pickle's own reads, and the C
unpickler's memo). :class:`PolicedUnpickler` is pickle's pure-Python unpickler (the C one
cannot be policed opcode by opcode) with a dispatch table of its own:

* **Names** resolve only to what the caller's table admits: constants (dtypes, layouts,
  memory formats) or a :class:`Factory` or :class:`DataClass` of this module, never to
  anyone else's class, function or module.
* **Calls** (REDUCE) reach only a :class:`Factory`; each checks its arguments' types and
  makes a new value no larger than they are. NEWOBJ (NEWOBJ_EX) on a :class:`DataClass`,
  with no arguments, makes a new :class:`Fields` record: the real class is never created
  from the file; the caller builds it from the checked fields afterwards.
* **Attributes** are set only by BUILD on a :class:`Fields` record that no BUILD filled
  yet, and only its class's declared fields.
* **Items** are added only to a list (APPEND, APPENDS), a dict or ``OrderedDict``
  (SETITEM, SETITEMS), a set (ADDITEMS): every such object on the stack was made by this
  load, as no factory returns anything shared.
* **Persistent ids** go to the caller's ``persistent_load`` (a tensor's storage), or are
  refused. INST, OBJ, EXT1/2/4 (copyreg's registry), BYTEARRAY8 (it allocates a length from
  the file before reading) and out-of-band buffers are refused, as is any other byte.
* The file is read into memory first and unpickled from there, so that no read asks for
  more than the file holds.

Whatever the bytes make pickle raise becomes a :class:`~olmolike.exceptions.CheckpointError`
naming the file. :mod:`.checkpoint_metadata` uses this for DCP's ``.metadata``,
:mod:`.checkpoint_archive` for the ``data.pkl`` of every ``torch.save`` archive (each record
of a shard, each trainer state).
"""

from __future__ import annotations

import _compat_pickle
import collections
import io as io_
import pathlib
import pickle
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..exceptions import CheckpointError

__all__ = [
    "PLAIN_NAMES",
    "DataClass",
    "Factory",
    "Fields",
    "PolicedUnpickler",
    "unpickle",
]


class Factory:
    """What a name in the file may call (REDUCE): ``make(arguments, unpickler)`` checks the
    arguments and returns a new value (or an immutable constant), no larger than they are."""

    __slots__ = ("_make", "name")

    def __init__(self, name: str, make: Callable[[tuple[Any, ...], PolicedUnpickler], Any]):
        self.name, self._make = name, make

    def __repr__(self) -> str:
        return f"<{self.name}>"


class DataClass:
    """An admitted data class: NEWOBJ on it makes a new :class:`Fields` record, which one BUILD
    fills with ``fields`` (by name, or by position where ``positional``)."""

    __slots__ = ("cls", "fields", "positional")

    def __init__(self, cls: type, fields: tuple[str, ...], positional: bool = False) -> None:
        self.cls, self.fields, self.positional = cls, fields, positional

    def __repr__(self) -> str:
        return f"<{self.cls.__name__}>"


class Fields:
    """A new record of a :class:`DataClass`'s fields, made by this load: the only thing BUILD
    may set anything on, and only once."""

    __slots__ = ("built", "kind", "values")

    def __init__(self, kind: DataClass) -> None:
        self.kind, self.built = kind, False
        self.values: dict[str, Any] = {}

    def __repr__(self) -> str:
        return f"<fields of {self.kind.cls.__name__}>"


def _length(value: Any) -> int:
    """How much a call's argument holds, as the size of what a call makes from it."""
    return len(value) if type(value) in (str, bytes, tuple, list, set, frozenset, dict) else 1


def _what(value: Any) -> str:
    return repr(value) if isinstance(value, (Factory, DataClass, Fields)) else type(value).__name__


_PurePythonUnpickler: Any = pickle._Unpickler
"""pickle's pure-Python unpickler (typed loosely: typeshed describes the C one)."""
_STOP: Any = pickle._Stop  # type: ignore[attr-defined]


class PolicedUnpickler(_PurePythonUnpickler):
    """Pickle's pure-Python unpickler, with every opcode that acts on an object policed (see
    the module's notes). ``names`` maps ``(module, name)`` to what the name stands for."""

    def __init__(
        self,
        data: bytes,
        source: str,
        names: Mapping[tuple[str, str], Any],
        persistent_load: Callable[[Any], Any] | None = None,
    ) -> None:
        self._file = io_.BytesIO(data)
        super().__init__(self._file)
        self.source, self.size, self._names = source, len(data), names
        self._persistent = persistent_load
        self._made = 0

    def load(self) -> Any:
        """pickle's ``_Unpickler.load``, reading straight from memory: frames are only a hint
        for buffered reading, and each read returns at most what is left of the bytes."""
        self.read, self.readline = self._file.read, self._file.readline
        self.metastack: list[list[Any]] = []
        self.stack: list[Any] = []
        self.append = self.stack.append
        self.proto = 0
        read, dispatch = self.read, self.dispatch
        try:
            while True:
                key = read(1)
                if not key:
                    raise EOFError
                dispatch[key[0]](self)
        except _STOP as stop:
            return stop.value

    def _frame(self) -> None:
        self.read(8)  # the frame's length: its bytes follow, as everything else, in memory

    def refuse(self, what: str) -> CheckpointError:
        return CheckpointError(
            f"refusing to unpickle {self.source}: it {what}, which no checkpoint does. Do not "
            "load it unless you know who wrote it and why"
        )

    def find_class(self, module: str, name: str) -> Any:
        if self.proto < 3:  # Python 2's names, as pickle maps them (torch.save writes protocol 2)
            module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
            module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        try:
            return self._names[(module, name)]
        except (KeyError, TypeError):
            raise CheckpointError(
                f"refusing to unpickle {module}.{name} from {self.source}: a checkpoint holds "
                "only plain data and the classes DCP and torch.save write, and loading anything "
                "else could run code. Do not load it unless you know who wrote it and why"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise self.refuse("refers to an object outside the pickle (a persistent id)")
        return self._persistent(pid)

    def _reduce(self) -> None:
        stack = self.stack
        arguments = stack.pop()
        function = stack[-1]
        if type(function) is not Factory or type(arguments) is not tuple:
            raise self.refuse(f"calls {_what(function)}")
        self._charge(1 + sum(map(_length, arguments)))
        stack[-1] = function._make(arguments, self)

    def _new(self, kind: Any, arguments: Any, keywords: Any = None) -> None:
        if type(kind) is not DataClass or type(arguments) is not tuple or arguments or keywords:
            raise self.refuse(f"creates {_what(kind)} with arguments {_what(arguments)}")
        self._charge(1)
        self.append(Fields(kind))

    def _charge(self, cost: int) -> None:
        """Count what a call may make (at most as much as its arguments hold): the calls of a
        file together may not make more than it holds. A memoized argument is a few bytes
        per call, and each call could make as much as it holds again."""
        self._made += cost
        if self._made > 2 * self.size + 4096:
            raise self.refuse("makes more values than it holds bytes (one argument, many calls)")

    def _newobj(self) -> None:
        arguments = self.stack.pop()
        self._new(self.stack.pop(), arguments)

    def _newobj_ex(self) -> None:
        keywords, arguments = self.stack.pop(), self.stack.pop()
        if type(keywords) is not dict:
            raise self.refuse(f"passes {_what(keywords)} as keyword arguments")
        self._new(self.stack.pop(), arguments, keywords)

    def _build(self) -> None:
        state = self.stack.pop()
        record = self.stack[-1]
        if type(record) is not Fields or record.built:
            raise self.refuse(f"sets attributes of {_what(record)}")
        kind, values = record.kind, record.values
        if kind.positional and type(state) is tuple and len(state) == len(kind.fields):
            values.update(zip(kind.fields, state, strict=True))
        else:
            if type(state) is tuple and len(state) == 2 and state[0] is None:
                state = state[1]  # (no __dict__, slot values)
            if type(state) is not dict or not all(key in kind.fields for key in state):
                raise self.refuse(f"sets other attributes than the fields of {kind!r}")
            values.update(state)
        record.built = True

    def _append(self) -> None:
        value = self.stack.pop()
        self._target(list, "appends to").append(value)

    def _appends(self) -> None:
        items = self.pop_mark()
        self._target(list, "appends to").extend(items)

    def _setitem(self) -> None:
        value, key = self.stack.pop(), self.stack.pop()
        self._target(dict, "sets an item of")[key] = value

    def _setitems(self) -> None:
        items = self.pop_mark()
        if len(items) % 2:
            raise self.refuse("sets an item without a value")
        target = self._target(dict, "sets an item of")
        for i in range(0, len(items), 2):
            target[items[i]] = items[i + 1]

    def _additems(self) -> None:
        items = self.pop_mark()
        self._target(set, "adds to").update(items)

    def _target(self, kind: type, action: str) -> Any:
        target = self.stack[-1] if self.stack else None
        if type(target) is kind or (kind is dict and type(target) is collections.OrderedDict):
            return target
        raise self.refuse(f"{action} {_what(target)}")

    def _refused_opcode(self) -> None:
        raise CheckpointError(
            f"refusing to unpickle {self.source}: it holds a pickle opcode that reaches beyond "
            "plain data (INST, OBJ, EXT, BYTEARRAY8, out-of-band buffers) or is not one at all"
        )

    dispatch: dict[int, Callable[[Any], None]] = {}


def _dispatch() -> dict[int, Callable[[Any], None]]:
    """Pickle's own handlers for the opcodes that only push, pop and memoize plain values;
    ours for the others; a refusal for everything else."""
    # fmt: off
    plain = (
        "PROTO", "NONE", "NEWFALSE", "NEWTRUE", "INT", "BININT", "BININT1", "BININT2", "LONG",
        "LONG1", "LONG4", "FLOAT", "BINFLOAT", "STRING", "BINSTRING", "SHORT_BINSTRING",
        "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE",
        "BINUNICODE8", "TUPLE", "EMPTY_TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_LIST",
        "EMPTY_DICT", "EMPTY_SET", "FROZENSET", "LIST", "DICT", "POP", "POP_MARK", "DUP", "GET",
        "BINGET", "LONG_BINGET", "PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE", "MARK", "STOP",
        "GLOBAL", "STACK_GLOBAL", "PERSID", "BINPERSID",
    )
    # fmt: on
    table: dict[int, Callable[[Any], None]] = dict.fromkeys(
        range(256), PolicedUnpickler._refused_opcode
    )
    for name in plain:
        code = getattr(pickle, name)[0]
        table[code] = _PurePythonUnpickler.dispatch[code]
    policed = {
        "FRAME": PolicedUnpickler._frame,
        "REDUCE": PolicedUnpickler._reduce,
        "NEWOBJ": PolicedUnpickler._newobj,
        "NEWOBJ_EX": PolicedUnpickler._newobj_ex,
        "BUILD": PolicedUnpickler._build,
        "APPEND": PolicedUnpickler._append,
        "APPENDS": PolicedUnpickler._appends,
        "SETITEM": PolicedUnpickler._setitem,
        "SETITEMS": PolicedUnpickler._setitems,
        "ADDITEMS": PolicedUnpickler._additems,
    }
    for name, handler in policed.items():
        table[getattr(pickle, name)[0]] = handler
    return table


PolicedUnpickler.dispatch = _dispatch()


def unpickle(
    data: bytes,
    source: str,
    names: Mapping[tuple[str, str], Any],
    persistent_load: Callable[[Any], Any] | None = None,
) -> Any:
    """The value pickled in ``data`` (read from ``source``, named in errors), unpickled by
    :class:`PolicedUnpickler` with ``names``.

    :raises CheckpointError: for anything the unpickler refuses, and for bytes that are not a
        whole pickle (whatever pickle raised, named).
    """
    try:
        return PolicedUnpickler(data, source, names, persistent_load).load()
    except CheckpointError:
        raise
    except Exception as e:  # whatever the bytes make pickle raise: they are not a pickle of ours
        raise CheckpointError(
            f"{source} is damaged or not a checkpoint file ({type(e).__name__}: {str(e)[:200]})"
        ) from None


# -- the factories of plain values ----------------------------------------------------------------


def _arguments(unpickler: PolicedUnpickler, name: str, given: tuple[Any, ...], *kinds: Any) -> None:
    """Refuse unless ``given`` holds one value of each of ``kinds`` (a type or a tuple of them)."""
    if len(given) != len(kinds) or not all(
        type(value) in (kind if isinstance(kind, tuple) else (kind,))
        for value, kind in zip(given, kinds, strict=True)
    ):
        raise unpickler.refuse(f"calls {name} with {', '.join(map(_what, given)) or 'nothing'}")


def _size(arguments: tuple[Any, ...], unpickler: PolicedUnpickler) -> torch.Size:
    if len(arguments) != 1 or type(arguments[0]) not in (tuple, list):
        raise unpickler.refuse(f"calls torch.Size with {', '.join(map(_what, arguments))}")
    try:  # (torch.Size takes ints, and what has __index__: bools, of what can be on the stack)
        size = torch.Size(arguments[0])
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise unpickler.refuse("makes a torch.Size of other values than lengths") from None
    if size and min(size) < 0:
        raise unpickler.refuse("makes a torch.Size of negative lengths")
    return size


def _collection(kind: type) -> Factory:
    def make(arguments: tuple[Any, ...], unpickler: PolicedUnpickler) -> Any:
        if not arguments:
            return kind()
        _arguments(unpickler, kind.__name__, arguments, (list, tuple, set, frozenset))
        return kind(arguments[0])

    return Factory(kind.__name__, make)


def _ordered_dict(arguments: tuple[Any, ...], unpickler: PolicedUnpickler) -> Any:
    _arguments(unpickler, "OrderedDict", arguments)
    return collections.OrderedDict()


def _complex(arguments: tuple[Any, ...], unpickler: PolicedUnpickler) -> complex:
    _arguments(unpickler, "complex", arguments, *[(int, float)] * len(arguments or (0,)))
    if len(arguments) > 2:
        raise unpickler.refuse("calls complex with more than two numbers")
    return complex(*arguments)


def _encode(arguments: tuple[Any, ...], unpickler: PolicedUnpickler) -> bytes:
    """``_codecs.encode(text, "latin1")``: how protocol 2 pickles bytes."""
    _arguments(unpickler, "_codecs.encode", arguments, str, str)
    if arguments[1] not in ("latin1", "latin-1"):
        raise unpickler.refuse(f"encodes text as {arguments[1][:20]!r}")
    return arguments[0].encode("latin1")


def _empty_bytes(arguments: tuple[Any, ...], unpickler: PolicedUnpickler) -> bytes:
    _arguments(unpickler, "bytes", arguments)  # protocol 2's b""
    return b""


_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}


def _layout(arguments: tuple[Any, ...], unpickler: PolicedUnpickler) -> torch.layout:
    """``torch.serialization._get_layout(name)``, looked up in a table of this module's."""
    _arguments(unpickler, "torch.serialization._get_layout", arguments, str)
    if arguments[0] not in _LAYOUTS:
        raise unpickler.refuse(f"names a layout {arguments[0][:40]!r} torch does not have")
    return _LAYOUTS[arguments[0]]


def _path(arguments: tuple[Any, ...], unpickler: PolicedUnpickler) -> pathlib.PurePath:
    """``PosixPath(*parts)`` (DCP records the directory it saved to), as a pure path: no
    larger than the file (its parts may be one memoized string many times)."""
    if not all(type(part) is str for part in arguments):
        raise unpickler.refuse("makes a path of other values than strings")
    if sum(map(len, arguments)) > unpickler.size:
        raise unpickler.refuse("makes a path longer than the file")
    return pathlib.PurePosixPath(*arguments)


def _constants() -> dict[tuple[str, str], Any]:
    """dtypes, layouts and memory formats by the names pickle gives them."""
    kinds = (torch.dtype, torch.layout, torch.memory_format)
    return {("torch", name): v for name, v in vars(torch).items() if isinstance(v, kinds)}


PLAIN_NAMES: Mapping[tuple[str, str], Any] = {
    **_constants(),
    ("torch", "Size"): Factory("torch.Size", _size),
    ("torch.serialization", "_get_layout"): Factory("_get_layout", _layout),
    ("collections", "OrderedDict"): Factory("OrderedDict", _ordered_dict),
    ("builtins", "set"): _collection(set),
    ("builtins", "frozenset"): _collection(frozenset),
    ("builtins", "complex"): Factory("complex", _complex),
    ("builtins", "bytes"): Factory("bytes", _empty_bytes),
    ("_codecs", "encode"): Factory("_codecs.encode", _encode),
}
"""The names of plain values, as ``pickle`` and ``torch.save`` write them."""

PATH_NAMES: Mapping[tuple[str, str], Any] = {
    (module, name): Factory("PosixPath", _path)
    for module in ("pathlib", "pathlib._local")  # Python 3.13 moved the class
    for name in ("PosixPath", "PurePosixPath")
}
"""A path, as DCP's ``StorageMeta.checkpoint_id`` holds one."""
