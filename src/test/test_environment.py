"""prepare_training_environment without a launcher, logging filters, seeding, RNG state."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch
import torch.distributed as dist

from olmolike.distributed import failure, teardown
from olmolike.train import prepare_training_environment, teardown_training_environment
from olmolike.utils import LogFilterType, _RankFilter, get_rng_state, set_rng_state


def test_single_process_without_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    prepare_training_environment(seed=42)
    assert not torch.distributed.is_initialized()
    first = torch.rand(3)
    prepare_training_environment(seed=42)
    assert torch.equal(first, torch.rand(3))
    teardown_training_environment()


def test_after_this_rank_failed_the_teardown_skips_its_barriers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In a ``finally:`` on the way out of an error the other ranks may be gone: a barrier
    would fail (and its error hide the real one) or wait for the whole timeout."""
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    monitor = failure.RankFailureMonitor(store, 0)  # reports, without its watching thread
    monkeypatch.setattr(failure, "_monitor", monitor)
    monkeypatch.setattr(failure, "_stopped_monitor", None)
    monkeypatch.setattr(teardown, "barrier_every_group", lambda: pytest.fail("a barrier"))
    monitor.report(RuntimeError("this rank crashed"))
    teardown_training_environment()
    assert not dist.is_initialized()


def _record(level: int) -> logging.LogRecord:
    return logging.LogRecord("olmolike", level, __file__, 1, "message", None, None)


@pytest.mark.parametrize(
    ("filter_type", "rank", "local_rank", "info_shown"),
    [
        (LogFilterType.rank0_only, 0, 0, True),
        (LogFilterType.rank0_only, 3, 0, False),
        (LogFilterType.local_rank0_only, 3, 0, True),
        (LogFilterType.local_rank0_only, 3, 1, False),
        (LogFilterType.all_ranks, 5, 1, True),
    ],
)
def test_rank_filter(
    monkeypatch: pytest.MonkeyPatch,
    filter_type: LogFilterType,
    rank: int,
    local_rank: int,
    info_shown: bool,
) -> None:
    monkeypatch.setattr("olmolike.utils.get_rank", lambda: rank)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    rank_filter = _RankFilter(filter_type)
    assert rank_filter.filter(_record(logging.INFO)) is info_shown
    assert rank_filter.filter(_record(logging.WARNING))  # warnings always pass


def test_rng_state_round_trip() -> None:
    state = get_rng_state()
    expected = (random.random(), float(np.random.rand()), torch.rand(2))
    random.random()
    set_rng_state(state)
    again = (random.random(), float(np.random.rand()), torch.rand(2))
    assert expected[:2] == again[:2] and torch.equal(expected[2], again[2])
    torch.save(state, "/dev/null")  # plain values and tensors only


def test_rng_state_loads_with_weights_only(tmp_path: object) -> None:
    import io as std_io

    buffer = std_io.BytesIO()
    torch.save(get_rng_state(), buffer)
    expected = (random.random(), float(np.random.rand()), torch.rand(2))
    buffer.seek(0)
    set_rng_state(torch.load(buffer, weights_only=True))
    again = (random.random(), float(np.random.rand()), torch.rand(2))
    assert expected[:2] == again[:2] and torch.equal(expected[2], again[2])
