"""Expert parallelism: the token exchange runs the same collectives whatever the routing, every
expert-parallel layout (EP2, CP2 x EP2, EP2 x FSDP2, EP4, EP2 x PP2) trains as one process
does (metrics, every gradient of every step, weights after SGD steps), a run stops and resumes
exactly, and an EP checkpoint loads on another degree and on one process with its optimizer
state, and is read by ``olmolike unshard`` and ``olmolike export-hf``.

The model has a dense layer before its MoE layers, a shared expert and large auxiliary-loss
coefficients, so a layout that routed a token to the wrong expert, lost an expert's gradient
contribution from another rank, or averaged the experts' gradients over the wrong ranks would
show in the router's and experts' gradients.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
from testutils import run_distributed_test

from olmolike.data import TokenTensorDataLoader
from olmolike.distributed.expert_parallel import ExpertParallelConfig
from olmolike.distributed.parallel import DataParallelConfig
from olmolike.distributed.pipeline import PipelineParallelConfig
from olmolike.distributed.tensor_parallel import ContextParallelConfig
from olmolike.distributed.utils import broadcast_object, get_rank
from olmolike.nn import TransformerConfig
from olmolike.nn.moe import MoEConfig
from olmolike.optim import AdamWConfig, SGDConfig
from olmolike.testing import random_token_instances
from olmolike.train import Callback, Duration, TrainerConfig
from olmolike.train.callbacks.checkpointer import CheckpointerCallback
from olmolike.train.callbacks.config_saver import ConfigSaverCallback
from olmolike.train.train_module import TransformerTrainModuleConfig

SEQ_LEN = 16
VOCAB = 64
INSTANCES_PER_BATCH = 8
MICROBATCH_INSTANCES = 2
STEPS = 3
EXPERTS = 4


def model_config(dense: bool = False) -> TransformerConfig:
    moe = MoEConfig(
        num_experts=EXPERTS, top_k=2, hidden_size=16, shared_expert_hidden_size=8, layers=[1, 2],
        load_balancing_loss_coefficient=0.1, router_z_loss_coefficient=0.01,
    )  # fmt: skip
    return TransformerConfig.moe_tiny(
        VOCAB, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, mlp_hidden_size=24,
        max_sequence_length=SEQ_LEN, moe=None if dense else moe,
    )  # fmt: skip


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return whole.detach().clone()


@dataclass
class Record(Callback):
    """Every logged metric, every gradient before each optimizer step, and the model and
    optimizer state the run starts from (after loading a checkpoint)."""

    metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    grads: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    start: dict[str, torch.Tensor] = field(default_factory=dict)

    def pre_train(self) -> None:
        module: Any = self.trainer.train_module
        names = {id(p): n for n, p in module.model.named_parameters()}
        self.start = {n: _full(p) for n, p in module.model.named_parameters()}
        for param, state in module.optim.state.items():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    self.start[f"{key}/{names[id(param)]}"] = _full(state[key])

    def pre_optim_step(self) -> None:
        model = self.trainer.train_module.model  # type: ignore[attr-defined]
        self.grads[self.trainer.global_step] = {
            name: _full(p.grad) for name, p in model.named_parameters() if p.grad is not None
        }

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.metrics[step] = dict(metrics)


@dataclass
class Run:
    metrics: dict[int, dict[str, float]]
    grads: dict[int, dict[str, torch.Tensor]]
    params: dict[str, torch.Tensor]
    start: dict[str, torch.Tensor]
    expert_meshes: set[tuple[str, ...]] = field(default_factory=set)
    """The mesh dimensions the experts' weights are DTensors on."""


