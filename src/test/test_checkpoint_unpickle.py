"""Reading a checkpoint never runs code from it (``distributed/checkpoint_unpickle.py``).

A crafted ``.metadata`` that runs code and then returns the real metadata, a crafted
non-tensor value in a shard and a crafted trainer state are refused by every way olmolike
reads checkpoints, and their code never runs (it would create a file). Checkpoints of
olmolike, of stock DCP and of OLMo-core 3.0 still load.
"""

from __future__ import annotations

import io
import operator
import pathlib
import pickle
import struct
import tracemalloc
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from testutils import build_trainer

from olmolike.cli import main as cli_main
from olmolike.distributed.checkpoint import (
    get_checkpoint_metadata,
    load_keys,
    load_model_and_optim_state,
    load_state_dict,
    model_and_optim_state_dict,
    save_state_dict,
    unshard_checkpoint,
)
from olmolike.distributed.checkpoint_archive import Archive
from olmolike.distributed.checkpoint_format import (
    DCP_METADATA,
    MARKER,
    MODEL_AND_OPTIM,
    TRAIN_STATE,
    load_train_state,
    read_metadata,
    verify_checkpoint,
)
from olmolike.distributed.checkpoint_metadata import unpickle_metadata
from olmolike.exceptions import CheckpointError
from olmolike.nn import TransformerConfig
from olmolike.train import Duration
from olmolike.train.callbacks.checkpointer import CheckpointerCallback
from olmolike.train.train_module.reference import ReferenceModel

REFUSED_METADATA = r"refusing to unpickle operator\.itemgetter"
REFUSED_VALUE = r"refusing to unpickle operator\.itemgetter from .*'optim\.param_groups\.0\.lr'"


# -- payloads (stdlib only: a plain unpickler needs nothing of this module to run them) ---------


class _RunsCode:
    """Unpickles to ``exec`` of code that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


class _RunsCodeThenReturns:
    """Unpickles to ``value``, after running :class:`_RunsCode`: nothing looks amiss."""

    def __init__(self, marker: Path, value: Any) -> None:
        self.marker, self.value = marker, value

    def __reduce__(self) -> Any:
        return (operator.itemgetter(1), ((_RunsCode(self.marker), self.value),))


def craft_metadata(dcp_dir: Path | str, marker: Path, attack: str | None = None) -> None:
    """Replace a DCP directory's ``.metadata`` with one that runs code (or does ``attack``,
    one of :data:`ATTACKS`), then returns the real metadata: the load goes on as usual."""
    with fsspec.open(f"{dcp_dir}/{DCP_METADATA}", "rb") as f:
        real = pickle.load(f)  # our own file, written by the test
    with fsspec.open(f"{dcp_dir}/{DCP_METADATA}", "wb") as f:
        if attack is None:
            f.write(pickle.dumps(_RunsCodeThenReturns(marker, real)))
        else:  # the attack, POP, then the real metadata
            f.write(b"\x80\x02" + ATTACKS[attack] + b"0" + pickle.dumps(real, protocol=2)[2:])


def _text(value: str) -> bytes:
    return b"X" + struct.pack("<I", len(value)) + value.encode()


def _slots(name: str, value: bytes) -> bytes:
    """The state ``(None, {name: value})``: BUILD sets it with ``setattr``, on a class too."""
    return b"N}" + _text(name) + value + b"s\x86"


def _fields(name: str, value: bytes) -> bytes:
    """The state ``{name: value}``: BUILD puts it in the object's ``__dict__``."""
    return b"}" + _text(name) + value + b"s"


