"""olmolike.train.utils (metric reduction, RNG states) and the loss/progress helpers of
olmolike.train.common, under OLMo-core's names."""

from __future__ import annotations

import math
import random
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
from testutils import run_distributed_test

from olmolike.train import ReduceType
from olmolike.train.common import (
    TrainingProgress,
    get_inputs_for_loss,
    get_labels,
    reshape_inputs_for_loss,
)
from olmolike.train.utils import (
    EnvRngStates,
    LibRngState,
    check_metrics_consistent,
    move_metrics,
    reduce_metrics,
)
from olmolike.utils import format_float, format_int, format_timedelta, move_to_device

REDUCE_TYPES = {
    "train/loss": ReduceType.mean,
    "train/rank": ReduceType.max,
    "train/lowest": ReduceType.min,
    "train/count": ReduceType.sum,
    "optim/local": None,
    "optim/norm": ReduceType.l2_norm,
}


def _rank_metrics(rank: int) -> dict[int, dict[str, torch.Tensor]]:
    return {
        3: {
            "train/loss": torch.tensor(4.0),
            "train/count": torch.tensor(1.0),
            "optim/local": torch.tensor(10.0 + rank),
        },
        4: {
            "train/loss": torch.tensor(1.0 if rank == 0 else 3.0),
            "train/count": torch.tensor(float(rank)),
            "train/rank": torch.tensor(float(rank)),
            "train/lowest": torch.tensor(-1.5 if rank == 1 else 2.0),
            "optim/norm": torch.tensor(3.0 if rank == 0 else 4.0),
        },
    }


def _reduce_on_two_ranks() -> dict[int, dict[str, float]]:
    rank = dist.get_rank()
    assert check_metrics_consistent(REDUCE_TYPES)
    return reduce_metrics(_rank_metrics(rank), REDUCE_TYPES, torch.device("cpu"))


def test_reduce_metrics_over_two_ranks() -> None:
    results = run_distributed_test(_reduce_on_two_ranks, world_size=2, timeout=120)
    for rank, result in enumerate(results):
        assert result == {
            3: {"train/loss": 4.0, "train/count": 2.0, "optim/local": 10.0 + rank},
            4: {
                "train/loss": 2.0,
                "train/count": 1.0,
                "train/rank": 1.0,
                "optim/norm": 5.0,
                "train/lowest": -1.5,
            },
        }


def _reduce_inconsistent() -> tuple[bool, dict[int, dict[str, float]]]:
    rank = dist.get_rank()
    # Only rank 1 records "train/extra" (mean) and "train/peak" (max), and only at step 2.
    types: dict[str, ReduceType | None] = {"train/loss": ReduceType.mean}
    metrics = {1: {"train/loss": torch.tensor(2.0 * (rank + 1))}, 2: {}}
    if rank == 1:
        types |= {"train/extra": ReduceType.mean, "train/peak": ReduceType.max}
        metrics[2] = {"train/extra": torch.tensor(6.0), "train/peak": torch.tensor(-3.0)}
    consistent = check_metrics_consistent(types)
    return consistent, reduce_metrics(
        metrics, types, torch.device("cpu"), metrics_consistent=consistent
    )


def test_reduce_metrics_when_ranks_record_different_metrics() -> None:
    results = run_distributed_test(_reduce_inconsistent, world_size=2, timeout=120)
    for consistent, reduced in results:
        assert consistent is False
        # The mean is over the ranks that recorded the metric, not over the world.
        assert reduced == {1: {"train/loss": 3.0}, 2: {"train/extra": 6.0, "train/peak": -3.0}}


def test_reduce_metrics_single_process_returns_local_values() -> None:
    reduced = reduce_metrics(_rank_metrics(0), REDUCE_TYPES, torch.device("cpu"))
    assert reduced[4] == {
        "train/loss": 1.0,
        "train/count": 0.0,
        "train/rank": 0.0,
        "train/lowest": 2.0,
        "optim/norm": 3.0,
    }
    assert check_metrics_consistent(REDUCE_TYPES)


def test_move_metrics_keeps_order_and_moves_only_other_devices() -> None:
    meta = torch.device("meta")
    source = {
        2: {"b": torch.tensor(1.0), "a": torch.tensor(2.0, device=meta)},
        1: {"c": torch.tensor(3.0)},
    }
    moved = move_metrics(source, meta)
    assert list(moved) == [2, 1] and list(moved[2]) == ["b", "a"]
    assert all(t.device.type == "meta" for m in moved.values() for t in m.values())
    assert moved[2]["a"] is source[2]["a"]  # already there: not copied
    on_cpu = move_metrics({1: {"c": source[1]["c"]}}, torch.device("cpu"))
    assert on_cpu[1]["c"] is source[1]["c"]


