"""prepare_training_environment without a launcher, logging filters, seeding, RNG state."""

from __future__ import annotations

import logging
import os
import random
import subprocess

import numpy as np
import preloaded_python
import pytest
import torch
import torch.distributed as dist
from testutils import patient

from olmolike.distributed import failure, teardown
from olmolike.distributed.parallel import DataParallelConfig, DataParallelType
from olmolike.exceptions import ConfigurationError
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


# A single-process FSDP run started without a launcher (`python train.py`): its mesh needs a
# one-rank group, which the build starts itself. In a subprocess: the group lives for the run.
_SINGLE_PROCESS_FSDP = """
import tempfile, torch
from olmolike.data import TokenTensorDataLoader
from olmolike.distributed.parallel import DataParallelConfig, DataParallelType
from olmolike.distributed.utils import is_distributed
from olmolike.nn import TransformerConfig
from olmolike.optim import AdamWConfig
from olmolike.train import (
    Duration, TrainerConfig, prepare_training_environment, teardown_training_environment,
)
from olmolike.train.train_module import TransformerTrainModuleConfig

prepare_training_environment(seed=0)
assert not is_distributed()
model = TransformerConfig.from_preset("tiny", 64, max_sequence_length=16).build(init_device="meta")
module = TransformerTrainModuleConfig(
    rank_microbatch_size=64, optim=AdamWConfig(lr=1e-3),
    dp_config=DataParallelConfig(name=DataParallelType.fsdp),
).build(model)
data = torch.randint(0, 64, (16, 16), generator=torch.Generator().manual_seed(0))
trainer = TrainerConfig(
    save_folder=tempfile.mkdtemp(), max_duration=Duration.steps(2), no_checkpoints=True
).build(module, TokenTensorDataLoader(data, global_batch_size=128))
trainer.fit()
assert torch.distributed.get_world_size() == 1
teardown_training_environment()
assert not is_distributed()
print("FSDP-OK")
"""


def test_fsdp_in_a_single_process_without_a_launcher_starts_its_own_group() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run(
        [*preloaded_python.command(), "-c", _SINGLE_PROCESS_FSDP],
        env=env,
        capture_output=True,
        text=True,
        timeout=patient(120),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "FSDP-OK" in result.stdout


def test_under_a_launcher_fsdp_without_prepare_training_environment_is_one_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigurationError, match="call prepare_training_environment"):
        DataParallelConfig(name=DataParallelType.fsdp).build_mesh("cpu")
    assert not torch.distributed.is_initialized()
