"""Loading checkpoints (``checkpoint_loading``, ``checkpoint_archive``, ``checkpoint_records``):
a load checks every record's CRC-32 from the bytes it reads anyway (one read of each shard,
not two), and never calls ``torch.load``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from olmolike.distributed.checkpoint import load_state_dict, save_state_dict
from olmolike.distributed.checkpoint_archive import Archive, StoredTensor
from olmolike.distributed.checkpoint_records import Window, stored_records
from olmolike.exceptions import CheckpointError, DamagedCheckpointError

PROC_IO = Path("/proc/self/io")


def _state(megabytes: int = 1) -> dict[str, Any]:
    torch.manual_seed(0)
    return {"big": torch.randn(megabytes << 18), "small": torch.randn(7), "step": 3}


@pytest.mark.skipif(not PROC_IO.exists(), reason="reads /proc/self/io (Linux)")
def test_a_load_reads_each_shard_once_and_checks_it(tmp_path: Path) -> None:
    state = _state(megabytes=16)
    save_state_dict(tmp_path, state, thread_count=1)
    shard_bytes = sum(p.stat().st_size for p in tmp_path.glob("*.distcp"))
    target = {"big": torch.zeros_like(state["big"]), "small": torch.zeros(7), "step": 0}

    def bytes_read() -> int:
        fields = dict(line.split(": ") for line in PROC_IO.read_text().splitlines())
        return int(fields["rchar"])

    before = bytes_read()
    load_state_dict(tmp_path, target, thread_count=1)
    read = bytes_read() - before
    assert torch.equal(target["big"], state["big"]) and target["step"] == 3
    assert shard_bytes <= read < 1.25 * shard_bytes, (read, shard_bytes)


def _archive(path: Path) -> tuple[int, int]:
    """A ``torch.save`` archive of 1 MB of data at ``path``; where its data record is."""
    torch.save(torch.arange(1 << 18, dtype=torch.float32), path)
    with open(path, "rb") as f:
        (data,) = [r for r in stored_records(f) if r.size == 1 << 20]
    return data.start, data.size


@pytest.mark.parametrize("where", ["start", "middle", "end"])
def test_a_garbled_byte_in_a_storage_is_found_as_it_is_read(tmp_path: Path, where: str) -> None:
    path = tmp_path / "archive.pt"
    start, size = _archive(path)
    position = {"start": start, "middle": start + size // 2, "end": start + size - 1}[where]
    _flip(path, position)
    with open(path, "rb") as f:
        archive = Archive(f, "archive.pt")
        stored = archive.header()  # (the header is whole)
        with pytest.raises(DamagedCheckpointError, match="does not match its CRC-32"):
            archive.tensor(stored)
        with pytest.raises(DamagedCheckpointError, match="does not match its CRC-32"):
            archive.read_into(stored, torch.empty(1 << 18))


def test_a_record_that_ends_beyond_its_archive_is_damage_not_an_allocation(
    tmp_path: Path,
) -> None:
    """The size of a record comes from the archive's directory: reading it must not allocate
    what that says before knowing the bytes are there."""
    import struct

    path = tmp_path / "archive.pt"
    _archive(path)
    data = bytearray(path.read_bytes())
    entry = data.index(b"PK\x01\x02")
    while not data[entry + 46 :].startswith(b"archive/data/0"):
        entry = data.index(b"PK\x01\x02", entry + 4)
    data[entry + 20 : entry + 28] = struct.pack("<II", 0x7FFFFFF0, 0x7FFFFFF0)  # its sizes
    path.write_bytes(bytes(data))
    with open(path, "rb") as f, pytest.raises(DamagedCheckpointError, match="beyond its archive"):
        Archive(f, "archive.pt")


def test_a_compressed_record_is_refused_unread() -> None:
    """torch.save stores its records: a deflated one (64 MB of zeros in 64 KB) is never
    inflated."""
    import io
    import tracemalloc
    import zipfile

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("archive/data/0", bytes(64 << 20))
    assert len(buffer.getvalue()) < 1 << 20
    tracemalloc.start()
    try:
        with pytest.raises(DamagedCheckpointError, match="is compressed"):
            Archive(buffer, "bomb")
        assert tracemalloc.get_traced_memory()[1] < 8 << 20
    finally:
        tracemalloc.stop()


def test_a_window_reads_at_most_what_it_holds() -> None:
    """``zipfile`` reads the sizes an archive's directory gives: a read of 1 TB of a window
    of 3 bytes returns 3, allocating nothing more."""
    import io
    import tracemalloc

    window = Window(io.BytesIO(b"xabcx"), 1, 3)
    tracemalloc.start()
    try:
        assert window.read(1 << 40) == b"abc" and window.read(1 << 40) == b""
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()


# -- reading in place ---------------------------------------------------------------------------


def _saved(tmp_path: Path) -> dict[str, torch.Tensor]:
    """A state of every kind of plain tensor a model or optimizer holds, saved in one file."""
    torch.manual_seed(0)
    state = {
        "weight": torch.randn(300, 7),
        "bf16": torch.randn(64, dtype=torch.bfloat16),
        "ids": torch.arange(50),
        "mask": torch.rand(9) > 0.5,
        "step": torch.tensor(3.0),
        "empty": torch.zeros(0, 4),
    }
    save_state_dict(tmp_path, state, thread_count=1)
    return state


@pytest.fixture
def read_apart(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The shapes of the tensors read into a new tensor first, from now on (torch's way to
    read one); ``torch.load`` itself must never be called."""
    shapes: list[tuple[int, ...]] = []
    tensor = Archive.tensor

    def recording(self: Archive, stored: StoredTensor) -> torch.Tensor:
        loaded = tensor(self, stored)
        shapes.append(tuple(loaded.shape))
        return loaded

    load = torch.load

    def refused(*args: Any, **kwargs: Any) -> Any:
        import traceback

        if any("olmolike/distributed" in frame.filename for frame in traceback.extract_stack()):
            raise AssertionError("torch.load was called on checkpoint bytes")
        return load(*args, **kwargs)  # (the test's own transfers between processes)

    monkeypatch.setattr(Archive, "tensor", recording)
    monkeypatch.setattr(torch, "load", refused)
    return shapes


