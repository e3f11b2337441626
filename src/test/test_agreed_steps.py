"""Decisions that change which collectives run are taken at a step every rank agrees on.

Real 2-rank gloo runs: a result that lands late on one rank, a metric only one rank records,
two threads on one group, a collective one rank never joins.
"""

from __future__ import annotations

import datetime
import random
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from testutils import build_trainer, run_distributed, run_distributed_test

from olmolike.distributed.utils import (
    GroupMisuseError,
    get_rank,
    group_timeout,
    new_group,
    using_group,
)
from olmolike.exceptions import MetricError
from olmolike.train import Callback, Duration, ReduceType
from olmolike.train.callbacks.checkpointer import CheckpointerCallback
from olmolike.train.callbacks.reproducibility_check import ReproducibilityCheckCallback
from olmolike.train.callbacks.stability import StabilityMonitorCallback
from olmolike.train.checkpoint import Checkpointer
from olmolike.train.metrics import MetricBuffer, reduce_collected

TIMEOUT = 150.0


@dataclass
class Values(Callback):
    """Records ``values[step - 1]`` as the metric ``fake`` and notes when metrics arrive."""

    values: list[float] = field(default_factory=list)
    delivered: list[tuple[int, int]] = field(default_factory=list)
    """(the step being trained when metrics arrived, the step they belong to)."""

    def post_step(self) -> None:
        step = self.trainer.global_step
        if step <= len(self.values):
            self.trainer.record_metric("fake", self.values[step - 1], ReduceType.mean)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if "fake" in metrics:
            self.delivered.append((self.trainer.global_step, step))


