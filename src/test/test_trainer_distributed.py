"""The trainer on two real gloo ranks (spawned processes on CPU)."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import tempfile
import textwrap
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import preloaded_python
import pytest
import torch
import torch.distributed as dist
from testutils import (
    SEQ_LEN,
    build_trainer,
    free_port,
    patient,
    run_distributed,
    run_distributed_test,
)

from olmolike.distributed.utils import broadcast_object
from olmolike.train import Callback, Duration, MetricMergeStrategy, ReduceType, StepSkipRange

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@dataclass
class Log(Callback):
    calls: list[str] = field(default_factory=list)
    logged: dict[int, dict[str, float]] = field(default_factory=dict)

    def pre_epoch(self) -> None:
        self.calls.append("pre_epoch")

    def pre_step(self, batch: dict[str, Any]) -> None:
        self.calls.append("pre_step")

    def pre_optim_step(self) -> None:
        self.calls.append("pre_optim_step")

    def post_step(self) -> None:
        self.calls.append("post_step")

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.logged[step] = metrics

    def post_epoch(self) -> None:
        self.calls.append("post_epoch")

    def post_train(self) -> None:
        self.calls.append("post_train")


def _fit(*callbacks: Callback, **kwargs: Any) -> Any:
    # Every rank must name the same save folder: rank 0 picks one and tells the others.
    save = kwargs.pop("save_folder", None) or broadcast_object(tempfile.mkdtemp())
    trainer = build_trainer(save, **kwargs)
    for i, cb in enumerate(callbacks):
        trainer.add_callback(f"cb{i}", cb)
    trainer.fit()
    return trainer


# -- metric reduction --------------------------------------------------------------------------


@dataclass
class RecordRankValues(Callback):
    """Records ``rank + 1`` under every reduce type, plus metrics only some ranks have."""

    def pre_optim_step(self) -> None:
        rank = dist.get_rank()
        value = torch.tensor(float(rank + 1))
        for reduce_type in ReduceType:
            self.trainer.record_metric(reduce_type.value, value, reduce_type, namespace="r")
        self.trainer.record_metric("none", value, None, namespace="r")
        self.trainer.record_metric("float_sum", float(rank + 1), ReduceType.sum, namespace="r")
        self.trainer.record_metric(
            "merged", value, ReduceType.mean, namespace="r", merge_strategy=MetricMergeStrategy.sum
        )
        self.trainer.record_metric(
            "merged",
            value * 10,
            ReduceType.mean,
            namespace="r",
            merge_strategy=MetricMergeStrategy.sum,
        )
        if rank == 0 and self.trainer.global_step % 2 == 0:
            self.trainer.record_metric("only_rank0", 5.0, ReduceType.mean, namespace="r")
        if rank == 1 and self.trainer.global_step == 3:
            self.trainer.record_metric("only_rank1_step3", 7.0, ReduceType.max, namespace="r")


def metric_reduction_worker() -> dict[int, dict[str, float]]:
    log = Log()
    _fit(RecordRankValues(), log, max_duration=Duration.steps(7), metrics_collect_interval=3)
    return log.logged


def test_metrics_reduce_across_ranks() -> None:
    rank0, rank1 = run_distributed_test(metric_reduction_worker)
    assert sorted(rank0) == sorted(rank1) == list(range(1, 8))
    for step in range(1, 8):
        for logged, rank in ((rank0, 0), (rank1, 1)):
            metrics = logged[step]
            assert metrics["r/mean"] == 1.5
            assert metrics["r/sum"] == 3.0
            assert metrics["r/max"] == 2.0
            assert metrics["r/l2_norm"] == pytest.approx(math.sqrt(1 + 4))
            assert metrics["r/none"] == rank + 1  # not reduced: each rank keeps its own
            assert metrics["r/float_sum"] == 3.0
            assert metrics["r/merged"] == (11 + 22) / 2  # merged per rank, then averaged
            # A metric only one rank records is reduced over the ranks that have it.
            assert ("r/only_rank0" in metrics) == (step % 2 == 0)
            if step % 2 == 0:
                assert metrics["r/only_rank0"] == 5.0
            assert ("r/only_rank1_step3" in metrics) == (step == 3)
        assert rank0[step]["train/CE loss"] == rank1[step]["train/CE loss"]


@dataclass
class ConflictingReduceTypes(Callback):
    def pre_optim_step(self) -> None:
        kind = ReduceType.sum if dist.get_rank() == 0 else ReduceType.max
        self.trainer.record_metric("conflict", 1.0, kind)


def conflicting_metrics_worker() -> None:
    _fit(ConflictingReduceTypes(), max_duration=Duration.steps(4), metrics_collect_interval=2)


def test_metric_with_different_reduce_types_on_ranks_fails_on_every_rank() -> None:
    outcomes = run_distributed(conflicting_metrics_worker)
    # Every rank fails. The error reaches each training thread at its next poll, so a rank may
    # instead see its peer exit first (in the next step's gradient all-reduce); at least one
    # rank reports the cause.
    assert all(o.error is not None and o.exitcode not in (0, -9) for o in outcomes), outcomes
    assert any("different reduce types" in (o.error or "") for o in outcomes)


def bookkeeping_group_worker() -> list[tuple[str, bool]]:
    """Which thread and group each Python-level all_reduce used during fit()."""
    seen: list[tuple[str, bool]] = []
    original = dist.all_reduce
    holder: dict[str, Any] = {}

    def spy(
        tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False
    ) -> Any:
        seen.append((threading.current_thread().name, group is holder["trainer"].bookkeeping_pg))
        return original(tensor, op=op, group=group, async_op=async_op)

    trainer = build_trainer(
        broadcast_object(tempfile.mkdtemp()),
        max_duration=Duration.steps(12),
        cancel_check_interval=4,
        no_checkpoints=True,  # only this test's own collectives are counted
    )
    holder["trainer"] = trainer
    dist.all_reduce = spy  # type: ignore[assignment]
    try:
        trainer.fit()
    finally:
        dist.all_reduce = original
    assert trainer.bookkeeping_pg is not None and trainer.bookkeeping_pg is not dist.group.WORLD
    return seen


def test_bookkeeping_collectives_run_on_their_own_group_and_thread() -> None:
    for seen in run_distributed_test(bookkeeping_group_worker):
        assert len(seen) >= 3 + 3  # metric collections and cancel checks
        assert all(
            thread.startswith("bookkeeping-collectives") and own_group for thread, own_group in seen
        )


# -- cancel ------------------------------------------------------------------------------------


@dataclass
class CancelOnRank(Callback):
    rank: int = 1
    at_step: int = 7
    how: str = "cancel_run"

    def post_step(self) -> None:
        if dist.get_rank() == self.rank and self.trainer.global_step == self.at_step:
            if self.how == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
            else:
                self.trainer.cancel_run(f"rank {self.rank} had enough")


def cancel_worker(how: str) -> tuple[int, bool, int | None, str | None, list[str], int | None]:
    log = Log()
    save = broadcast_object(tempfile.mkdtemp())
    trainer = build_trainer(save, max_duration=Duration.steps(100), cancel_check_interval=5)
    trainer.add_callback("cancel", CancelOnRank(how=how))
    trainer.add_callback("log", log)
    exit_code = None
    try:
        trainer.fit()
    except SystemExit as e:  # a run SIGTERM canceled (on any rank) exits 143 on every rank
        exit_code = int(e.code or 0)
    cancel = trainer._cancel
    return (
        trainer.global_step,
        trainer.is_canceled,
        cancel.canceling_rank,
        cancel.reason,
        log.calls[-1:],
        exit_code,
    )


@pytest.mark.parametrize("how", ["cancel_run", "sigterm"])
def test_cancel_on_one_rank_stops_all_ranks_at_the_same_step(how: str) -> None:
    results = run_distributed_test(cancel_worker, args=(how,))
    # Requested after step 7; the check at step 10 is resolved at the end of step 11.
    for step, canceled, canceling_rank, reason, last_call, exit_code in results:
        assert (step, canceled, canceling_rank) == (11, True, 1)
        assert reason == ("received SIGTERM" if how == "sigterm" else "rank 1 had enough")
        assert last_call == ["post_train"]
        assert exit_code == (143 if how == "sigterm" else None)


# -- failure -----------------------------------------------------------------------------------


@dataclass
class FailOnRank(Callback):
    def pre_step(self, batch: dict[str, Any]) -> None:
        if dist.get_rank() == 1 and self.trainer.global_step == 3:
            raise ValueError("boom on rank 1")


def failing_worker() -> None:
    _fit(FailOnRank(), max_duration=Duration.steps(100))


def test_a_failing_rank_does_not_leave_the_others_hanging() -> None:
    # A hang (rank 0 waiting forever on the dead rank) ends in run_distributed's timeout,
    # which fails the test with the ranks' output.
    outcomes = run_distributed(
        failing_worker, env={"OLMOLIKE_RANK_FAILURE_GRACE_SECONDS": "2"}, timeout=90
    )
    assert outcomes[1].error is not None and "boom on rank 1" in outcomes[1].error
    assert all(o.exitcode not in (0, -9) for o in outcomes), [
        (o.rank, o.exitcode) for o in outcomes
    ]


@dataclass
class FailSlowlyOnRank1(Callback):
    """Rank 1 fails but stays alive in a slow error handler, so its sockets stay open and gloo
    cannot tell rank 0 (waiting in the step's gradient all-reduce) that anything is wrong."""

    def pre_step(self, batch: dict[str, Any]) -> None:
        if dist.get_rank() == 1 and self.trainer.global_step == 2:
            raise RuntimeError("rank 1 failed while rank 0 waits")

    def on_error(self, exc: BaseException) -> None:
        time.sleep(12)


def hanging_worker() -> None:
    _fit(FailSlowlyOnRank1(), max_duration=Duration.steps(100))


def test_peer_stuck_in_a_collective_is_ended_by_the_failure_monitor() -> None:
    from olmolike.distributed.failure import EXIT_CODE

    outcomes = run_distributed(
        hanging_worker, env={"OLMOLIKE_RANK_FAILURE_GRACE_SECONDS": "2"}, timeout=90
    )
    assert outcomes[1].error is not None and "rank 1 failed while rank 0 waits" in outcomes[1].error
    assert outcomes[0].exitcode == EXIT_CODE, outcomes[0]


# -- durations, skipping, hooks ----------------------------------------------------------------


def durations_worker(duration: Duration) -> tuple[int, int, int | None, int]:
    trainer = _fit(max_duration=duration)
    return trainer.global_step, trainer.global_train_tokens_seen, trainer.max_steps, trainer.epoch


@pytest.mark.parametrize(
    ("duration", "steps"),
    [
        (Duration.steps(5), 5),
        (Duration.tokens(2 * 8 * SEQ_LEN + 1), 3),
        (Duration.epochs(2), 16),
    ],
)
def test_durations_on_two_ranks(duration: Duration, steps: int) -> None:
    for step, tokens, max_steps, _ in run_distributed_test(durations_worker, args=(duration,)):
        assert step == max_steps == steps
        assert tokens == steps * 8 * SEQ_LEN  # global tokens, not per rank


def skipping_worker() -> tuple[list[str], list[torch.Tensor]]:
    snapshots: list[torch.Tensor] = []

    @dataclass
    class Snapshot(Callback):
        def post_step(self) -> None:
            snapshots.append(self.trainer.train_module.model.head.weight.detach().clone())  # type: ignore[attr-defined]

    log = Log()
    _fit(
        log,
        Snapshot(),
        num_instances=24,
        max_duration=Duration.epochs(2),
        steps_to_skip=[StepSkipRange(2, 4)],
    )
    return log.calls, snapshots


def test_hook_order_and_step_skipping_on_two_ranks() -> None:
    (calls0, snaps0), (calls1, snaps1) = run_distributed_test(skipping_worker)
    trained = ["pre_step", "pre_optim_step", "post_step"]
    skipped = ["pre_step", "post_step"]
    epoch1 = ["pre_epoch", *trained, *skipped, *skipped, "post_epoch"]
    epoch2 = ["pre_epoch", *trained * 3, "post_epoch"]
    assert calls0 == calls1 == [*epoch1, *epoch2, "post_train"]
    assert torch.equal(snaps0[0], snaps0[1]) and torch.equal(snaps0[1], snaps0[2])
    assert not torch.equal(snaps0[2], snaps0[3])
    assert all(torch.equal(a, b) for a, b in zip(snaps0, snaps1))  # DDP keeps ranks in sync


# -- torchrun ----------------------------------------------------------------------------------

TORCHRUN_SCRIPT = """
import sys
sys.path.insert(0, {test_dir!r})
import torch.distributed as dist
from testutils import build_trainer
from olmolike.train import Duration, prepare_training_environment, teardown_training_environment

if __name__ == "__main__":
    prepare_training_environment(seed=0)
    trainer = build_trainer({save!r}, max_duration=Duration.steps(4))
    trainer.fit()
    print(f"rank {{dist.get_rank()}} of {{dist.get_world_size()}} done at step {{trainer.global_step}}")
    teardown_training_environment()
"""


def test_the_same_script_runs_under_torchrun(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    test_dir = str(Path(__file__).parent)
    script.write_text(
        textwrap.dedent(TORCHRUN_SCRIPT.format(test_dir=test_dir, save=str(tmp_path / "run")))
    )
    torchrun = preloaded_python.torchrun("--nproc-per-node=2", f"--master-port={free_port()}")
    result = subprocess.run(
        [*torchrun, str(script)],
        capture_output=True,
        text=True,
        timeout=patient(120),
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rank 0 of 2 done at step 4" in result.stdout
    assert "rank 1 of 2 done at step 4" in result.stdout


def different_save_folders_worker() -> str:
    import torch.distributed as dist

    try:
        build_trainer(
            tempfile.mkdtemp(prefix=f"rank{dist.get_rank()}-"), max_duration=Duration.steps(1)
        )
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "built"


def test_ranks_with_different_save_folders_are_refused_at_build_time() -> None:
    for message in run_distributed_test(different_save_folders_worker):
        assert message.startswith("ConfigurationError: save_folder: differs between ranks")
