"""A resume that falls back from a damaged checkpoint restores one whole checkpoint, never a mix
of two. Whatever part of the newest checkpoint is damaged (on disk, or as one rank sees it),
both gloo ranks agree to skip it, and the run from the pre-train checkpoint ``step0`` (which
holds no optimizer state) is bit for bit the run that never had the damaged one."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from testutils import build_trainer, dcp_shards, full_params, run_distributed_test

from olmolike.distributed.checkpoint import (
    load_model_and_optim_state,
    save_model_and_optim_state,
)
from olmolike.exceptions import DamagedCheckpointError
from olmolike.testing import TinyCausalLM
from olmolike.train import Callback, Duration
from olmolike.train.callbacks import CheckpointerCallback
from olmolike.train.checkpoint import MARKER

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

STEPS = 6
DAMAGED = 4
"""The step of the checkpoint damaged: the only older one is step0, before any optimizer step."""


@dataclass
class LoadedCheckpoints(Callback):
    names: list[str] = field(default_factory=list)

    def post_checkpoint_loaded(self, path: str) -> None:
        self.names.append(Path(path).name)


def _train(save: str, marker_garbled_for_rank: int | None = None) -> dict[str, Any]:
    from olmolike import io
    from olmolike.distributed.utils import get_rank

    read_bytes = io.read_bytes
    damaged_marker = str(Path(save) / f"step{DAMAGED}" / MARKER)

    def garbled(path: Any, *args: Any, **kwargs: Any) -> bytes:
        data = read_bytes(path, *args, **kwargs)
        return b'{"format_vers' if str(path) == damaged_marker else data

    if get_rank() == marker_garbled_for_rank:  # this rank alone sees a garbled marker
        io.read_bytes = garbled  # type: ignore[assignment]
    loaded, warnings = LoadedCheckpoints(), _Warnings()
    callbacks = {"checkpointer": CheckpointerCallback(save_interval=DAMAGED), "loaded": loaded}
    trainer = build_trainer(save, max_duration=Duration.steps(STEPS), callbacks=callbacks)
    logger = logging.getLogger("olmolike.train.checkpoint.run")
    logger.addHandler(warnings)
    try:
        trainer.fit()
    finally:
        logger.removeHandler(warnings)
        io.read_bytes = read_bytes  # type: ignore[assignment]
    optim = trainer.train_module.optim  # type: ignore[attr-defined]
    return {
        "params": full_params(trainer),
        "optim": optim.state_dict(),
        "loaded": loaded.names,
        "warnings": warnings.messages,
    }


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _garble(path: Path) -> None:
    """Flip 16 bytes in the middle: the size stays, the contents do not."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for i in range(middle, min(len(data), middle + 16)):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


PARTS = [
    MARKER,
    "model_and_optim/.metadata",
    *dcp_shards(2, prefix="model_and_optim/"),
    "train/rank0.pt",
    "train/rank1.pt",  # read by rank 1 only
]
DAMAGES: dict[str, Callable[[Path], None]] = {"truncated": _truncate, "garbled": _garble}


CASES = {f"{part} {damage}": (part, damage) for part in PARTS for damage in DAMAGES}
VIEW_CASE = "marker garbled as rank 1 sees it"


def _resume_each(saves: dict[str, str]) -> dict[str, Any]:
    """Resume from each folder in turn, in the same two processes (spawning is the slow part);
    an error is recorded for its case, so that the other cases still run."""
    outcomes: dict[str, Any] = {}
    for case, save in saves.items():
        try:
            outcomes[case] = _train(save, 1 if case == VIEW_CASE else None)
        except Exception as e:
            outcomes[case] = f"{type(e).__name__}: {e}"
    return outcomes


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    """The uninterrupted run (case ``""``), and a resume after each damage of a copy of its
    checkpoints step0 and step{DAMAGED}, each case's outcome on rank 0 and rank 1."""
    reference = tmp_path_factory.mktemp("uninterrupted")
    outcomes = {"": run_distributed_test(_train, args=(str(reference),))}
    saves: dict[str, str] = {}
    for case, (part, damage) in [*CASES.items(), (VIEW_CASE, (MARKER, None))]:
        save = tmp_path_factory.mktemp("resumed")
        for name in ("step0", f"step{DAMAGED}"):
            shutil.copytree(reference / name, save / name)
        if damage is not None:
            DAMAGES[damage](save / f"step{DAMAGED}" / part)
        saves[case] = str(save)
    per_rank = run_distributed_test(_resume_each, args=(saves,), timeout=60 + 30 * len(saves))
    return {**outcomes, **{case: [rank[case] for rank in per_rank] for case in saves}}


def _same(a: Any, b: Any) -> bool:
    """Equal bit for bit, through dicts and lists of tensors (optimizer state dicts)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)


def _assert_same_run(resumed: list[Any], uninterrupted: list[dict[str, Any]]) -> None:
    for rank, (run, reference) in enumerate(zip(resumed, uninterrupted, strict=True)):
        assert isinstance(run, dict), (rank, run)  # else the error it raised
        assert run["loaded"] == ["step0"], (rank, run["loaded"])
        adam_steps = {float(s["step"]) for s in run["optim"]["state"].values()}
        assert adam_steps == {float(STEPS)}, (rank, adam_steps)
        assert _same(run["optim"], reference["optim"]), rank
        assert all(torch.equal(a, b) for a, b in zip(run["params"], reference["params"])), rank


@pytest.mark.parametrize("case", list(CASES))
def test_a_fallback_to_step0_is_the_run_from_step0(runs: dict[str, list[Any]], case: str) -> None:
    _assert_same_run(runs[case], runs[""])


def test_a_marker_garbled_in_one_ranks_view_makes_every_rank_fall_back(
    runs: dict[str, list[Any]],
) -> None:
    resumed = runs[VIEW_CASE]
    _assert_same_run(resumed, runs[""])
    assert resumed[0]["warnings"] == resumed[1]["warnings"]  # one decision, one reason
    (warning,) = resumed[0]["warnings"]
    assert "marker" in warning and "(as rank 1 sees it)" in warning, warning


def test_a_garbled_tensor_is_found_by_its_crc(tmp_path: Path) -> None:
    model = TinyCausalLM(vocab_size=64, d_model=32, n_layers=1, n_heads=2, max_seq_len=16)
    save_model_and_optim_state(tmp_path, model, thread_count=1)
    _garble(tmp_path / "__0_0.distcp")
    with pytest.raises(DamagedCheckpointError) as error:  # one line, not DCP's exception
        load_model_and_optim_state(tmp_path, model)
    message = str(error.value)
    assert message.startswith("__0_0.distcp") and "garbled" in message, message