def test_a_tensor_whose_destination_fits_is_read_into_it(
    tmp_path: Path, read_apart: list[tuple[int, ...]]
) -> None:
    state = _saved(tmp_path)
    target = {key: torch.zeros_like(value) for key, value in state.items()}
    destinations = dict(target)
    load_state_dict(tmp_path, target, thread_count=1)
    assert read_apart == []  # no tensor of torch's allocated, no second copy
    for key, value in state.items():
        assert target[key] is destinations[key] and torch.equal(target[key], value), key
    assert target["weight"]._version > 0  # written in place, as copy_ would count it


def test_a_slice_of_a_larger_tensor_is_read_into_that_slice_alone(
    tmp_path: Path, read_apart: list[tuple[int, ...]]
) -> None:
    state = _saved(tmp_path)
    whole = torch.full((500, 7), -1.0)
    load_state_dict(tmp_path, {"weight": whole[100:400]}, thread_count=1)
    assert read_apart == []
    assert torch.equal(whole[100:400], state["weight"])
    assert (whole[:100] == -1).all() and (whole[400:] == -1).all()


DESTINATIONS = {  # what cannot take the stored bytes as they are
    "another dtype": lambda t: torch.zeros_like(t, dtype=torch.float64),
    "not contiguous": lambda t: torch.zeros(t.shape[1], t.shape[0]).t(),
}


@pytest.mark.parametrize("destination", DESTINATIONS)
def test_a_destination_that_does_not_fit_is_read_apart(
    tmp_path: Path, read_apart: list[tuple[int, ...]], destination: str
) -> None:
    state = _saved(tmp_path)
    target = DESTINATIONS[destination](state["weight"])
    load_state_dict(tmp_path, {"weight": target}, thread_count=1)
    assert read_apart == [(300, 7)]
    assert torch.equal(target, state["weight"].to(target.dtype))


def _record(dir: Path, key: str, name: str) -> tuple[Path, int, int]:
    """The shard file holding the record ``name`` (``data/0``, ``data.pkl``, ...) of the
    saved tensor ``key``, and where the record's bytes are in it."""
    from olmolike.distributed.checkpoint_format import read_metadata

    metadata = read_metadata(str(dir))
    (sinfo,) = [s for index, s in metadata.storage_data.items() if index.fqn == key]
    path = dir / sinfo.relative_path
    with open(path, "rb") as f:
        records = stored_records(Window(f, sinfo.offset, sinfo.length))  # type: ignore[arg-type]
    (record,) = [r for r in records if r.name.endswith(f"/{name}")]
    return path, sinfo.offset + record.start, record.size


def _flip(path: Path, position: int) -> None:
    with open(path, "r+b") as f:
        f.seek(position)
        byte = f.read(1)
        f.seek(position)
        f.write(bytes([byte[0] ^ 0x40]))