_DCP = b"ctorch.distributed.checkpoint.metadata\n"
_PATH = b"cpathlib\nPosixPath\n"
_LAYOUT = b"ctorch.serialization\n_get_layout\n"
ATTACKS = {
    # BUILD onto a class find_class returned: every rename a silent no-op; every path one file.
    "PosixPath.rename = PosixPath": _PATH + _slots("rename", _PATH) + b"b",
    "PosixPath._str = '<file>'": _PATH + _slots("_str", _text("<file>")) + b"b",
    # torch.layout's lookup table, which every later torch.load uses.
    "_get_layout.cache = {}": _LAYOUT + _fields("cache", b"}") + b"b",
    "_get_layout['x'] = 1": _LAYOUT + _text("x") + b"K\x01s",
    # The same, through the memo, and on DCP's classes and what they return.
    "memoized TensorProperties.dtype": _DCP
    + b"TensorProperties\nq\x00h\x00"
    + _slots("dtype", b"K\x01")
    + b"b",
    "_MEM_FORMAT_ENCODING(0)._value_": _DCP
    + b"_MEM_FORMAT_ENCODING\nK\x00\x85R"
    + _fields("_value_", b"K\x07")
    + b"b",
    "a new chunk's __class__": _DCP
    + b"ChunkStorageMetadata\n)\x81"
    + _slots("__class__", _PATH)
    + b"b",
    # 33 bytes that allocate 1.5 GiB.
    "bytearray(N)": b"c__builtin__\nbytearray\nJ\x00\x00\x00\x60\x85R",
}


def test_the_payloads_run_under_plain_pickle(tmp_path: Path) -> None:
    """What DCP and OLMo-core do today: the code runs, and the load looks normal."""
    marker = tmp_path / "ran"
    assert pickle.loads(pickle.dumps(_RunsCodeThenReturns(marker, 0.5))) == 0.5
    assert marker.exists()


# -- checkpoints ----------------------------------------------------------------------------


class FF(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.w1(x))