def _delay_reduction_on_rank(trainer: Any, rank: int, at_step: int, seconds: float) -> None:
    """Make this rank's bookkeeping thread sit ``seconds`` on the result of one reduction."""
    if get_rank() != rank:
        return
    submit = trainer._bookkeeping.submit

    def run_bookkeeping_op(op: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("op_name") == "reduce_metrics" and trainer.global_step == at_step:

            def late(*a: Any, **k: Any) -> Any:
                result = op(*a, **k)
                time.sleep(seconds)
                return result

            return submit(late, *args, **kwargs)
        return submit(op, *args, **kwargs)

    trainer._bookkeeping.submit = run_bookkeeping_op


def _nan_seen_late_on_rank_1(folder: str) -> tuple[list[tuple[int, int]], list[int]]:
    values = [2.0, 2.0, float("nan"), 2.0, 2.0, 2.0, 2.0, 2.0]
    recorder = Values(values=values)
    trainer = build_trainer(
        folder,
        num_instances=32,
        instances_per_batch=4,
        max_duration=Duration.steps(len(values)),
        metrics_collect_interval=1,
        callbacks={
            "values": recorder,
            "stability": StabilityMonitorCallback(loss_metric="fake", guard_checkpoints=False),
            "checkpointer": CheckpointerCallback(save_interval=1, pre_train_checkpoint=False),
        },
    )
    _delay_reduction_on_rank(trainer, rank=1, at_step=3, seconds=0.5)
    trainer.fit()
    steps = [step for step, _ in Checkpointer.find_checkpoints(folder)]
    return recorder.delivered, steps


def test_a_nan_that_reaches_one_rank_late_stops_the_saves_of_every_rank_at_the_same_step(
    tmp_path: Path,
) -> None:
    """Rank 1 gets step 3's metrics 0.5 s late; the monitor then disables checkpoints (a save
    is collective). Delivered whenever they land, rank 0 would skip a save rank 1 still makes."""
    results = run_distributed_test(_nan_seen_late_on_rank_1, args=(str(tmp_path),), timeout=TIMEOUT)
    (delivered_0, saved), (delivered_1, _) = results
    assert delivered_0 == delivered_1
    # Each collection (every step here) reaches the callbacks at the end of the next step.
    assert delivered_0 == [(step + 1, step) for step in range(1, 8)] + [(8, 8)]
    assert saved == [1, 2, 3, 4]  # step 3's NaN arrives at the end of step 4, after its save


def _records_in_post_epoch_on_rank_0(folder: str) -> list[float]:
    got: list[float] = []

    @dataclass
    class RankZeroSummary(Callback):
        def post_epoch(self) -> None:
            if get_rank() == 0:
                self.trainer.record_metric("summary", 7.0, ReduceType.max)

        def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
            if "summary" in metrics:
                got.append(metrics["summary"])

    trainer = build_trainer(
        folder,
        num_instances=16,
        instances_per_batch=4,
        max_duration=Duration.epochs(1),  # 4 steps, the last one a collection step
        metrics_collect_interval=2,
        no_checkpoints=True,
        callbacks={"summary": RankZeroSummary()},
    )
    trainer.fit()
    return got


def test_a_metric_only_rank_0_records_after_the_last_collection_is_reduced_on_every_rank(
    tmp_path: Path,
) -> None:
    results = run_distributed_test(
        _records_in_post_epoch_on_rank_0, args=(str(tmp_path),), timeout=TIMEOUT
    )
    assert results == [[7.0], [7.0]]


@dataclass
class SubmitsInPostTrain(Callback):
    fail: bool = False
    seen: list[float] = field(default_factory=list)

    def post_train(self) -> None:
        self.trainer.record_metric("final", 3.0, ReduceType.mean)
        if self.fail:
            self.trainer.run_bookkeeping_op(_fail, op_name="final upload")

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if "final" in metrics:
            self.seen.append(metrics["final"])


def _fail() -> None:
    raise OSError("the final upload failed")


@pytest.mark.parametrize("fail", [False, True])
def test_ops_and_metrics_submitted_in_post_train_run_and_raise(tmp_path: Path, fail: bool) -> None:
    callback = SubmitsInPostTrain(fail=fail)
    trainer = build_trainer(
        tmp_path,
        num_instances=8,
        instances_per_batch=4,
        max_duration=Duration.steps(2),
        no_checkpoints=True,
        callbacks={"final": callback},
    )
    if not fail:
        trainer.fit()
        assert callback.seen == [3.0]  # reduced and delivered before fit() returns
        return
    with pytest.raises(OSError, match="the final upload failed"):
        trainer.fit()


@dataclass
class SubmitsInClose(Callback):
    def close(self) -> None:
        self.trainer.run_bookkeeping_op(_fail, op_name="close upload")


def test_an_op_submitted_in_close_runs_and_its_error_is_raised(tmp_path: Path) -> None:
    trainer = build_trainer(
        tmp_path,
        num_instances=8,
        instances_per_batch=4,
        max_duration=Duration.steps(2),
        no_checkpoints=True,
        callbacks={"closer": SubmitsInClose()},
    )
    with pytest.raises(OSError, match="the final upload failed"):
        trainer.fit()


def _async_saves_with_reproducibility_check(folder: str) -> int:
    trainer = build_trainer(
        folder,
        num_instances=32,
        instances_per_batch=4,
        max_duration=Duration.steps(8),
        callbacks={
            "checkpointer": CheckpointerCallback(save_interval=2, save_async=True),
            "check": ReproducibilityCheckCallback(),
        },
    )
    trainer.fit()
    return trainer.global_step


def test_async_saves_and_the_reproducibility_check_use_different_groups(tmp_path: Path) -> None:
    """The check loads (DCP collectives) on the training thread while the next async save
    runs collectives in the background: on one shared group, 2 ranks hang."""
    results = run_distributed_test(
        _async_saves_with_reproducibility_check, args=(str(tmp_path),), timeout=TIMEOUT
    )
    assert results == [8, 8]


def _two_threads_on_one_group() -> str:
    group = new_group("shared")
    inside, release = threading.Event(), threading.Event()

    def hold() -> None:
        with using_group(group, "shared"):
            inside.set()
            release.wait(60)

    holder = threading.Thread(target=hold, name="holder")
    holder.start()
    assert inside.wait(60)
    try:
        with pytest.raises(GroupMisuseError) as info, using_group(group, "shared"):
            pass
    finally:
        release.set()
        holder.join()
    with using_group(group, "shared"), using_group(group, "shared"):  # reentrant, then free
        pass
    return str(info.value)


def test_the_debug_check_fails_loudly_when_two_threads_use_one_group() -> None:
    messages = run_distributed_test(_two_threads_on_one_group, world_size=1, timeout=TIMEOUT)
    assert "'holder'" in messages[0] and "'MainThread'" in messages[0]


def _timeouts(folder: str) -> tuple[float, float, float, float, float]:
    trainer = build_trainer(
        folder,
        num_instances=16,
        instances_per_batch=4,
        max_duration=Duration.steps(2),
        no_checkpoints=True,
        train_timeout_seconds=4,
    )
    before = group_timeout(trainer.bookkeeping_pg).total_seconds()
    checkpointer_before = group_timeout(trainer.checkpointer.process_group).total_seconds()
    trainer.fit()
    after = [
        group_timeout(group).total_seconds()
        for group in (None, trainer.bookkeeping_pg, trainer.checkpointer.process_group)
    ]
    return (before, checkpointer_before, *after)  # type: ignore[return-value]


def test_every_group_has_the_run_timeout_then_the_train_timeout(tmp_path: Path) -> None:
    results = run_distributed_test(_timeouts, args=(str(tmp_path),), timeout=TIMEOUT)
    # prepare_training_environment's default timeout is 15 minutes (not torch's 30); the
    # checkpointer's group keeps it (ranks wait at its barriers while others upload).
    assert results == [(900.0, 900.0, 4.0, 4.0, 900.0)] * 2


def _a_collective_only_rank_0_joins() -> str:
    group = new_group("bookkeeping")
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=3), group)
    if get_rank() == 1:
        dist.barrier()  # waits for rank 0 on the default group, not on ``group``
        return ""
    try:
        dist.all_reduce(torch.ones(1), group=group)
    except RuntimeError as e:
        message = str(e)
    else:
        message = "no error"
    dist.barrier()
    return message