@pytest.mark.parametrize("record", ["data/0", "data.pkl", "version"])
@pytest.mark.parametrize("read", ["in place", "apart"])
def test_a_garbled_byte_in_a_tensor_record_is_found(tmp_path: Path, record: str, read: str) -> None:
    _saved(tmp_path)
    path, start, size = _record(tmp_path, "weight", record)
    _flip(path, start + size // 2)
    dtype = torch.float32 if read == "in place" else torch.float64
    with pytest.raises(DamagedCheckpointError, match="garbled"):
        load_state_dict(tmp_path, {"weight": torch.zeros(300, 7, dtype=dtype)}, thread_count=1)


def test_a_tensor_record_cut_short_is_found(tmp_path: Path) -> None:
    _saved(tmp_path)
    path, start, size = _record(tmp_path, "weight", "data/0")
    with open(path, "r+b") as f:
        f.truncate(start + size // 2)
    with pytest.raises(DamagedCheckpointError, match=r"__0_0\.distcp .* is garbled"):
        load_state_dict(tmp_path, {"weight": torch.zeros(300, 7)}, thread_count=1)


# -- sharded and resharded ----------------------------------------------------------------------


def _model_and_optim(seed: int, fsdp: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small transformer and its AdamW state after one step (``seed`` decides both)."""
    from torch.distributed.fsdp import fully_shard

    from olmolike.testing import TinyCausalLM

    torch.manual_seed(seed)
    model = TinyCausalLM(vocab_size=128, d_model=64, n_layers=2, n_heads=4, max_seq_len=16)
    if fsdp:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, 128, (2, 16))).sum().backward()
    optim.step()
    return model, optim


def _whole(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Parameters and AdamW state as whole tensors (gathered where sharded), by name."""
    from torch.distributed.tensor import DTensor

    def whole(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

    found = {}
    for name, param in model.named_parameters():
        found[name] = whole(param)
        for key in ("exp_avg", "exp_avg_sq"):
            found[f"{name}.{key}"] = whole(optim.state[param][key])
    return found


def _save_sharded(dir: str) -> dict[str, torch.Tensor]:
    from olmolike.distributed.checkpoint import save_model_and_optim_state

    model, optim = _model_and_optim(seed=1, fsdp=True)
    save_model_and_optim_state(dir, model, optim, thread_count=1)
    return _whole(model, optim)


def _load_sharded(dir: str) -> dict[str, torch.Tensor]:
    from olmolike.distributed.checkpoint import load_model_and_optim_state

    model, optim = _model_and_optim(seed=2, fsdp=True)
    load_model_and_optim_state(dir, model, optim, thread_count=1)
    return _whole(model, optim)


def _assert_equal(found: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> None:
    assert found.keys() == saved.keys()
    for name, value in saved.items():
        assert torch.equal(found[name], value), name


@pytest.mark.slow
def test_fsdp_checkpoints_load_sharded_and_resharded(
    tmp_path: Path, read_apart: list[tuple[int, ...]]
) -> None:
    from testutils import run_distributed_test

    from olmolike.distributed.checkpoint import (
        load_model_and_optim_state,
        save_model_and_optim_state,
    )

    by_two, by_one = str(tmp_path / "by_two"), str(tmp_path / "by_one")
    saved = run_distributed_test(_save_sharded, args=(by_two,))[0]
    # FSDP over 2 ranks -> 2 ranks: each rank's shards, in place.
    for found in run_distributed_test(_load_sharded, args=(by_two,)):
        _assert_equal(found, saved)
    # -> one process: each rank's shard is a contiguous part of the whole tensor, in place.
    model, optim = _model_and_optim(seed=3, fsdp=False)
    load_model_and_optim_state(by_two, model, optim, thread_count=1)
    _assert_equal(_whole(model, optim), saved)
    assert read_apart == []
    # One process -> FSDP over 2 ranks: each rank reads a part of each saved tensor.
    save_model_and_optim_state(by_one, model, optim, thread_count=1)
    for found in run_distributed_test(_load_sharded, args=(by_one,)):
        _assert_equal(found, saved)


class _Subclass(torch.Tensor):
    pass


def test_a_tensor_header_is_read_without_running_anything(tmp_path: Path) -> None:
    import io

    def header(value: Any) -> StoredTensor:
        buffer = io.BytesIO()
        torch.save(value, buffer)
        return Archive(buffer, "x").header()

    stored = header(torch.zeros(3, 4, dtype=torch.bfloat16))
    assert stored == StoredTensor("0", torch.bfloat16, 12, 0, (3, 4), (4, 1))
    assert stored.contiguous_whole
    assert not header(torch.zeros(4, 3).t()).contiguous_whole
    # Anything but a plain tensor is refused, naming what it is.
    for other, refused in (
        (torch.zeros(2).as_subclass(_Subclass), "refusing to unpickle torch._tensor"),
        (torch.zeros(2, dtype=torch.complex64).conj(), "not plain"),
        ({"a": 1}, "holds a dict, not a tensor"),
    ):
        with pytest.raises(CheckpointError, match=refused):
            header(other)
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    with pytest.raises(CheckpointError, match=r"refusing to unpickle posix\.system"):
        header(Payload())
    assert not marker.exists()