def stepped(seed: int = 0) -> tuple[FF, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = FF()
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    return model, optim


def complete(folder: Path, world_size: int = 1) -> Path:
    """Lay ``folder`` out as a complete train checkpoint (marker and trainer state)."""
    (folder / TRAIN_STATE).mkdir(parents=True, exist_ok=True)
    for rank in range(world_size):
        torch.save({"global_step": 1}, folder / TRAIN_STATE / f"rank{rank}.pt")
    (folder / MARKER).write_text(
        f'{{"format_version": 1, "world_size": {world_size}, "ephemeral": false}}'
    )
    return folder


def saved(folder: Path, state: dict[str, Any] | None = None) -> Path:
    """A train checkpoint ``folder`` of :func:`stepped`'s model (or of ``state``)."""
    model, optim = stepped()
    save_state_dict(folder / MODEL_AND_OPTIM, state or model_and_optim_state_dict(model, optim))
    return complete(folder)


def with_crafted_lr(marker: Path) -> dict[str, Any]:
    """Saveable model and optimizer state whose learning rate is a payload."""
    model, optim = stepped()
    state = model_and_optim_state_dict(model, optim)
    state["optim"]["param_groups"][0]["lr"] = _RunsCodeThenReturns(marker, 0.1)
    return state


def remote_copy(local: Path, name: str) -> str:
    fs = fsspec.filesystem("memory")
    fs.put(str(local), f"/{name}", recursive=True)
    return f"memory://{name}"


# -- a crafted .metadata ------------------------------------------------------------------------


def test_verify_refuses_a_crafted_metadata_and_names_the_class(tmp_path: Path) -> None:
    folder, marker = saved(tmp_path / "step1"), tmp_path / "ran"
    craft_metadata(folder / MODEL_AND_OPTIM, marker)
    with pytest.raises(CheckpointError, match=REFUSED_METADATA):
        verify_checkpoint(str(folder))
    assert not marker.exists()


def readers(source: str, out: Path, **options: Any) -> dict[str, Callable[[], Any]]:
    """Every way to read the checkpoint ``source`` (but training's), by name."""
    model, optim = stepped(seed=1)
    return {
        "load_model_and_optim_state": lambda: load_model_and_optim_state(
            source, model, optim, **options
        ),
        "load_state_dict": lambda: load_state_dict(
            source, model_and_optim_state_dict(model, optim), **options
        ),
        "load_keys": lambda: list(load_keys(source, ["model.w1.weight"], **options)),
        "unshard_checkpoint": lambda: unshard_checkpoint(source, out, quiet=True, **options),
        "get_checkpoint_metadata": lambda: get_checkpoint_metadata(source),
        "read_metadata": lambda: read_metadata(f"{source}/{MODEL_AND_OPTIM}"),
        "verify_checkpoint": lambda: verify_checkpoint(source),
    }


@pytest.mark.parametrize("where", ["local", "in-place", "pre-download"])
def test_the_functional_api_refuses_a_crafted_metadata(tmp_path: Path, where: str) -> None:
    folder, marker = saved(tmp_path / "step1"), tmp_path / "ran"
    craft_metadata(folder / MODEL_AND_OPTIM, marker)
    source = str(folder) if where == "local" else remote_copy(folder, f"{where}/step1")
    options: dict[str, Any] = {"pre_download": where == "pre-download", "work_dir": tmp_path / "w"}
    for name, attempt in readers(source, tmp_path / "out", **options).items():
        with pytest.raises(CheckpointError, match=REFUSED_METADATA):
            attempt()
        assert not marker.exists(), name


def test_the_path_attacks_work_under_plain_pickle() -> None:
    """What the attacks do to a process that unpickles them as DCP does (in a child process):
    the rename is gone, every path is one file."""
    import subprocess
    import sys

    script = (
        "import pathlib, pickle, sys\n"
        "for attack in sys.stdin.buffer.read().split(b'<next>'):\n"
        "    pickle.loads(b'\\x80\\x02' + attack + b'N.')\n"
        "print(pathlib.PosixPath.rename is pathlib.PosixPath, str(pathlib.PosixPath('a', 'b')))\n"
    )
    attacks = [ATTACKS["PosixPath.rename = PosixPath"], ATTACKS["PosixPath._str = '<file>'"]]
    child = subprocess.run(
        [sys.executable, "-c", script],
        input=b"<next>".join(attacks),
        capture_output=True,
        check=True,
        timeout=60,
    )
    assert child.stdout.decode().split() == ["True", "<file>"], child


def _watched() -> list[Any]:
    """The attributes the attacks aim at: of the path classes, the layout lookup, DCP's."""
    from torch.distributed.checkpoint import metadata as dcp

    watched = [pathlib.PosixPath, pathlib.PurePosixPath, pathlib.PurePath, pathlib.Path]
    watched += [torch.serialization._get_layout, dcp.TensorProperties, dcp.ChunkStorageMetadata]
    watched += [dcp._MEM_FORMAT_ENCODING, *dcp._MEM_FORMAT_ENCODING]
    torch.serialization._get_layout("torch.strided")  # (fills its cache, as torch does lazily)
    found = [sorted((k, id(v)) for k, v in vars(obj).items()) for obj in watched]
    return [*found, dict(torch.serialization._get_layout.cache)]  # type: ignore[attr-defined]


@pytest.mark.parametrize("attack", ATTACKS)
def test_a_metadata_that_acts_on_what_it_names_is_refused_by_every_reader(
    tmp_path: Path, attack: str
) -> None:
    """The crafted file then unpickles to the real metadata, so under plain pickle the load
    would succeed: every reader refuses it, and nothing in the process changed."""
    folder, before = saved(tmp_path / "step1"), _watched()
    craft_metadata(folder / MODEL_AND_OPTIM, tmp_path / "ran", attack)
    tracemalloc.start()
    try:
        for name, attempt in readers(str(folder), tmp_path / "out").items():
            with pytest.raises(CheckpointError, match="refusing to unpickle"):
                attempt()
            assert _watched() == before, name
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, peak  # bytearray(N) was never called


def test_the_unshard_command_refuses_a_crafted_metadata(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder, marker = saved(tmp_path / "step1"), tmp_path / "ran"
    craft_metadata(folder / MODEL_AND_OPTIM, marker)
    assert cli_main(["unshard", str(folder), str(tmp_path / "out")]) != 0
    assert "refusing to unpickle operator.itemgetter" in capsys.readouterr().err
    assert not marker.exists()


def test_a_reference_model_refuses_a_crafted_metadata(tmp_path: Path) -> None:
    config = TransformerConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2)
    policy = config.build(seed=1)
    folder, marker = tmp_path / "step1", tmp_path / "ran"
    save_state_dict(folder / MODEL_AND_OPTIM, model_and_optim_state_dict(policy))
    craft_metadata(complete(folder) / MODEL_AND_OPTIM, marker)
    with pytest.raises(CheckpointError, match=REFUSED_METADATA):
        ReferenceModel.load(policy, str(folder), device=torch.device("cpu"))
    assert not marker.exists()


def trained(save_folder: Path, steps: int = 1, **callbacks: Any) -> None:
    """Train (resuming from ``save_folder``'s latest checkpoint), saving every step."""
    checkpointer = CheckpointerCallback(save_interval=1)
    build_trainer(
        save_folder,
        num_instances=16,
        max_duration=Duration.steps(steps),
        callbacks={"checkpointer": checkpointer, **callbacks},
    ).fit()


def craft(step: Path, kind: str, marker: Path) -> None:
    """Make the train checkpoint ``step`` run code (creating ``marker``) when read."""
    dcp_dir = step / MODEL_AND_OPTIM
    if kind == "metadata":
        craft_metadata(dcp_dir, marker)
    elif kind == "train state":
        torch.save({"global_step": _RunsCode(marker)}, step / TRAIN_STATE / "rank0.pt")
    elif any(key.startswith("optim.") for key in read_metadata(dcp_dir).state_dict_metadata):
        # (The checkpoint saved before the first step has no optimizer state.)
        model, optim = load_keys(dcp_dir, ["model", "optim"])
        optim["param_groups"][0]["lr"] = _RunsCodeThenReturns(marker, 0.01)
        save_state_dict(dcp_dir, {"model": model, "optim": optim}, save_overwrite=True)


@pytest.mark.parametrize("kind", ["metadata", "value", "train state"])
def test_resume_refuses_a_crafted_checkpoint(tmp_path: Path, kind: str) -> None:
    trained(tmp_path / "run")
    steps = sorted((tmp_path / "run").glob("step*"))
    assert len(steps) == 2, steps  # before the first step and after it
    marker = tmp_path / "ran"
    for step in steps:
        fsspec.filesystem("file").copy(
            str(step), str(tmp_path / "save" / step.name), recursive=True
        )
        craft(tmp_path / "save" / step.name, kind, marker)
    expected = {
        "metadata": REFUSED_METADATA,
        "value": REFUSED_VALUE,
        "train state": r"refusing to unpickle builtins\.exec from .*rank0\.pt",
    }
    with pytest.raises(CheckpointError, match=expected[kind]):
        trained(tmp_path / "save", steps=2)
    assert not marker.exists()


def test_the_reproducibility_check_refuses_a_crafted_metadata(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import olmolike.train.checkpoint.checkpointer as train_checkpoint
    from olmolike.train.callbacks.reproducibility_check import ReproducibilityCheckCallback

    marker, real_save = tmp_path / "ran", train_checkpoint.save_local

    def crafting_save(dir: Any, state: dict[str, Any], **kwargs: Any) -> None:
        real_save(dir, state, **kwargs)
        if "step1" in str(dir):
            craft_metadata(dir, marker)

    monkeypatch.setattr(train_checkpoint, "save_local", crafting_save)
    with pytest.raises(CheckpointError, match=REFUSED_METADATA):
        trained(tmp_path / "run", check=ReproducibilityCheckCallback())
    assert not marker.exists()


# -- a crafted value in a shard, a crafted trainer state ------------------------------------------


@pytest.mark.parametrize("where", ["local", "in-place", "pre-download"])
def test_a_crafted_value_in_a_shard_is_refused(tmp_path: Path, where: str) -> None:
    marker = tmp_path / "ran"
    folder = saved(tmp_path / "step1", with_crafted_lr(marker))
    source = str(folder) if where == "local" else remote_copy(folder, f"v-{where}/step1")
    options: dict[str, Any] = {"pre_download": where == "pre-download", "work_dir": tmp_path / "w"}
    model, optim = stepped(seed=1)
    with pytest.raises(CheckpointError, match=REFUSED_VALUE):  # one line, not DCP's exception
        load_model_and_optim_state(source, model, optim, **options)
    for attempt in (
        lambda: list(load_keys(source, ["optim.param_groups"], **options)),
        lambda: unshard_checkpoint(source, tmp_path / "out", optim=True, quiet=True, **options),
    ):
        with pytest.raises(CheckpointError, match=REFUSED_VALUE):
            attempt()
    assert not marker.exists()


def test_a_crafted_trainer_state_is_refused_when_read(tmp_path: Path) -> None:
    # Each rank reads (and checks) its own trainer state before a load applies anything.
    folder, marker = saved(tmp_path / "step1"), tmp_path / "ran"
    torch.save({"global_step": _RunsCode(marker)}, folder / TRAIN_STATE / "rank0.pt")
    with pytest.raises(CheckpointError, match=r"rank0\.pt"):
        load_train_state(str(folder), 0)
    assert not marker.exists()


def _with_attack(archive: bytes, attack: bytes) -> bytes:
    """The ``torch.save`` archive ``archive`` with ``attack`` (then POP) before its data.pkl's
    value: a plain unpickler does the attack and returns the real value. CRC-32s are right."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(archive)) as source, zipfile.ZipFile(out, "w") as crafted:
        for info in source.infolist():
            data = source.read(info)
            if info.filename.endswith("/data.pkl"):
                data = data[:2] + attack + b"0" + data[2:]  # (after PROTO 2)
            crafted.writestr(info.filename, data)
    return out.getvalue()


HEADER_ATTACKS = {
    **ATTACKS,
    # What a tensor header's names stand for: the rebuild function, a typed storage class.
    "_rebuild_tensor_v2.__code__": b"ctorch._utils\n_rebuild_tensor_v2\n"
    + _slots("__code__", b"N")
    + b"b",
    "FloatStorage.dtype": b"ctorch\nFloatStorage\n" + _fields("dtype", b"N") + b"b",
}


@pytest.mark.parametrize("attack", HEADER_ATTACKS)
def test_a_trainer_state_or_tensor_header_that_acts_on_what_it_names_is_refused(
    tmp_path: Path, attack: str
) -> None:
    """The unpickler of every ``torch.save`` archive in a checkpoint (each record of a shard,
    each trainer state) polices what the file does as the metadata's does."""
    folder = saved(tmp_path / "step1")
    state, tensor = io.BytesIO(), io.BytesIO()
    torch.save({"global_step": 1, "rng": torch.zeros(4)}, state)
    torch.save(torch.zeros(4), tensor)
    before = _watched()
    crafted = _with_attack(state.getvalue(), HEADER_ATTACKS[attack])
    (folder / TRAIN_STATE / "rank0.pt").write_bytes(crafted)
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        load_train_state(str(folder), 0)
    header = io.BytesIO(_with_attack(tensor.getvalue(), HEADER_ATTACKS[attack]))
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        Archive(header, "a shard's record").header()
    assert _watched() == before


def test_readers_refuse_dcps_default_planner(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from olmolike.distributed.checkpoint_loading import dcp_reader

    folder = saved(tmp_path / "step1")
    reader = dcp_reader(folder / MODEL_AND_OPTIM)
    state = model_and_optim_state_dict(*stepped())
    with pytest.raises(BaseException, match="WeightsOnlyLoadPlanner"):
        dcp.load(state, storage_reader=reader, planner=DefaultLoadPlanner(), no_dist=True)


# -- the unpickler itself -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "module, name",
    [
        ("builtins", "exec"),
        ("builtins", "getattr"),
        ("os", "system"),
        ("subprocess", "Popen"),
        ("torch", "load"),
        ("torch", "serialization.os"),  # a dotted name reaches further: never resolved
        ("torch.distributed.checkpoint.metadata", "torch"),
    ],
)
def test_the_metadata_unpickler_refuses_every_other_name(module: str, name: str) -> None:
    payload = b"\x80\x02c" + f"{module}\n{name}\n".encode() + b")R."  # call module.name()
    with pytest.raises(CheckpointError, match=rf"refusing to unpickle {module}\.{name} from x"):
        unpickle_metadata(io.BytesIO(payload), "x")


def test_the_metadata_unpickler_wants_dcp_metadata() -> None:
    with pytest.raises(CheckpointError, match="holds a dict, not DCP metadata"):
        unpickle_metadata(io.BytesIO(pickle.dumps({"state_dict_metadata": {}})), "x")


# -- what must still load -------------------------------------------------------------------------


def assert_loads(dir: Path, model: nn.Module, optim: torch.optim.Optimizer, out: Path) -> None:
    """``dir`` loads through the functional API, ``load_keys`` and unshard, as saved."""
    fresh, fresh_optim = stepped(seed=7)
    load_model_and_optim_state(dir, fresh, fresh_optim)
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    saved_lr = optim.state_dict()["param_groups"][0]["lr"]
    assert fresh_optim.state_dict()["param_groups"][0]["lr"] == saved_lr
    (weight,) = load_keys(dir, ["model.w1.weight"])
    assert torch.equal(weight, model.w1.weight)
    model_path, optim_path = unshard_checkpoint(dir, out, optim=True, quiet=True)
    assert torch.equal(torch.load(model_path, weights_only=True)["w2.bias"], model.w2.bias)
    assert optim_path is not None


@pytest.mark.parametrize("single_file_per_rank", [True, False], ids=["one-file", "file-per-item"])
def test_a_stock_dcp_checkpoint_loads(tmp_path: Path, single_file_per_rank: bool) -> None:
    model, optim = stepped()
    writer = dcp.FileSystemWriter(str(tmp_path / "c"), single_file_per_rank=single_file_per_rank)
    dcp.save(model_and_optim_state_dict(model, optim), storage_writer=writer, no_dist=True)
    assert_loads(tmp_path / "c", model, optim, tmp_path / "out")


def test_tensors_of_dtypes_without_a_storage_class_load(tmp_path: Path) -> None:
    """float8, uint16 and complex32 tensors are saved by torch.save's _rebuild_tensor_v3 (an
    untyped storage viewed as the dtype), in a checkpoint and in a trainer state."""
    torch.manual_seed(0)
    state = {
        "f8": torch.randn(4, 3).to(torch.float8_e4m3fn),
        "u16": torch.arange(6).to(torch.uint16).reshape(2, 3)[:, 1:],  # a view, at an offset
        "c32": torch.randn(5, dtype=torch.complex64).to(torch.complex32),
    }
    save_state_dict(tmp_path / "c", state)
    (loaded,) = load_keys(tmp_path / "c", ["f8"])
    target = {key: torch.zeros_like(value) for key, value in state.items()}
    load_state_dict(tmp_path / "c", target)
    buffer = io.BytesIO()
    torch.save({"step": 1, **state}, buffer)
    buffer.seek(0)
    decoded = Archive(buffer, "a trainer state").value()
    for got in (target, decoded, {"f8": loaded}):
        for key, value in got.items():
            if key != "step":
                assert value.dtype == state[key].dtype, key
                assert torch.equal(
                    value.view(torch.uint8), state[key].contiguous().view(torch.uint8)
                )


def test_an_olmo_core_3_checkpoint_loads(tmp_path: Path) -> None:
    olmo_checkpoint = pytest.importorskip("olmo_core.distributed.checkpoint")
    model, optim = stepped()
    olmo_checkpoint.save_model_and_optim_state(str(tmp_path / "c"), model, optim)
    # Its metadata names OLMo-core's own _StorageInfo; read as torch's (OLMo-core not imported).
    assert b"olmo_core.distributed.checkpoint.filesystem" in (tmp_path / "c/.metadata").read_bytes()
    assert_loads(tmp_path / "c", model, optim, tmp_path / "out")


def test_metadata_of_older_torch_and_python_loads(tmp_path: Path) -> None:
    """Older torch releases pickled TensorProperties from the sharded-tensor module; Python
    3.13 pickles PosixPath as pathlib._local's; older pickle protocols name more classes."""
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    model, optim = stepped()
    save_state_dict(tmp_path / "c", model_and_optim_state_dict(model, optim))
    metadata = pickle.loads((tmp_path / "c/.metadata").read_bytes())
    for item in metadata.state_dict_metadata.values():
        if isinstance(item, TensorStorageMetadata):
            item.properties = TensorProperties(dtype=item.properties.dtype)
    old = pickle.dumps(metadata, protocol=2)
    old = old.replace(b"cpathlib\nPosixPath\n", b"cpathlib._local\nPosixPath\n")
    assert b"pathlib._local" in old and b"_shard.sharded_tensor.metadata" in old
    (tmp_path / "c/.metadata").write_bytes(old)
    assert_loads(tmp_path / "c", model, optim, tmp_path / "out")
