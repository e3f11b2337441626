"""olmolike.testing.run_distributed_test and BACKENDS, with OLMo-core's signature."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing import ProcessRaisedException

from olmolike.distributed.utils import get_rank, get_world_size
from olmolike.testing import BACKENDS, run_distributed_test


def _sum_of_ranks(expected: float, *, scale: float = 1.0) -> None:
    value = torch.tensor(float(get_rank()) * scale)
    dist.all_reduce(value)
    assert get_world_size() == 2 and value.item() == expected


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_runs_on_every_rank_with_args(backend: str) -> None:
    run_distributed_test(
        _sum_of_ranks, backend=backend, func_args=(2.0,), func_kwargs={"scale": 2.0}, timeout=90
    )


def _fail_on_rank_1() -> None:
    if get_rank() == 1:
        raise ValueError("rank 1 fails")


@pytest.mark.timeout(120)
def test_a_failing_rank_fails_the_test() -> None:
    with pytest.raises(ProcessRaisedException, match="rank 1 fails"):
        run_distributed_test(_fail_on_rank_1, start_method="spawn", timeout=90)


def _waits_forever() -> None:
    threading.Event().wait()  # as a rank stuck on a dead peer would


@pytest.mark.timeout(120)
def test_a_hang_is_a_timeout_not_a_hang() -> None:
    with pytest.raises(TimeoutError, match="did not finish within 10s"):
        run_distributed_test(_waits_forever, timeout=10)


def test_backends_param_ids() -> None:
    assert [p.id for p in BACKENDS] == ["backend=GLOO", "backend=NCCL"]
