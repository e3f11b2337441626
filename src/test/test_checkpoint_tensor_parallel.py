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


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "take_step_before_checkpoint",
    [pytest.param(True, id="after-step"), pytest.param(False, id="pre-step")],
)
@pytest.mark.parametrize(
    "run_async", [pytest.param(True, id="async"), pytest.param(False, id="sync")]
)
def test_save_and_load_tensor_parallel_model(
    backend: str, tmp_path: Path, take_step_before_checkpoint: bool, run_async: bool
) -> None:
    run_distributed_test(
        run_save_and_load_tensor_parallel_model,
        backend=backend,
        start_method="spawn",
        func_args=(tmp_path, take_step_before_checkpoint, run_async),
    )
