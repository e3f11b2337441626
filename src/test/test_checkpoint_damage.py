"""Damage in any record of a shard falls back (``checkpoint_archive``, ``checkpoint_loading``).

Every item DCP saves is a ``torch.save`` archive of records: the tensor's bytes (``data/0``),
its header (``data.pkl``), ``byteorder``, ``version``, ``.format_version``,
``.storage_alignment`` and ``.data/serialization_id``. One flipped bit in any of them, of any
item (a large tensor, a small one, a value), read in place or apart (a destination of another
layout, or a part of a saved tensor under another sharding), local or remote, is a
:class:`~olmolike.exceptions.DamagedCheckpointError` naming the shard and the record, never
torch's own error; and a resume falls back from it to the previous checkpoint, reproducing
bit for bit the run resumed from that one.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from remote_servers import RemoteStore
from testutils import build_trainer, full_params, run_distributed_test

from olmolike.distributed.checkpoint import load_state_dict, save_state_dict
from olmolike.distributed.checkpoint_format import MODEL_AND_OPTIM, read_metadata
from olmolike.distributed.checkpoint_records import Window, stored_records
from olmolike.exceptions import DamagedCheckpointError
from olmolike.train import Callback, Duration
from olmolike.train.callbacks import CheckpointerCallback

RECORDS = [
    "data/0",
    "data.pkl",
    "byteorder",
    "version",
    ".format_version",
    ".storage_alignment",
    ".data/serialization_id",
]
"""Every record of a tensor's archive; a value's has all but ``data/0``."""


@dataclass(frozen=True)
class Span:
    """Where one record of one item is: its shard file, first byte and length."""

    file: str
    start: int
    size: int


def records_of(dcp_dir: Path) -> dict[tuple[str, str], Span]:
    """Every record of every item in the (local) DCP directory, by (item key, record name)."""
    found = {}
    for index, info in read_metadata(dcp_dir).storage_data.items():
        with open(dcp_dir / info.relative_path, "rb") as f:
            window = Window(f, info.offset, info.length)
            for record in stored_records(window):  # type: ignore[arg-type]
                name = record.name.partition("/")[2]
                found[(index.fqn, name)] = Span(
                    info.relative_path, info.offset + record.start, record.size
                )
    return found


def flip(dcp_dir: Path, span: Span) -> None:
    """Flip one bit in the middle of the record at ``span``."""
    with open(dcp_dir / span.file, "r+b") as f:
        f.seek(span.start + span.size // 2)
        byte = f.read(1)[0]
        f.seek(span.start + span.size // 2)
        f.write(bytes([byte ^ 0x10]))


# -- every record of every item, read in place and apart, local and remote ----------------------


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "big": torch.randn(1 << 18),  # 1 MB
        "small": torch.randn(3, 5),
        "step": 7,
        "groups": [{"lr": 0.1, "betas": (0.9, 0.95)}],
    }


TENSORS = {"big": (1 << 18,), "small": (3, 5)}
VALUES = ["step", "groups.0.lr", "groups.0.betas"]


def _destination(path: str) -> dict[str, Any]:
    """What a load reads into: the saved layout (in place), or another one (apart)."""
    if path == "in place":
        tensors = {key: torch.zeros(shape) for key, shape in TENSORS.items()}
    else:  # strided destinations: read into a new tensor first, then copied
        tensors = {"big": torch.zeros(1 << 18, 2)[:, 0], "small": torch.zeros(5, 3).t()}
    return {**tensors, "step": 0, "groups": [{"lr": 0.0, "betas": (0.0, 0.0)}]}


CASES = [
    *[
        (key, record, path)
        for key in TENSORS
        for record in RECORDS
        for path in ("in place", "apart")
    ],
    *[(key, record, "value") for key in VALUES for record in RECORDS[1:]],
]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("pristine")
    save_state_dict(folder, _state(), thread_count=1)
    return folder


def test_the_cases_are_every_record_of_every_item(pristine: Path) -> None:
    assert sorted(records_of(pristine)) == sorted({(k, r) for k, r, _ in CASES})


def _loads(source: str | Path, path: str) -> None:
    target = _destination(path)
    load_state_dict(source, target, thread_count=1)
    assert torch.equal(target["big"], _state()["big"]) and target["step"] == 7


def _assert_damage_found(source: str | Path, case: tuple[str, str, str], span: Span) -> None:
    key, record, path = case
    with pytest.raises(DamagedCheckpointError) as error:
        _loads(source, "in place" if path == "value" else path)
    message = str(error.value)
    assert message.startswith(f"{span.file} (the record of {key!r} at bytes"), message
    assert "garbled" in message and repr(record) in message.replace("archive/", ""), message
    assert "weights_only" not in message and "\n" not in message, message


@pytest.mark.parametrize("case", CASES, ids=["-".join(case) for case in CASES])
def test_a_bit_flipped_in_any_record_is_damage(
    pristine: Path, tmp_path: Path, case: tuple[str, str, str]
) -> None:
    _loads(pristine, "in place" if case[2] == "value" else case[2])  # (as saved, it loads)
    copy = tmp_path / "copy"
    shutil.copytree(pristine, copy)
    span = records_of(copy)[case[:2]]
    flip(copy, span)
    _assert_damage_found(copy, case, span)


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["s3", "gs"])
def test_a_bit_flipped_in_any_record_of_a_remote_checkpoint_is_damage(
    pristine: Path, tmp_path: Path, protocol: str, request: pytest.FixtureRequest
) -> None:
    """The cases of the large tensor and of a value, read from an object store (each record
    read whole, in one request, then as a local one)."""
    store: RemoteStore = request.getfixturevalue(f"{'gcs' if protocol == 'gs' else 's3'}_bucket")
    url = store.url("damaged")
    store.fs.put(str(pristine), url, recursive=True)
    _loads(url, "in place")
    spans = records_of(pristine)
    for case in [case for case in CASES if case[0] in ("big", "groups.0.lr")]:
        copy = tmp_path / "-".join(case).replace("/", "_")
        shutil.copytree(pristine, copy)
        span = spans[case[:2]]
        flip(copy, span)
        store.fs.put(str(copy / span.file), f"{url}/{span.file}")
        _assert_damage_found(url, case, span)
    store.fs.put(str(pristine / span.file), f"{url}/{span.file}")
    _loads(url, "in place")


# -- a resume falls back, and equals the run resumed from the older checkpoint -----------------


@dataclass
class Loaded(Callback):
    names: list[str] = field(default_factory=list)

    def post_checkpoint_loaded(self, path: str) -> None:
        self.names.append(Path(path).name)


def _train(save: str, steps: int, fsdp: bool = False) -> dict[str, Any]:
    """Train to ``steps`` (resuming from ``save``'s newest checkpoint), saving every step."""
    loaded = Loaded()
    callbacks = {"checkpointer": CheckpointerCallback(save_interval=1), "loaded": loaded}
    trainer = build_trainer(
        save, max_duration=Duration.steps(steps), callbacks=callbacks, fsdp=fsdp
    )
    trainer.fit()
    optim = trainer.train_module.optim  # type: ignore[attr-defined]
    return {
        "params": full_params(trainer),
        "optim": _whole(optim.state_dict()),
        "loaded": loaded.names,
    }


def _whole(value: Any) -> Any:
    """``value`` with every sharded tensor gathered (plain tensors pickle to another process)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, dict):
        return {key: _whole(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(map(_whole, value))
    return value


def _same(a: Any, b: Any) -> bool:
    """Equal bit for bit, through dicts and lists of tensors (optimizer state dicts)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of two steps by one process, with checkpoints step1 and step2."""
    save = tmp_path_factory.mktemp("run")
    _train(str(save), steps=2)
    return save


def _model_tensor(saved_run: Path) -> str:
    """The largest model tensor of the run's checkpoints."""
    metadata = read_metadata(saved_run / "step2" / MODEL_AND_OPTIM)
    sizes = {
        key: item.size.numel()
        for key, item in metadata.state_dict_metadata.items()
        if key.startswith("model.") and hasattr(item, "size")
    }
    return max(sizes, key=lambda key: sizes[key])


RESUME_CASES = [*[("tensor", record) for record in RECORDS], ("value", "data.pkl")]
"""Resumed by one process (in place): every record of a model tensor, and a value's header.
That any record's damage is found, on either path and from any store, is the reader's part
(the tests above); that damage found means a fallback to the same run is the trainer's."""
RESHARDED_CASES = ["", "tensor data/0", "tensor byteorder", "tensor data.pkl"]
REMOTE_CASES = ["", "tensor byteorder", "value data.pkl"]


def _damaged_saves(saved_run: Path, root: Path) -> dict[str, str]:
    """Save folders holding step1 and step2 with one record damaged in step2, by case; and
    ``""``: step1 alone, whence the reference resumes."""
    tensor = _model_tensor(saved_run)
    saves = {}
    for case in ["", *[f"{kind} {record}" for kind, record in RESUME_CASES]]:
        save = root / (case.replace(" ", "-").replace("/", "_") or "reference")
        shutil.copytree(saved_run / "step1", save / "step1")
        if case:
            shutil.copytree(saved_run / "step2", save / "step2")
            kind, record = case.split(" ")
            key = tensor if kind == "tensor" else "optim.param_groups.0.lr"
            dcp_dir = save / "step2" / MODEL_AND_OPTIM
            flip(dcp_dir, records_of(dcp_dir)[(key, record)])
        saves[case] = str(save)
    return saves


def _resume_each(saves: dict[str, str], fsdp: bool) -> dict[str, Any]:
    """Resume to step 3 from each folder in turn, in this process; an error is recorded for
    its case, so that the others still run."""
    from olmolike.distributed.checkpoint_archive import Archive

    outcomes: dict[str, Any] = {}
    apart: list[str] = []
    tensor = Archive.tensor

    def counted(self: Archive, stored: Any) -> torch.Tensor:
        if "the record of 'model." in self.where:  # (not a trainer state's tensors)
            apart.append(self.where)
        return tensor(self, stored)

    Archive.tensor = counted  # type: ignore[method-assign]
    warnings = _Warnings()
    logging.getLogger("olmolike.train.checkpoint.run").addHandler(warnings)
    for case, save in saves.items():
        warnings.messages.clear()
        apart.clear()
        try:
            run = _train(save, steps=3, fsdp=fsdp)
            outcomes[case] = {**run, "warnings": list(warnings.messages), "apart": len(apart)}
        except Exception as e:
            outcomes[case] = f"{type(e).__name__}: {e}"
    Archive.tensor = tensor  # type: ignore[method-assign]
    return outcomes


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _assert_fell_back(outcomes: dict[str, Any], apart: bool) -> None:
    reference = outcomes.pop("")
    assert isinstance(reference, dict), reference
    assert reference["loaded"] == ["step1"]
    # Every tensor read straight into place, or (resharded) the model's into new tensors first.
    assert (reference["apart"] > 0) == apart, reference["apart"]
    for case, run in outcomes.items():
        assert isinstance(run, dict), (case, run)  # else the error it raised
        assert run["loaded"] == ["step1"], (case, run["loaded"])
        (warning,) = [w for w in run["warnings"] if "Cannot resume from" in w]
        assert "step2" in warning and "garbled" in warning, (case, warning)
        assert _same(run["optim"], reference["optim"]), case
        assert all(map(torch.equal, run["params"], reference["params"])), case


def test_a_resume_falls_back_from_damage_in_any_record_read_in_place(
    saved_run: Path, tmp_path: Path
) -> None:
    _assert_fell_back(_resume_each(_damaged_saves(saved_run, tmp_path), fsdp=False), apart=False)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_resume_falls_back_from_damage_in_any_record_read_resharded(
    saved_run: Path, tmp_path: Path
) -> None:
    """Saved by one process, resumed by two with FSDP: each rank reads a part of each saved
    tensor (at an offset, into a new tensor first)."""
    saves = {k: v for k, v in _damaged_saves(saved_run, tmp_path).items() if k in RESHARDED_CASES}
    per_rank = run_distributed_test(_resume_each, args=(saves, True), timeout=120 + 40 * len(saves))
    for outcomes in per_rank:
        _assert_fell_back(outcomes, apart=True)


@pytest.mark.slow
def test_a_resume_from_an_object_store_falls_back_from_a_damaged_record(
    saved_run: Path, tmp_path: Path, s3_bucket: RemoteStore
) -> None:
    saves = {
        case: save
        for case, save in _damaged_saves(saved_run, tmp_path).items()
        if case in REMOTE_CASES
    }
    remote = {}
    for case, save in saves.items():
        remote[case] = s3_bucket.url(Path(save).name)
        s3_bucket.fs.put(save, remote[case], recursive=True)
    _assert_fell_back(_resume_each(remote, fsdp=False), apart=False)
