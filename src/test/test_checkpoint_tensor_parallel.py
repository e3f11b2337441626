"""OLMo-core's tensor-parallel save/load test on olmolike's functional checkpoint API.

A feed-forward block sharded with ``parallelize_module`` (DTensor) on 2 gloo ranks is saved
with ``save_model_and_optim_state`` (or its async twin), loaded into a second sharded copy
and into an unsharded one. Each rank's process must also end cleanly: DTensor's collectives
leave gloo work behind, and a rank that exits while a gloo worker still releases it aborts
(SIGABRT) after the test passed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from olmolike.distributed.checkpoint import (
    async_save_model_and_optim_state,
    load_model_and_optim_state,
    save_model_and_optim_state,
)
from olmolike.testing import BACKENDS, run_distributed_test
from olmolike.utils import get_default_device


class FeedForward(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.dim = dim
        self.w1 = nn.Linear(dim, dim)
        self.w2 = nn.Linear(dim, dim)
        self.w3 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def _sharded_feed_forward() -> tuple[FeedForward, torch.optim.Optimizer]:
    mesh = init_device_mesh(get_default_device().type, (dist.get_world_size(),))
    model = FeedForward().to(get_default_device())
    # Colwise takes replicated inputs, Rowwise gives replicated outputs.
    plan = {"w1": ColwiseParallel(), "w2": RowwiseParallel(), "w3": ColwiseParallel()}
    parallelize_module(model, mesh, plan)  # type: ignore[arg-type]
    return model, torch.optim.AdamW(model.parameters())


def run_save_and_load_tensor_parallel_model(
    dir: Path, take_step_before_checkpoint: bool, run_async: bool
) -> None:
    model, optim = _sharded_feed_forward()
    if take_step_before_checkpoint:
        model(torch.rand((2, model.dim), device=get_default_device())).sum().backward()
        optim.step()
        optim.zero_grad(set_to_none=True)

    if run_async:
        async_save_model_and_optim_state(dir, model, optim).result()
    else:
        save_model_and_optim_state(dir, model, optim)

    model2, optim2 = _sharded_feed_forward()
    load_model_and_optim_state(dir, model2, optim2)
    torch.testing.assert_close(model.state_dict(), model2.state_dict())
    torch.testing.assert_close(optim.state_dict(), optim2.state_dict())

    # Another topology: the same checkpoint into an unsharded model.
    unsharded = FeedForward().to(get_default_device())
    load_model_and_optim_state(dir, unsharded, torch.optim.AdamW(unsharded.parameters()))


def case_name(take_step_before_checkpoint: bool, run_async: bool) -> str:
    return f"{'async' if run_async else 'sync'}-{'after' if take_step_before_checkpoint else 'pre'}-step"


CASES = {
    case_name(step, run_async): (step, run_async)
    for run_async in (True, False)
    for step in (True, False)
}


def run_every_case(root: Path) -> None:
    """Every case in turn on these ranks, each in a folder of its own, where each rank writes
    ``ok`` or its error. The ranks agree after each case: once one failed, the rest are not run
    (their collectives would no longer match)."""
    rank = dist.get_rank()
    for name, (take_step_before_checkpoint, run_async) in CASES.items():
        folder = root / name
        folder.mkdir(exist_ok=True)
        try:
            run_save_and_load_tensor_parallel_model(
                folder / "checkpoint", take_step_before_checkpoint, run_async
            )
            outcome = "ok"
        except Exception as e:
            outcome = f"{type(e).__name__}: {e}"
        (folder / f"rank{rank}").write_text(outcome)
        outcomes: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, outcome)
        if any(o != "ok" for o in outcomes):
            return


@pytest.fixture(scope="module")
def spawned() -> dict[str, tuple[Path, str | None]]:
    """Per backend: the folder of one spawned group that ran every case, and how it ended
    (None: every rank exited cleanly). Spawned (not forked from the tests' server): the ranks
    end as an interpreter does, where a gloo worker left releasing DTensor's work aborts."""
    return {}


@pytest.mark.timeout(600)  # the first test of a backend runs every case
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "take_step_before_checkpoint",
    [pytest.param(True, id="after-step"), pytest.param(False, id="pre-step")],
)
@pytest.mark.parametrize(
    "run_async", [pytest.param(True, id="async"), pytest.param(False, id="sync")]
)
def test_save_and_load_tensor_parallel_model(
    backend: str,
    take_step_before_checkpoint: bool,
    run_async: bool,
    spawned: dict[str, tuple[Path, str | None]],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Each case runs in the group that ran every case of its backend (one spawn of 2 ranks,
    ~6 CPU s each, instead of four): the case passed on both ranks, and the ranks ended
    cleanly after the last case."""
    if backend not in spawned:
        root = tmp_path_factory.mktemp("tensor_parallel_checkpoints")
        try:
            run_distributed_test(
                run_every_case, backend=backend, start_method="spawn", func_args=(root,)
            )
            spawned[backend] = (root, None)
        except Exception as e:
            spawned[backend] = (root, f"{type(e).__name__}: {e}")
    root, ended = spawned[backend]
    name = case_name(take_step_before_checkpoint, run_async)
    for rank in range(2):
        result = root / name / f"rank{rank}"
        assert result.exists(), f"rank {rank} did not run {name} (an earlier case failed): {ended}"
        assert result.read_text() == "ok", f"rank {rank}: {result.read_text()}"
    assert ended is None, ended
