"""Expert parallelism: the token exchange runs the same collectives whatever the routing, every
expert-parallel layout (EP2, EP2 x FSDP2, EP4, EP2 x HSDP2, EP2 x PP2, EP2 x TP2) trains as one process
does (metrics, every gradient of every step, weights after SGD steps), a run stops and resumes
exactly, and an EP checkpoint loads on another degree and on one process with its optimizer
state, and is read by ``olmolike unshard`` and ``olmolike export-hf``.

The model has a dense layer before its MoE layers, a shared expert and large auxiliary-loss
coefficients, so a layout that routed a token to the wrong expert, lost an expert's gradient
contribution from another rank, or averaged the experts' gradients over the wrong ranks would
show in the router's and experts' gradients.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from testutils import run_distributed_test

from olmolike.cli import main
from olmolike.data import TokenTensorDataLoader
from olmolike.data.tokenizer import TokenizerConfig
from olmolike.distributed.expert_parallel import ExpertParallelConfig
from olmolike.distributed.mesh import ParallelDegrees
from olmolike.distributed.parallel import DataParallelConfig
from olmolike.distributed.pipeline import PipelineParallelConfig
from olmolike.distributed.tensor_parallel import ContextParallelConfig, TensorParallelConfig
from olmolike.distributed.utils import broadcast_object, get_rank
from olmolike.exceptions import ConfigurationError
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


def model_config(olmoe: bool = False) -> TransformerConfig:
    """A dense layer, two MoE layers with a shared expert; ``olmoe``: OLMoE's blocks (every
    layer MoE, no shared expert), which ``export-hf`` writes as an ``OlmoeForCausalLM``."""
    moe = MoEConfig(
        num_experts=EXPERTS, top_k=2, hidden_size=16, shared_expert_hidden_size=8, layers=[1, 2],
        load_balancing_loss_coefficient=0.1, router_z_loss_coefficient=0.01,
    )  # fmt: skip
    if olmoe:
        moe = MoEConfig(num_experts=EXPERTS, top_k=2, hidden_size=16)
    return TransformerConfig.moe_tiny(
        VOCAB, d_model=32, n_layers=2 if olmoe else 3, n_heads=4, n_kv_heads=2,
        mlp_hidden_size=24, max_sequence_length=SEQ_LEN, moe=moe,
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
    tp: int = 1,
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
        tp_config=TensorParallelConfig(degree=tp) if tp > 1 else None,
    )
    model = model_config(olmoe=optim == "adamw")
    train_module = module_config.build(model.build(init_device="meta"))
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
        callbacks["checkpointer"] = CheckpointerCallback(
            save_interval=2, pre_train_checkpoint=False
        )
        tokenizer = TokenizerConfig().as_config_dict()
        config = {"model": model.as_config_dict(), "tokenizer": tokenizer}
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
    at all; then both ranks send everything to rank 1's experts (rank 1 receives all, rank
    0 computes nothing). Every rank runs the same collectives, and outputs and gradients
    equal one process's experts on the same tokens (expert gradients summed over the ranks'
    tokens)."""
    scenarios = [
        [[[0, 1], [1, 0], [0, 1]], [[3, 2], [0, 3], [1, 2], [2, 0]]],
        [[], [[3, 2], [0, 3], [1, 2]]],
        [[[2, 3], [3, 2]], [[3, 2], [2, 3], [2, 3]]],
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


def _two_rank_cases(folder: str) -> dict[str, Run]:
    return {
        "ep2": train(ep=2),
        "cp2": train(cp=2),
        "cp2_ep2": train(ep=2, cp=2),
        # AdamW: straight through, then stopped after step 2 (saved) and resumed.
        "adamw": train(ep=2, optim="adamw"),
        "stopped": train(ep=2, optim="adamw", steps=2, save_folder=folder),
        "resumed": train(ep=2, optim="adamw", save_folder=folder),
    }


def _four_rank_cases(ep2_checkpoint: str, one_checkpoint: str, tp_folder: str) -> dict[str, Run]:
    return {
        "ep2_fsdp2": train(ep=2),
        "ep4": train(ep=4),
        "ep2_hsdp2": train(ep=2, dp="hsdp"),
        "ep2_pp2": train(ep=2, pp=2),
        "ep2_tp2": train(ep=2, tp=2),
        # The EP2 run's checkpoint of step 2 (2 ranks), continued under EP4.
        "ep4_from_ep2": train(ep=4, optim="adamw", load_path=ep2_checkpoint),
        "ep2_tp2_from_ep2": train(ep=2, tp=2, optim="adamw", load_path=ep2_checkpoint),
        # Saved under EP2 x TP2: every tensor-parallel rank holds a copy of its experts.
        "ep2_tp2_saved": train(ep=2, tp=2, optim="adamw", steps=2, save_folder=tp_folder),
        # One process's checkpoint of step 2, continued under EP2 x FSDP2.
        "ep2_fsdp2_from_one": train(ep=2, optim="adamw", load_path=one_checkpoint),
    }


@pytest.fixture(scope="module")
def ep2_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ep2_run")


@pytest.fixture(scope="module")
def two_ranks(ep2_folder: Path) -> list[dict[str, Run]]:
    return run_distributed_test(_two_rank_cases, 2, args=(str(ep2_folder),), timeout=500)


@pytest.fixture(scope="module")
def one_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One process's AdamW run stopped (and saved) after step 2."""
    folder = tmp_path_factory.mktemp("one_run")
    train(optim="adamw", steps=2, save_folder=str(folder))
    return folder


@pytest.fixture(scope="module")
def ep2_tp2_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ep2_tp2_run")


@pytest.fixture(scope="module")
def four_ranks(
    two_ranks: list[dict[str, Run]], ep2_folder: Path, one_folder: Path, ep2_tp2_folder: Path
) -> list[dict[str, Run]]:
    del two_ranks  # its checkpoint first
    args = (str(ep2_folder / "step2"), str(one_folder / "step2"), str(ep2_tp2_folder))
    return run_distributed_test(_four_rank_cases, 4, args=args, timeout=600)


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
@pytest.mark.parametrize("layout", ["ep2_fsdp2", "ep4", "ep2_hsdp2", "ep2_pp2", "ep2_tp2"])
def test_four_rank_layouts_train_as_one_process(
    layout: str, four_ranks: list[dict[str, Run]], single: dict[str, Run]
) -> None:
    replicas = ("dp_replicate",) if layout == "ep2_hsdp2" else ()
    for rank in four_ranks:
        assert rank[layout].expert_meshes == {(*replicas, "dp_shard_mod_ep", "dp_shard_in_ep")}
        assert_same_run(rank[layout], single["sgd"])
        assert_same_weights(rank[layout], single["sgd"])


# -- stop and resume, checkpoints between degrees ----------------------------------------------


@pytest.mark.timeout(600)
def test_stop_and_resume_under_expert_parallelism_is_exact(
    two_ranks: list[dict[str, Run]],
) -> None:
    for rank in two_ranks:
        straight, resumed = rank["adamw"], rank["resumed"]
        assert sorted(resumed.metrics) == [3]
        assert resumed.metrics[3] == straight.metrics[3]
        for name, param in resumed.params.items():
            assert torch.equal(param, straight.params[name]), name


def _unsharded(checkpoint: Path, out: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's weights and Adam moments by name, as ``olmolike unshard`` writes them."""
    assert main(["unshard", str(checkpoint), str(out), "--optim"]) == 0
    model = torch.load(out / "model.pt", weights_only=True)
    optim = torch.load(out / "optim.pt", weights_only=True)
    moments = {
        f"{key}/{name}": value
        for name, state in optim["state"].items()
        for key, value in state.items()
        if key in ("exp_avg", "exp_avg_sq")
    }
    return {**model, **moments}


@pytest.mark.timeout(900)
def test_an_ep2_checkpoint_continues_under_ep4_and_on_one_process(
    two_ranks: list[dict[str, Run]],
    four_ranks: list[dict[str, Run]],
    ep2_folder: Path,
    tmp_path: Path,
) -> None:
    """The EP2 checkpoint (2 ranks) loads under EP4 and EP2 x TP2 (4 ranks) and on one
    process with every weight and Adam moment as saved (``olmolike unshard`` reads it too), and step 3 then
    matches the EP2 run's step 3."""
    saved = _unsharded(ep2_folder / "step2", tmp_path / "unsharded")
    assert sum(".experts." in name for name in saved) == 2 * 3 * 3  # layers, weights, states
    one = train(optim="adamw", load_path=str(ep2_folder / "step2"))
    want = two_ranks[0]["adamw"]
    others = [rank[name] for rank in four_ranks for name in ("ep4_from_ep2", "ep2_tp2_from_ep2")]
    for run in [one, *others]:
        assert run.start.keys() == saved.keys()
        for name, value in saved.items():
            assert torch.equal(run.start[name], value), name
        assert_same_run(run, want, steps=range(3, 4))


@pytest.mark.timeout(600)
def test_export_hf_reads_an_ep_checkpoint(
    two_ranks: list[dict[str, Run]], ep2_folder: Path, tmp_path: Path
) -> None:
    """``olmolike export-hf`` of the EP2 checkpoint writes what exporting its unsharded
    weights writes."""
    from olmolike.nn.hf_export import export_hf

    del two_ranks
    assert main(["export-hf", str(ep2_folder / "step2"), str(tmp_path / "hf")]) == 0
    assert main(["unshard", str(ep2_folder / "step2"), str(tmp_path / "plain")]) == 0
    weights = torch.load(tmp_path / "plain" / "model.pt", weights_only=True)
    export_hf(weights, model_config(olmoe=True), tmp_path / "want")
    got, want = (load_file(tmp_path / d / "model.safetensors") for d in ("hf", "want"))
    assert got.keys() == want.keys() and any(".experts.3." in k for k in got)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["num_experts"] == EXPERTS


@pytest.mark.timeout(900)
def test_a_checkpoint_saved_under_ep2_x_tp2_holds_the_run_s_weights(
    four_ranks: list[dict[str, Run]], ep2_tp2_folder: Path, tmp_path: Path
) -> None:
    """The experts are duplicated over the tensor-parallel ranks; the checkpoint holds each
    once, and unsharded it equals the weights the run ended with, with every Adam moment."""
    saved = _unsharded(ep2_tp2_folder / "step2", tmp_path / "unsharded")
    run = four_ranks[0]["ep2_tp2_saved"]
    assert sum(".experts." in name for name in saved) == 2 * 3 * 3  # layers, weights, states
    for name, value in run.params.items():
        assert torch.equal(saved[name], value), name
    assert {n.split("/", 1)[1] for n in saved if "/" in n} == set(run.params)


# -- refusals ---------------------------------------------------------------------------------


def test_the_expert_parallel_degree_is_carved_from_the_sharding_ranks() -> None:
    degrees = ParallelDegrees.resolve(8, cp=2, ep=4)
    assert (degrees.dp_shard, degrees.dp_shard_in_ep, degrees.dp_shard_mod_ep) == (4, 2, 2)
    assert ParallelDegrees.resolve(8, pp=2, ep=2).dp_shard_mod_ep == 2
    for world, kwargs in ((4, {"ep": 3}), (8, {"cp": 4, "ep": 2}), (8, {"tp": 4, "ep": 4})):
        with pytest.raises(ConfigurationError, match=r"expert-parallel degree .* dp_shard x cp"):
            ParallelDegrees.resolve(world, **kwargs)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"dp_config": DataParallelConfig(name="ddp")}, "not DDP's replicas"),  # type: ignore[arg-type]
        ({}, "not DDP's replicas"),  # several data ranks without dp_config: DDP
    ],
)
def test_layouts_expert_parallelism_does_not_take_are_refused(
    settings: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        TransformerTrainModuleConfig(
            rank_microbatch_size=SEQ_LEN, ep_config=ExpertParallelConfig(degree=2), **settings
        ).parallel_degrees(world_size=4)


class _Mesh:
    """What apply_expert_parallel asks of a mesh before it shards anything."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


@pytest.mark.parametrize(
    "model, degree, message",
    [
        (model_config(), 3, r"degree \(3\) must divide num_experts \(4\)"),
        (TransformerConfig.tiny(VOCAB), 2, "has no MoE layer: set ep_config=null"),
    ],
)
def test_models_whose_experts_do_not_split_are_refused(
    model: TransformerConfig, degree: int, message: str
) -> None:
    from olmolike.nn.expert_parallel import apply_expert_parallel

    with pytest.raises(ConfigurationError, match=message):
        apply_expert_parallel(model.build(init_device="meta"), _Mesh(degree))  # type: ignore[arg-type]


@pytest.mark.timeout(900)
def test_a_one_process_checkpoint_continues_under_ep2_x_fsdp2(
    four_ranks: list[dict[str, Run]],
    single: dict[str, Run],
    one_folder: Path,
    tmp_path: Path,
) -> None:
    """And back: one process's checkpoint of step 2 loads under EP2 x FSDP2 (4 ranks) with
    every weight and Adam moment as saved, and step 3 matches one process's step 3."""
    saved = _unsharded(one_folder / "step2", tmp_path / "unsharded")
    for rank in four_ranks:
        run = rank["ep2_fsdp2_from_one"]
        assert run.start.keys() == saved.keys()
        for name, value in saved.items():
            assert torch.equal(run.start[name], value), name
        assert_same_run(run, single["adamw"], steps=range(3, 4))


@pytest.mark.parametrize(
    "model, override, message",
    [
        (model_config(), "--train_module.ep_config.degree=3", r"degree (3) must divide num_ex"),
        (TransformerConfig.tiny(VOCAB), "--train_module.ep_config.degree=2", "no MoE layer"),
    ],
)
def test_olmolike_train_refuses_an_ep_degree_the_model_cannot_take_in_one_line(
    model: TransformerConfig,
    override: str,
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Before any process group or model: the experiment's config is refused on load."""
    from olmolike.data.numpy_data_loader import NumpyDataLoaderConfig
    from olmolike.data.numpy_dataset import NumpyDatasetConfig
    from olmolike.experiment import ExperimentConfig

    config = ExperimentConfig(
        run_name="ep",
        model=model,
        dataset=NumpyDatasetConfig(paths=[str(tmp_path / "t.npy")], sequence_length=SEQ_LEN),
        data_loader=NumpyDataLoaderConfig(global_batch_size=4 * SEQ_LEN, seed=0),
        train_module=TransformerTrainModuleConfig(
            rank_microbatch_size=SEQ_LEN,
            dp_config=DataParallelConfig(name="fsdp"),  # type: ignore[arg-type]
        ),
        trainer=TrainerConfig(save_folder=str(tmp_path / "run"), max_duration=Duration.steps(1)),
    )
    path = tmp_path / "run.yaml"
    path.write_text(config.to_yaml())
    assert main(["train", str(path), override]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


# -- post-training ----------------------------------------------------------------------------


def _dpo(ep: int) -> dict[int, float]:
    """DPO losses of 3 AdamW steps: the policy and its frozen reference (a snapshot of the
    initial policy) both split over ``ep`` ranks, or one process."""
    from olmolike.data.preference import (
        PreferenceDataLoader,
        PreferencePair,
        encode_preference_pairs,
    )
    from olmolike.data.tokenizer import ByteTokenizer
    from olmolike.train.train_module.dpo import DPOTrainModuleConfig

    seq, tok = 24, ByteTokenizer()
    words = ["alpha", "beta", "gamma", "delta"]
    pairs = [
        PreferencePair(f"Q{i}: ", words[i % 4] * 2, words[(i + 1) % 4], where=f"x:{i}")
        for i in range(16)
    ]
    config = TransformerConfig.moe_tiny(
        tok.vocab_size, d_model=32, n_layers=2, n_heads=2, max_sequence_length=seq,
        moe=MoEConfig(num_experts=4, top_k=2, hidden_size=16),
    )  # fmt: skip
    module = DPOTrainModuleConfig(
        rank_microbatch_size=2 * seq,
        optim=AdamWConfig(lr=3e-3),
        beta=0.5,
        dp_config=DataParallelConfig(name="fsdp") if ep > 1 else None,  # type: ignore[arg-type]
        ep_config=ExpertParallelConfig(degree=ep) if ep > 1 else None,
    ).build(config.build(init_device="meta"))
    group = getattr(module, "dp_process_group", None)
    loader = PreferenceDataLoader(
        encode_preference_pairs(pairs, tok, seq),
        global_batch_size=4 * 4 * seq,
        seed=0,
        dp_world_size=module.dp_world_size,
        dp_rank=get_rank(group),
    )
    record = Record()
    TrainerConfig(
        save_folder=broadcast_object(tempfile.mkdtemp()), metrics_collect_interval=1,
        device="cpu", max_duration=Duration.steps(3), no_checkpoints=True,
        callbacks={"record": record},
    ).build(module, loader, dp_process_group=group).fit()  # fmt: skip
    return {step: metrics["train/DPO loss"] for step, metrics in record.metrics.items()}


@pytest.mark.timeout(600)
def test_dpo_trains_an_moe_policy_and_reference_under_ep2_as_one_process() -> None:
    want = _dpo(ep=1)
    assert want[1] == pytest.approx(0.6931472, abs=1e-6)  # the reference is the policy
    for got in run_distributed_test(_dpo, 2, args=(2,), timeout=300):
        assert got.keys() == want.keys()
        for step, loss in want.items():
            assert got[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), step