def test_a_collective_one_rank_never_joins_fails_within_the_group_timeout() -> None:
    outcomes = run_distributed(_a_collective_only_rank_0_joins, timeout=TIMEOUT)
    assert outcomes[0].error is None, outcomes[0].error
    assert "timed out" in outcomes[0].result.lower() or "timeout" in outcomes[0].result.lower()


def _crc32_twins() -> tuple[str, str]:
    """Two metric names whose key lists have the same crc32 (a collision found by search)."""
    seen: dict[int, str] = {}
    rng = random.Random(0)
    for _ in range(1 << 20):
        name = f"metric/{rng.getrandbits(64):016x}"
        digest = zlib.crc32(repr([(1, name, "mean")]).encode())
        if digest in seen:
            return seen[digest], name
        seen[digest] = name
    raise AssertionError("no collision found")


def _reduce(per_rank: list[list[tuple[int, str, float, str]]]) -> Any:
    buffer = MetricBuffer()
    for step, name, value, reduce_type in per_rank[get_rank()]:
        buffer.begin_step(step)
        buffer.record(step, name, value, ReduceType(reduce_type))
    group = new_group("metrics")
    try:
        return reduce_collected(buffer.collect(), group, torch.device("cpu"))
    except MetricError as e:
        return f"MetricError: {e}"


def test_ranks_agree_on_metric_keys_exactly_even_when_their_crc32_collide() -> None:
    a, b = _crc32_twins()
    per_rank = [[(1, a, 1.0, "mean")], [(1, b, 5.0, "mean")]]
    results = run_distributed_test(_reduce, args=(per_rank,), timeout=TIMEOUT)
    assert results == [{1: {a: 1.0, b: 5.0}}] * 2


def test_reduce_types_that_differ_in_different_steps_of_one_collection_raise() -> None:
    per_rank = [[(1, "x", 1.0, "mean"), (2, "y", 1.0, "sum")], [(2, "x", 5.0, "sum")]]
    results = run_distributed_test(_reduce, args=(per_rank,), timeout=TIMEOUT)
    for result in results:
        assert isinstance(result, str) and "MetricError" in result and "'x'" in result
