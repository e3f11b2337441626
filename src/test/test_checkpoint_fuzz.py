"""Reading a checkpoint changes nothing in the process, whatever its bytes: a seeded,
time-bounded fuzz of the policed unpickler (``checkpoint_unpickle``) through the two readers
that run it, DCP's ``.metadata`` (``checkpoint_metadata``) and the ``data.pkl`` of a
``torch.save`` archive (``checkpoint_archive``: each record of a shard, each trainer state).

Cases are pickles generated from every opcode over every admitted name (and names that must
stay refused), stack-aware so that they get past the first opcodes, with templates of the
attacks that matter (BUILD, REDUCE, NEWOBJ, SETITEM(S), APPEND(S), ADDITEMS on each admitted
global, memoized or not, with dict and slot states), and mutations of real files from a tiny
save. Each case must end in valid metadata (a value) or a ``CheckpointError``, never another
exception; no attribute of an admitted class, of ``pathlib``, ``os``, ``torch.serialization``,
``copyreg`` or of this project's reader modules may change; and the memory a case allocates is
bounded by its length. Last, fields of a real ``.metadata`` set to hostile values go through
the readers that act on them (``load_keys``, unshard, ``load_state_dict``), under the same
assertions.
"""

from __future__ import annotations

import collections
import contextlib
import copyreg
import dataclasses
import functools
import io
import os
import pathlib
import pickle
import random
import shutil
import struct
import sys
import time
import tracemalloc
import zipfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import metadata as dcp

from olmolike.distributed import checkpoint_archive, checkpoint_metadata, checkpoint_unpickle
from olmolike.distributed.checkpoint import save_state_dict
from olmolike.distributed.checkpoint_archive import Archive
from olmolike.distributed.checkpoint_metadata import unpickle_metadata
from olmolike.distributed.checkpoint_reader import nest
from olmolike.distributed.checkpoint_unpickle import DataClass, Factory
from olmolike.exceptions import CheckpointError

SEED = 32
CPU_SECONDS = 2.0
"""CPU time each of the four fuzzers runs for (``process_time``: a busy machine runs as many)."""
MIN_CASES = 400
"""Each fuzzer runs at least this many cases, however slow the machine."""

# -- what must not change ---------------------------------------------------------------------


def _admitted_objects() -> list[Any]:
    objects: list[Any] = []
    for names in (checkpoint_metadata._NAMES, checkpoint_archive._NAMES):
        for value in names.values():
            objects.append(value.cls if isinstance(value, DataClass) else value)
    return objects


WATCHED: list[Any] = [
    *_admitted_objects(),
    pathlib.Path,
    pathlib.PosixPath,
    pathlib.PurePath,
    pathlib.PurePosixPath,
    pathlib,
    os,
    os.path,
    torch.serialization,
    torch.serialization._get_layout,
    torch._utils,
    torch._utils._rebuild_tensor_v2,
    torch.Size,
    copyreg,
    collections.OrderedDict,
    dcp._MEM_FORMAT_ENCODING,
    *dcp._MEM_FORMAT_ENCODING,
    checkpoint_unpickle,
    checkpoint_metadata,
    checkpoint_archive,
    checkpoint_unpickle.PolicedUnpickler,
    pickle,
    pickle._Unpickler,
]


def _contents(value: Any) -> Any:
    """What a mutable value holds, one level down (by identity)."""
    if isinstance(value, dict):
        return tuple(sorted((repr(k), id(v)) for k, v in value.items()))
    if isinstance(value, (list, set)):
        return tuple(sorted(map(id, value)))
    if isinstance(value, (Factory, DataClass)):
        return tuple(id(getattr(value, slot)) for slot in type(value).__slots__)
    return None


def snapshot() -> list[Any]:
    """Every attribute of every watched object, with what its mutable values hold."""
    torch.serialization._get_layout("torch.strided")  # (fills its cache, as torch does lazily)
    found = []
    for obj in WATCHED:
        attributes = getattr(obj, "__dict__", None)
        entries = dict(attributes) if attributes is not None else {}
        found.append(
            (id(obj), _contents(obj), sorted((k, id(v), _contents(v)) for k, v in entries.items()))
        )
    found.append(sorted(torch.serialization._get_layout.cache.items(), key=repr))  # type: ignore[attr-defined]
    found.append((copyreg._extension_cache.copy(), copyreg.dispatch_table.copy()))  # type: ignore[attr-defined]
    return found