def train(
    *,
    ep: int = 1,
    optim: str = "sgd",
    dp: str | None = "fsdp",
    pp: int = 1,
    cp: int = 1,
    steps: int = STEPS,
    save_folder: str | None = None,
    load_path: str | None = None,
) -> Run:
    module_config = TransformerTrainModuleConfig(
        rank_microbatch_size=MICROBATCH_INSTANCES * SEQ_LEN,
        optim=SGDConfig(lr=0.1, momentum=0.9) if optim == "sgd" else AdamWConfig(lr=1e-2),
        max_grad_norm=1.0,
        dp_config=DataParallelConfig(name=dp) if dp and dist.is_initialized() else None,  # type: ignore[arg-type]
        ep_config=ExpertParallelConfig(degree=ep) if ep > 1 else None,
        pp_config=PipelineParallelConfig(degree=pp) if pp > 1 else None,
        cp_config=ContextParallelConfig(degree=cp) if cp > 1 else None,
    )
    train_module = module_config.build(model_config().build(init_device="meta"))
    group = getattr(train_module, "dp_process_group", None)
    loader = TokenTensorDataLoader(
        random_token_instances(64, SEQ_LEN, VOCAB, seed=1),
        global_batch_size=INSTANCES_PER_BATCH * SEQ_LEN,
        seed=0,
        dp_world_size=train_module.dp_world_size,
        dp_rank=get_rank(group),
    )
    record = Record()
    callbacks: dict[str, Callback] = {"record": record}
    if save_folder is not None:
        callbacks["checkpointer"] = CheckpointerCallback(save_interval=2)
        config = {"model": model_config().as_config_dict()}
        callbacks["config_saver"] = ConfigSaverCallback(config=config)
    trainer = TrainerConfig(
        save_folder=save_folder or broadcast_object(tempfile.mkdtemp()),
        load_path=load_path,
        metrics_collect_interval=1,
        device="cpu",
        callbacks=callbacks,
        max_duration=Duration.steps(steps),
        no_checkpoints=save_folder is None,
    ).build(train_module, loader, dp_process_group=group)
    trainer.fit()
    params = {n: _full(p) for n, p in train_module.model.state_dict().items()}
    meshes = {
        tuple(p.device_mesh.mesh_dim_names or ())
        for n, p in train_module.model.named_parameters()
        if ".experts." in n and hasattr(p, "device_mesh")
    }
    return Run(record.metrics, record.grads, params, record.start, meshes)


def assert_same_run(got: Run, want: Run, steps: range = range(1, STEPS + 1)) -> None:
    """Same metrics (names and values) and gradients within 1e-5 in fp32, and (after SGD
    steps) the same weights."""
    assert sorted(got.metrics) == list(steps)
    for step in steps:
        assert got.metrics[step].keys() == want.metrics[step].keys()
        for name, value in got.metrics[step].items():
            assert value == pytest.approx(want.metrics[step][name], rel=1e-5, abs=1e-6), (
                step,
                name,
            )
        assert got.grads[step], step
        assert got.grads[step].keys() <= want.grads[step].keys()
        for name, grad in got.grads[step].items():
            torch.testing.assert_close(
                grad, want.grads[step][name], rtol=1e-5, atol=1e-6, msg=f"{step} {name}"
            )


