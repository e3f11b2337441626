"""Checkpoints on two gloo ranks: exact resume with DDP and FSDP2, and changes of world size."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from testutils import build_trainer, full_params, run_distributed_test

from olmolike.train import Callback, Duration
from olmolike.train.checkpoint import Checkpointer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 10


@dataclass
class Record(Callback):
    losses: dict[int, float] = field(default_factory=dict)
    batches: dict[int, torch.Tensor] = field(default_factory=dict)
    cancel_at: int | None = None

    def pre_step(self, batch: dict[str, Any]) -> None:
        self.batches[self.trainer.global_step] = batch["input_ids"].clone()

    def post_step(self) -> None:
        if self.trainer.global_step == self.cancel_at:
            self.trainer.cancel_run("stopping for the test", no_sync=True)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if "train/CE loss" in metrics:
            self.losses[step] = metrics["train/CE loss"]


def run(
    save: str,
    fsdp: bool,
    steps: int = STEPS,
    cancel_at: int | None = None,
    load_path: str | None = None,
    no_checkpoints: bool = False,
) -> dict[str, Any]:
    record = Record(cancel_at=cancel_at)
    trainer = build_trainer(
        save,
        num_instances=48,
        fsdp=fsdp,
        max_duration=Duration.steps(steps),
        load_path=load_path,
        no_checkpoints=no_checkpoints,
    )
    trainer.add_callback("record", record)
    trainer.fit()
    return {
        "losses": record.losses,
        "batches": record.batches,
        "params": full_params(trainer),
        "step": trainer.global_step,
        "loaded": trainer.checkpoint_loaded,
    }


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The uninterrupted run of ``STEPS`` steps (saving nothing) with DDP or FSDP2, each run
    once for the tests that compare with it."""
    runs: dict[bool, list[dict[str, Any]]] = {}

    def get(fsdp: bool) -> list[dict[str, Any]]:
        if fsdp not in runs:
            save = str(tmp_path_factory.mktemp("full"))
            runs[fsdp] = run_distributed_test(run, args=(save, fsdp, STEPS, None, None, True))
        return runs[fsdp]

    return get


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp2"])
def test_interrupted_and_resumed_run_matches_the_uninterrupted_one(
    tmp_path: Path, fsdp: bool, uninterrupted: Any
) -> None:
    full = uninterrupted(fsdp)
    first = run_distributed_test(run, args=(str(tmp_path / "split"), fsdp, STEPS, 4))
    assert Checkpointer.latest_checkpoint(tmp_path / "split").endswith("step4")
    second = run_distributed_test(run, args=(str(tmp_path / "split"), fsdp))
    for rank in (0, 1):
        assert second[rank]["loaded"] and sorted(second[rank]["losses"]) == list(
            range(5, STEPS + 1)
        )
        assert {**first[rank]["losses"], **second[rank]["losses"]} == full[rank]["losses"]
        assert all(torch.equal(a, b) for a, b in zip(second[rank]["params"], full[rank]["params"]))


def global_batch(per_rank: list[dict[str, Any]], step: int) -> torch.Tensor:
    return torch.cat([r["batches"][step] for r in per_rank])


def test_two_ranks_to_one_and_back(tmp_path: Path) -> None:
    two = run_distributed_test(run, args=(str(tmp_path / "two"), False, 4))
    reference = run_distributed_test(run, args=(str(tmp_path / "reference"), False, 8))

    # 2 ranks -> 1 rank: the same weights exactly, and the next global batches are the ones
    # two ranks would have seen together.
    one = build_trainer(tmp_path / "two", num_instances=48, max_duration=Duration.steps(8))
    assert one.maybe_load_checkpoint() and one.global_step == 4
    assert all(torch.equal(a, b) for a, b in zip(full_params(one), two[0]["params"]))
    record = Record()
    one.add_callback("record", record)
    one.fit()
    assert sorted(record.batches) == [5, 6, 7, 8]
    for step in (5, 6, 7, 8):
        assert torch.equal(record.batches[step], global_batch(reference, step))
        # Same data and weights; only the order of floating-point reductions differs.
        assert record.losses[step] == pytest.approx(reference[0]["losses"][step], rel=1e-3)

    # 1 rank -> 2 ranks, sharded with FSDP2 this time: resharded weights and data position.
    saved_by_one = str(tmp_path / "two" / "step8")
    back = run_distributed_test(run, args=(str(tmp_path / "back"), True, 8, None, saved_by_one))
    for rank in back:
        assert rank["loaded"] and rank["step"] == 8 and not rank["losses"]
        assert all(torch.equal(a, b) for a, b in zip(rank["params"], full_params(one)))


@dataclass
class KillAfter(Callback):
    """SIGKILLs this rank at the end of a step: no graceful stop, no final checkpoint."""

    step_to_die: int = 0

    def post_step(self) -> None:
        if self.trainer.global_step == self.step_to_die:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGKILL)


def killed_run(save: str) -> None:
    trainer = build_trainer(save, num_instances=48, fsdp=True, max_duration=Duration.steps(STEPS))
    trainer.add_callback("die", KillAfter(step_to_die=6))
    trainer.callbacks["checkpointer"].save_interval = 4  # type: ignore[attr-defined]
    # Synchronous: step 4's checkpoint is complete before step 5 starts, whatever the load.
    trainer.callbacks["checkpointer"].save_async = False  # type: ignore[attr-defined]
    trainer.fit()


def test_sigkill_after_a_checkpoint_then_resume_with_fsdp2(
    tmp_path: Path, uninterrupted: Any
) -> None:
    from testutils import run_distributed

    full = uninterrupted(True)
    outcomes = run_distributed(killed_run, args=(str(tmp_path / "split"),))
    assert [o.exitcode for o in outcomes] == [-9, -9]
    assert Checkpointer.latest_checkpoint(tmp_path / "split").endswith("step4")
    resumed = run_distributed_test(run, args=(str(tmp_path / "split"), True))
    for rank in (0, 1):
        assert sorted(resumed[rank]["losses"]) == list(range(5, STEPS + 1))
        assert all(
            resumed[rank]["losses"][s] == full[rank]["losses"][s] for s in range(5, STEPS + 1)
        )
        assert all(torch.equal(a, b) for a, b in zip(resumed[rank]["params"], full[rank]["params"]))