# -- generating pickles -----------------------------------------------------------------------

_REFUSED_NAMES = [
    ("builtins", "bytearray"),
    ("__builtin__", "bytearray"),
    ("builtins", "getattr"),
    ("builtins", "setattr"),
    ("builtins", "eval"),
    ("os", "system"),
    ("pathlib", "Path"),
    ("copyreg", "_reconstructor"),
    ("torch", "load"),
    ("torch._utils", "_rebuild_parameter"),
    ("collections", "Counter"),
    ("torch.serialization", "os"),
    ("torch", "serialization._get_layout"),
]
_ATTRIBUTES = [
    "rename",
    "_str",
    "_raw_paths",
    "cache",
    "__class__",
    "__dict__",
    "__setstate__",
    "__reduce_ex__",
    "append",
    "extend",
    "add",
    "value",
    "_value_",
    "name",
]


class Generator:
    """Pickles from every opcode over every admitted name, stack-aware."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        names = {**checkpoint_metadata._NAMES, **checkpoint_archive._NAMES}
        # Constants (dtypes) are most of the names: each kind is drawn as often.
        self.names = [
            [name for name, v in names.items() if isinstance(v, (Factory, DataClass))],
            [name for name, v in names.items() if not isinstance(v, (Factory, DataClass))],
            _REFUSED_NAMES,
        ]
        fields = {f for v in names.values() if isinstance(v, DataClass) for f in v.fields}
        self.strings = (
            sorted(fields)
            + _ATTRIBUTES
            + [
                "latin1",
                "torch.strided",
                "storage",
                "cpu",
                "0",
                "data",
                "../x",
                "/etc/passwd",
                "__0_0.distcp",
                "model",
                "",
            ]
        )

    # one opcode (bytes), how many values it pops and pushes, and whether it ends a mark

    def string(self) -> bytes:
        text = self.rng.choice(self.strings).encode()
        return b"\x8c" + bytes([len(text)]) + text

    def plain(self) -> bytes:
        r = self.rng
        return r.choice(
            [
                lambda: b"N",
                lambda: b"\x88",
                lambda: b"\x89",
                lambda: b"K" + bytes([r.randrange(256)]),
                lambda: b"J" + struct.pack("<i", r.choice([-1, 0, 1 << 30, r.randrange(-9, 99)])),
                lambda: b"\x8a\x09" + r.randbytes(9),  # LONG1: a 72-bit integer
                lambda: b"G" + struct.pack(">d", r.choice([0.5, float("nan"), 1e308])),
                lambda: b"C\x03abc",
                lambda: self.string(),
                lambda: b")",
                lambda: b"]",
                lambda: b"}",
                lambda: b"\x8f",
            ]
        )()

    def global_(self) -> bytes:
        module, name = self.rng.choice(self.rng.choices(self.names, weights=[6, 2, 2])[0])
        if self.rng.random() < 0.5:
            return b"c" + f"{module}\n{name}\n".encode()
        mod, nam = module.encode(), name.encode()
        return b"\x8c" + bytes([len(mod)]) + mod + b"\x8c" + bytes([len(nam)]) + nam + b"\x93"

    def hostile(self) -> bytes:
        """One opcode that reaches beyond plain data, or reads or allocates a large length."""
        r = self.rng
        huge = struct.pack("<Q", r.choice([1 << 40, (1 << 63) - 1, 1 << 20]))
        return r.choice(
            [
                b"\x95" + huge,  # FRAME
                b"\x8e" + huge,  # BINBYTES8
                b"\x8d" + huge,  # BINUNICODE8
                b"\x96" + huge,  # BYTEARRAY8
                b"\x97",  # NEXT_BUFFER
                b"\x98",  # READONLY_BUFFER
                b"\x82" + bytes([r.randrange(256)]),  # EXT1
                b"\x83\xff\xff",  # EXT2
                b"\x84\xff\xff\xff\x7f",  # EXT4
                b"r\xff\xff\xff\x7f",  # LONG_BINPUT at 2**31
                b"j\xff\xff\xff\x7f",  # LONG_BINGET
                b"\x8b\xff\xff\xff\x7f",  # LONG4
                b"L" + b"9" * 5000 + b"\n",  # LONG: more digits than int() takes
                b"Pid\n",  # PERSID
                b"i" + b"os\nsystem\n",  # INST
                b"o",  # OBJ
                b"\xfe",  # not an opcode
            ]
        )

    def program(self) -> bytes:
        r = self.rng
        out = [b"\x80" + bytes([r.choice([2, 2, 3, 4, 5])])]
        depths = [0]  # values pushed since each open mark
        memo = 0
        for _ in range(r.randrange(2, 40)):
            depth = depths[-1]
            choice = r.random()
            if choice < 0.25 or depth == 0:
                out.append(self.plain() if r.random() < 0.6 else self.global_())
                depths[-1] += 1
            elif choice < 0.32:
                out.append(b"(")
                depths.append(0)
            elif choice < 0.45 and len(depths) > 1:
                op = r.choice([b"t", b"l", b"d", b"\x91", b"e", b"u", b"\x90", b"0", b"1"])
                depths.pop()
                if op in (b"t", b"l", b"d", b"\x91"):
                    depths[-1] += 1
                elif op == b"0":
                    depths[-1] -= 1 if depths[-1] else 0
                out.append(op)
            elif choice < 0.6 and depth >= 2:  # REDUCE, NEWOBJ, BUILD, SETITEM, APPEND, TUPLE2
                out.append(r.choice([b"R", b"\x81", b"b", b"a", b"\x86"]))
                depths[-1] -= 1
            elif choice < 0.64 and depth >= 3:
                out.append(r.choice([b"s", b"\x92", b"\x87"]))  # SETITEM, NEWOBJ_EX, TUPLE3
                depths[-1] -= 2
            elif choice < 0.72:
                out.append(r.choice([b"\x94", b"q" + bytes([memo % 256])]))  # MEMOIZE, BINPUT
                memo += 1
            elif choice < 0.8 and memo:
                out.append(b"h" + bytes([r.randrange(memo) % 256]))  # BINGET
                depths[-1] += 1
            elif choice < 0.86:
                out.append(r.choice([b"2", b"\x85", b"0"]))  # DUP, TUPLE1, POP
                depths[-1] += {b"2": 1, b"\x85": 0, b"0": -1}[out[-1]]
            elif choice < 0.87:
                out.append(b"Q")  # BINPERSID
            elif choice < 0.9:
                out.append(self.hostile())
            else:
                out.append(self.template())
                depths[-1] += 1
        out.append(b".")
        return b"".join(out)

    def template(self) -> bytes:
        """One attack on an admitted name: BUILD a dict or slot state onto it (directly,
        memoized, or onto what it made), call it, make it with NEWOBJ, add items to it."""
        r = self.rng
        target = self.global_()
        key = self.string()
        state = b"}" + key + self.global_() + b"s"  # {name: <a global>}
        slots = b"N" + state + b"\x86"  # (None, {name: ...})
        made = r.choice(
            [
                target,
                target + b"\x94h\x00",  # memoized and got back
                target + b")R",  # called with nothing
                target + b"(" + self.plain() + b"tR",  # called with one value
                target + b")\x81",  # NEWOBJ
                target + b")}\x92",  # NEWOBJ_EX
            ]
        )
        action = r.choice(
            [
                r.choice([state, slots]) + b"b",  # BUILD
                key + self.plain() + b"s",  # SETITEM
                b"(" + key + self.plain() + b"u",  # SETITEMS
                self.plain() + b"a",  # APPEND
                b"(" + self.plain() + b"e",  # APPENDS
                b"(" + self.plain() + b"\x90",  # ADDITEMS
            ]
        )
        return made + action


# -- the cases --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """A tiny save's ``.metadata`` and the ``data.pkl`` of a trainer-state-like archive."""
    folder = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    state = {
        "model": {"w": torch.randn(4, 3), "b": torch.randn(3)},
        "optim": {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": ["w", "b"]}]},
        "step": 3,
    }
    save_state_dict(folder, state, thread_count=1)
    buffer = io.BytesIO()
    state = {"rng": torch.get_rng_state()[:16], "step": 3, "order": [1, 2], "d": {1.5}}
    torch.save({"w": torch.zeros(16), **state}, buffer)  # storages data/0 and data/1
    with zipfile.ZipFile(buffer) as archive:
        header = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
        for key in STORAGES:
            assert len(archive.read(f"archive/data/{key}")) == len(STORAGES[key])
    return {"metadata": (folder / ".metadata").read_bytes(), "archive": header}


def mutations(rng: random.Random, real: bytes, generator: Generator) -> Iterator[bytes]:
    while True:
        data = bytearray(real)
        for _ in range(rng.choice([1, 1, 2, 4])):
            at = rng.randrange(len(data))
            kind = rng.random()
            if kind < 0.4:
                data[at] ^= 1 << rng.randrange(8)
            elif kind < 0.55:
                data[at] = rng.randrange(256)
            elif kind < 0.65:
                del data[at : at + rng.randrange(1, 16)]
            elif kind < 0.75:
                start = rng.randrange(len(data))
                data[at:at] = data[start : start + rng.randrange(1, 64)]
            elif kind < 0.9:
                data[at:at] = generator.template() + b"0"  # an attack, then POP
            else:
                data[at:at] = generator.hostile()
        yield bytes(data)


STORAGES = {"0": bytes(64), "1": bytes(5056)}
"""The storages of the archives read: ``data/0`` and ``data/1`` (the trainer state's)."""


def archive_of(header: bytes) -> io.BytesIO:
    """A ``torch.save`` archive with ``header`` as its data.pkl, and :data:`STORAGES`."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", header)
        archive.writestr("archive/byteorder", sys.byteorder)
        for key, data in STORAGES.items():
            archive.writestr(f"archive/data/{key}", data)
        archive.writestr("archive/version", "3\n")
    buffer.seek(0)
    return buffer


def read_metadata(data: bytes) -> None:
    metadata = unpickle_metadata(io.BytesIO(data), "fuzz")
    assert type(metadata) is dcp.Metadata
    if isinstance(metadata.planner_data, dict):  # as load_keys and unshard use it
        paths = [metadata.planner_data.get(key, ()) for key in metadata.state_dict_metadata]
        nest((path, None) for path in paths)


def read_archive(data: bytes) -> None:
    Archive(archive_of(data), "fuzz").value()
    with contextlib.suppress(CheckpointError):
        Archive(archive_of(data), "fuzz").header()


def fuzz(cases: Iterator[bytes], read: Callable[[bytes], None]) -> tuple[int, int, float]:
    """Run ``read`` on cases for :data:`CPU_SECONDS`: (cases, values read, seconds)."""
    before = snapshot()
    count = accepted = 0
    start = time.process_time()
    tracemalloc.start()
    try:
        while count < MIN_CASES or time.process_time() - start < CPU_SECONDS:
            data = next(cases)
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            try:
                read(data)
                accepted += 1
            except CheckpointError:
                pass
            except Exception as e:  # any other outcome is a failure of the readers
                raise AssertionError(f"case {count} ({data!r}): {type(e).__name__}: {e}") from e
            peak = tracemalloc.get_traced_memory()[1] - base
            # Python objects: an empty set is 216 bytes, its opcode 1 (see the docs).
            assert peak <= (1 << 20) + 256 * len(data), (count, data, peak)
            count += 1
            if count % 32 == 0:
                assert snapshot() == before, f"something changed in cases {count - 32}-{count}"
    finally:
        tracemalloc.stop()
    assert snapshot() == before
    return count, accepted, time.process_time() - start


TARGETS = {"metadata": read_metadata, "archive": read_archive}


@pytest.mark.parametrize("target", TARGETS)
def test_generated_pickles_change_nothing(target: str, capsys: pytest.CaptureFixture[str]) -> None:
    rng = random.Random(f"{SEED}-{target}")
    generator = Generator(rng)
    count, accepted, seconds = fuzz(iter(generator.program, None), TARGETS[target])
    with capsys.disabled():
        print(f"\n{target}: {count} generated pickles in {seconds:.1f} s CPU ({accepted} read)")


@pytest.mark.parametrize("target", TARGETS)
def test_mutated_real_files_change_nothing(
    target: str, real_files: dict[str, bytes], capsys: pytest.CaptureFixture[str]
) -> None:
    rng = random.Random(f"{SEED}-{target}-mutations")
    cases = mutations(rng, real_files[target], Generator(rng))
    count, accepted, seconds = fuzz(cases, TARGETS[target])
    with capsys.disabled():
        print(f"\n{target}: {count} mutations in {seconds:.1f} s CPU ({accepted} read)")
    assert accepted > 0  # some mutations (of a string, say) still read: the fuzz goes deep


def test_the_real_files_are_read(real_files: dict[str, bytes]) -> None:
    read_metadata(real_files["metadata"])
    read_archive(real_files["archive"])


# -- one argument, many calls: what a file makes is bounded by what it holds ---------------------


def _text(value: str) -> bytes:
    return b"X" + struct.pack("<I", len(value)) + value.encode()


_MANY = b"(" + b"K\x01" * 100_000
AMPLIFIERS = {  # a callable, and its arguments: about 1 MB or 100,000 values, memoized
    "_codecs.encode": (b"c_codecs\nencode\n", _text("x" * (1 << 20)) + _text("latin1") + b"\x86"),
    "PosixPath": (b"cpathlib\nPosixPath\n", _text("x" * (1 << 20)) + b"\x85"),
    "torch.Size": (b"ctorch\nSize\n", _MANY + b"t\x85"),
    "set": (b"c__builtin__\nset\n", _MANY + b"l\x85"),
    "frozenset": (b"c__builtin__\nfrozenset\n", _MANY + b"l\x85"),
}


@pytest.mark.parametrize("callable_", AMPLIFIERS)
def test_one_argument_passed_to_many_calls_is_refused(callable_: str) -> None:
    """Each call is 6 bytes (get the callable, get the arguments, call, append to a list), and
    could make as much as its memoized arguments hold: 10,000 calls, gigabytes kept."""
    function, arguments = AMPLIFIERS[callable_]
    calls = b"h\x00h\x01Ra" * 10_000
    data = b"\x80\x02" + function + b"q\x00" + arguments + b"q\x010]" + calls + b"."
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match="more values than it holds bytes"):
            unpickle_metadata(io.BytesIO(data), "amplified")
        assert tracemalloc.get_traced_memory()[1] < 64 << 20
    finally:
        tracemalloc.stop()


def test_one_sequence_in_many_places_of_the_metadata_is_refused(
    real_files: dict[str, bytes],
) -> None:
    """DCP's metadata is rebuilt from what the file holds: a tuple shared by 10,000 keys of
    ``planner_data`` must not become 10,000 copies."""
    metadata = pickle.loads(real_files["metadata"])  # (the test's own file)
    shared = tuple(range(100_000))
    metadata.planner_data = {f"k{i}": shared for i in range(10_000)}
    data = pickle.dumps(metadata)
    assert len(data) < 1 << 20
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match="repeats one sequence"):
            unpickle_metadata(io.BytesIO(data), "shared")
        assert tracemalloc.get_traced_memory()[1] < 64 << 20
    finally:
        tracemalloc.stop()


# -- what the readers do with what a metadata says: any field of a real one, changed -------------

_FIELD_VALUES: dict[type, list[Any]] = {
    int: [0, 1, 3, -1, 1 << 40, (1 << 62) - 1],
    str: ["", "../__0_0.distcp", "/etc/passwd", "model", "optim.step"],
    tuple: [("model", 1 << 20), ("model", "w", 0), ("optim", *["a"] * 100), ("model",), ()],
    torch.Size: [torch.Size([]), torch.Size([1 << 40]), torch.Size([4, 0]), torch.Size([2, 3])],
    torch.dtype: [torch.float8_e5m2, torch.complex32, torch.int64, torch.qint8, torch.uint4],
}
"""Hostile values for a field, by the type of the value it holds: each kind as often."""


def _slots(value: Any, found: list[tuple[Any, Any]], depth: int = 0) -> None:
    """Every place in the (test's own) metadata ``value`` a field could be changed."""
    if depth > 12:
        return
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            found.append((value, f.name))
            _slots(getattr(value, f.name), found, depth + 1)
    elif isinstance(value, dict):
        for key in list(value):
            found.append((value, key))
            _slots(value[key], found, depth + 1)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found.append((value, index))
            _slots(item, found, depth + 1)


def _changed(real: bytes, rng: random.Random) -> bytes:
    while True:
        metadata = pickle.loads(real)  # (the test's own file)
        for _ in range(rng.choice([1, 1, 1, 2])):
            slots: list[tuple[Any, Any]] = []
            _slots(metadata, slots)
            by_kind: dict[type, list[tuple[Any, Any]]] = collections.defaultdict(list)
            for owner, key in slots:
                value = owner[key] if isinstance(owner, (dict, list)) else getattr(owner, key)
                by_kind[type(value) if type(value) in _FIELD_VALUES else object].append(
                    (owner, key)
                )
            kind = rng.choice(sorted(by_kind, key=str))
            owner, key = rng.choice(by_kind[kind])
            if kind is object or rng.random() < 0.2:  # (a value of another kind)
                kind = rng.choice(list(_FIELD_VALUES))
            value = rng.choice([None, *_FIELD_VALUES[kind]])
            if isinstance(owner, (dict, list)):
                owner[key] = value
            else:
                setattr(owner, key, value)
        with contextlib.suppress(Exception):  # (some changes DCP's classes cannot pickle)
            return pickle.dumps(metadata)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, Any]]:
    folder = tmp_path_factory.mktemp("readers") / "c"
    torch.manual_seed(0)
    state = {
        "model": {"w": torch.randn(4, 3), "b": torch.randn(3).to(torch.bfloat16)},
        "optim": {"param_groups": [{"lr": 0.1, "params": ["w", "b"]}], "step": 3},
    }
    save_state_dict(folder, state, thread_count=1)
    return folder, state