def test_move_to_device_gives_a_new_batch_of_the_same_tensors_where_nothing_moves() -> None:
    cpu, meta = torch.device("cpu"), torch.device("meta")
    batch = {"input_ids": torch.ones(2, 3), "index": torch.arange(2)}
    moved = move_to_device(batch, cpu)
    assert moved is not batch  # a hook edits the step's batch, not the loader's
    assert moved.keys() == batch.keys() and all(moved[k] is batch[k] for k in batch)
    mixed = {"input_ids": torch.ones(2, 3, device=meta), "index": torch.arange(2)}
    moved = move_to_device(mixed, meta)
    assert moved["input_ids"] is mixed["input_ids"] and moved["index"].device == meta
    nested = {"pair": [torch.ones(1)], "n": 3}
    assert move_to_device(nested, meta)["pair"][0].device == meta


def test_env_rng_states_restore_reproduces_draws() -> None:
    states = EnvRngStates.current_state()
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    assert states.restore() is True
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first
    # Through a dict and back (lists instead of tuples): still restores.
    rebuilt = EnvRngStates.from_dict(states.as_dict())
    assert rebuilt.restore() is True
    assert random.random() == first[0]


def test_env_rng_states_skip_a_library_of_another_version() -> None:
    states = EnvRngStates.current_state()
    expected_torch = torch.rand(1).item()
    states.numpy = LibRngState(version=(0, 1), state=states.numpy.state)
    before_numpy = np.random.get_state()[1].copy()
    assert states.restore() is False  # numpy skipped ...
    assert torch.rand(1).item() == expected_torch  # ... the others restored
    assert (np.random.get_state()[1] == before_numpy).all()


def test_get_labels_shifts_and_masks() -> None:
    batch = {
        "input_ids": torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]),
        "label_mask": torch.tensor([[True, True, False, True], [True] * 4]),
        "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]),
        "instance_mask": torch.tensor([True, True]),
    }
    assert get_labels(batch).tolist() == [[2, -100, 4, -100], [6, 7, -100, -100]]
    batch["instance_mask"] = torch.tensor([True, False])
    assert get_labels(batch, label_ignore_index=-1)[1].tolist() == [-1, -1, -1, -1]
    assert get_labels({"input_ids": torch.tensor([[9, 8]])}).tolist() == [[8, -100]]


def test_get_inputs_for_loss_flattens_and_prefers_given_labels() -> None:
    logits = torch.randn(2, 3, 5)
    batch = {"input_ids": torch.tensor([[1, 2, 3], [4, 0, 1]])}
    flat_logits, labels = get_inputs_for_loss(batch, logits)
    assert flat_logits.shape == (6, 5) and torch.equal(flat_logits[4], logits[1, 1])
    assert labels.tolist() == [2, 3, -100, 0, 1, -100]
    batch["labels"] = torch.tensor([[7, 7, 7], [8, 8, 8]])
    assert get_inputs_for_loss(batch, logits)[1].tolist() == [7, 7, 7, 8, 8, 8]
    assert reshape_inputs_for_loss(logits, batch["labels"])[1].shape == (6,)
    loss = torch.nn.functional.cross_entropy(*get_inputs_for_loss(batch | {"labels": None}, logits))
    assert torch.isfinite(loss)


def test_training_progress_str() -> None:
    full = TrainingProgress(
        current_step=50,
        current_tokens=1_234_567,
        total_steps=200,
        time_remaining=timedelta(hours=1, minutes=2),
        bps=2.0,
        tps=12_345.6,
        mfu=41.5,
    )
    assert str(full) == "25% complete, step 50/200, 1.2M tokens, eta 1h, 2m, 12,345 TPS, 41.50% MFU"
    assert str(TrainingProgress(current_step=7)) == "step 7/???"
    assert str(TrainingProgress(3, total_steps=3, bps=0.5)) == "100% complete, step 3/3, 0.5000 BPS"


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0.0, "0.0"),
        (0.5, "0.5000"),
        (1.5, "1.500"),
        (12.345, "12.35"),
        (123.45, "123.5"),
        (12_345.6, "12,345"),
        (2.5e9, "2.500B"),
        (1.5e15, "1.500P"),
        (3e-6, "3.00E-06"),
        (math.inf, "inf"),
        (math.nan, "nan"),
    ],
)
def test_format_float(value: float, text: str) -> None:
    assert format_float(value) == text


def test_format_int_and_timedelta() -> None:
    assert [format_int(n) for n in (999, 1000, 1500, 2_000_000, 3_100_000_000)] == [
        "999",
        "1K",
        "1.5K",
        "2M",
        "3.1B",
    ]
    assert format_timedelta(timedelta(days=1, seconds=3725)) == "1d, 1h, 2m, 5s"
    assert format_timedelta(timedelta()) == "0s"