def assert_same_weights(got: Run, want: Run) -> None:
    for name, param in got.params.items():
        torch.testing.assert_close(param, want.params[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def single() -> dict[str, Run]:
    return {"sgd": train(), "adamw": train(optim="adamw")}


# -- the exchange -------------------------------------------------------------------------------


def _exchange(scenarios: list[list[list[list[int]]]]) -> list[dict[str, Any]]:
    """For each scenario (per rank, per token, its experts): one MoE layer's experts,
    expert-parallel over the ranks and local, on this rank's tokens: the outputs, input
    gradients and expert gradients of both, and how many all_to_alls the exchange ran."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from olmolike.nn.expert_parallel import ExpertParallelDispatcher
    from olmolike.nn.moe import ExpertCompute, Experts, TokenDispatcher, count_tokens

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    original = dist.all_to_all_single
    calls = {"n": 0}

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        return original(*args, **kwargs)

    results = []
    for routings in scenarios:
        torch.manual_seed(0)
        local = Experts(EXPERTS, 8, 6, ExpertCompute.loop)
        for w in local.parameters():
            torch.nn.init.normal_(w)
        sharded = Experts(EXPERTS, 8, 6, ExpertCompute.loop)
        for name, param in local.named_parameters():
            split = distribute_tensor(param.detach().clone(), mesh, [Shard(0)])
            sharded.register_parameter(name, torch.nn.Parameter(split))
        tokens = len(routings[rank])
        x = torch.randn(tokens, 8, generator=torch.Generator().manual_seed(rank))
        chosen = torch.tensor(routings[rank], dtype=torch.int64).reshape(tokens, 2)
        counts = count_tokens(chosen, EXPERTS)

        calls["n"] = 0
        dist.all_to_all_single = counted  # type: ignore[assignment]
        try:
            x_ep = x.clone().requires_grad_()
            exchange = ExpertParallelDispatcher(EXPERTS, mesh.get_group())
            sent = exchange.dispatch(x_ep, chosen, counts)
            computed = sharded(sent.tokens, sent.tokens_per_expert)
            out = exchange.combine(computed, sent, chosen.shape)
            out.square().sum().backward()
        finally:
            dist.all_to_all_single = original  # type: ignore[assignment]

        x_local = x.clone().requires_grad_()
        plain = TokenDispatcher(EXPERTS)
        got = plain.dispatch(x_local, chosen, counts)
        ref = plain.combine(local(got.tokens, got.tokens_per_expert), got, chosen.shape)
        ref.square().sum().backward()
        results.append(
            {
                "out": (out.detach(), ref.detach()),
                "input_grad": (x_ep.grad, x_local.grad),
                "expert_grads": {n: _full(p.grad) for n, p in sharded.named_parameters()},
                "local_expert_grads": {n: p.grad for n, p in local.named_parameters()},
                "all_to_alls": calls["n"],
            }
        )
    return results


@pytest.mark.timeout(300)
def test_the_exchange_equals_local_experts_whatever_the_routing() -> None:
    """Two ranks of two experts each. First rank 0 routes everything to its own experts (it
    sends rank 1 nothing) while rank 1 has tokens for every expert; then rank 0 has no token
    at all. Every rank runs the same collectives, and outputs and gradients equal one
    process's experts on the same tokens (expert gradients summed over the ranks' tokens)."""
    scenarios = [
        [[[0, 1], [1, 0], [0, 1]], [[3, 2], [0, 3], [1, 2], [2, 0]]],
        [[], [[3, 2], [0, 3], [1, 2]]],
    ]
    per_rank = run_distributed_test(_exchange, 2, args=(scenarios,), timeout=200)
    for scenario in range(len(scenarios)):
        results = [rank[scenario] for rank in per_rank]
        # the counts, tokens and results forward, tokens and results backward
        assert [r["all_to_alls"] for r in results] == [5, 5]
        for r in results:
            torch.testing.assert_close(*r["out"], rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(*r["input_grad"], rtol=1e-6, atol=1e-6)
        for name, grad in results[0]["expert_grads"].items():
            summed = sum(r["local_expert_grads"][name] for r in results)
            torch.testing.assert_close(grad, summed, rtol=1e-5, atol=1e-5, msg=(scenario, name))


# -- layouts equal to one process -------------------------------------------------------------


def _two_rank_cases() -> dict[str, Run]:
    return {"ep2": train(ep=2), "cp2": train(cp=2), "cp2_ep2": train(ep=2, cp=2)}


def _four_rank_cases() -> dict[str, Run]:
    return {
        "ep2_fsdp2": train(ep=2),
        "ep4": train(ep=4),
        "ep2_hsdp2": train(ep=2, dp="hsdp"),
        "ep2_pp2": train(ep=2, pp=2),
    }


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Run]]:
    return run_distributed_test(_two_rank_cases, 2, timeout=400)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Run]]:
    return run_distributed_test(_four_rank_cases, 4, timeout=500)


@pytest.mark.timeout(600)
def test_ep2_trains_as_one_process(two_ranks: list[dict[str, Run]], single: dict[str, Run]) -> None:
    for rank in two_ranks:
        assert rank["ep2"].expert_meshes == {("dp_shard_mod_ep", "dp_shard_in_ep")}
        assert_same_run(rank["ep2"], single["sgd"])
        assert_same_weights(rank["ep2"], single["sgd"])


@pytest.mark.timeout(600)
def test_context_parallel_ranks_exchange_tokens_as_data_ranks(
    two_ranks: list[dict[str, Run]],
) -> None:
    """CP2 x EP2 (the two context-parallel ranks hold two experts each) trains as CP2 does.
    Not as one process: under context parallelism each rank routes half of every sequence,
    and the load-balancing loss of a forward is taken over the tokens it routes."""
    for rank in two_ranks:
        assert_same_run(rank["cp2_ep2"], rank["cp2"])
        assert_same_weights(rank["cp2_ep2"], rank["cp2"])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", ["ep2_fsdp2", "ep4", "ep2_hsdp2", "ep2_pp2"])
def test_four_rank_layouts_train_as_one_process(
    layout: str, four_ranks: list[dict[str, Run]], single: dict[str, Run]
) -> None:
    replicas = ("dp_replicate",) if layout == "ep2_hsdp2" else ()
    for rank in four_ranks:
        assert rank[layout].expert_meshes == {(*replicas, "dp_shard_mod_ep", "dp_shard_in_ep")}
        assert_same_run(rank[layout], single["sgd"])
        assert_same_weights(rank[layout], single["sgd"])