def test_changed_metadata_fields_through_the_readers(
    tiny_checkpoint: tuple[Any, dict[str, Any]], tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """Any field of a real ``.metadata`` set to a hostile value (a size, an index, a path, a
    dtype no reader makes, a shard name outside the checkpoint): ``load_keys``, unshard and
    ``load_state_dict`` end in the values or one ``CheckpointError``, within the memory bound
    of the files, changing nothing."""
    from olmolike.distributed.checkpoint import load_keys, load_state_dict, unshard_checkpoint

    folder, state = tiny_checkpoint
    real = (folder / ".metadata").read_bytes()
    rng = random.Random(f"{SEED}-readers")
    before, count, accepted = snapshot(), 0, 0
    start = time.process_time()
    tracemalloc.start()
    try:
        while count < 48 or time.process_time() - start < CPU_SECONDS:
            (folder / ".metadata").write_bytes(_changed(real, rng))
            target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
            for read in (
                lambda: list(load_keys(folder, ["model", "optim"])),
                lambda: unshard_checkpoint(folder, tmp_path / "out", quiet=True, optim=True),
                functools.partial(load_state_dict, folder, target),
            ):
                tracemalloc.reset_peak()
                try:
                    read()
                    accepted += 1
                except CheckpointError:
                    pass
                assert tracemalloc.get_traced_memory()[1] < 64 << 20, count
            shutil.rmtree(tmp_path / "out", ignore_errors=True)
            count += 1
    finally:
        tracemalloc.stop()
        (folder / ".metadata").write_bytes(real)
    assert snapshot() == before
    with capsys.disabled():
        print(f"\nreaders: {count} changed metadata in {time.process_time() - start:.1f} s CPU")
    assert accepted > 0
