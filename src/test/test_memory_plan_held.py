"""The planner's parameter, gradient, optimizer and buffer bytes equal, exactly, what gloo
ranks hold after one training step, for every layout in :data:`HELD_LAYOUTS`."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from testutils import run_distributed_test
from torch.distributed.tensor import DTensor

from olmolike.distributed.pipeline import PipelineScheduleType
from olmolike.distributed.utils import get_rank
from olmolike.nn import MoEConfig, TransformerConfig
from olmolike.plan.memory import Layout, StateBytes, state_bytes
from olmolike.train.train_module import TransformerTrainModuleConfig

# Every dimension uneven over 2 and 4 ranks (67 vocabulary rows, 40 MLP rows, 24 kv rows in
# k_norm): FSDP2's last shards are shorter, as the planner must count.
MODEL = TransformerConfig(
    vocab_size=67, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden_size=40,
    qk_norm=True, max_sequence_length=16,
)  # fmt: skip

# Tensor parallelism splits the vocabulary evenly: 70 rows, 35 per TP rank, which FSDP then
# shards unevenly (18 + 17).
TP_MODEL = replace(MODEL, vocab_size=70)

# A mixture of experts in the second layer only (pipeline ranks hold different bytes): 3
# experts, which FSDP shards 2 + 1 along the expert dimension, a shared expert, and a router.
MOE_MODEL = replace(
    TP_MODEL, moe=MoEConfig(num_experts=3, top_k=2, hidden_size=20, shared_expert_hidden_size=8,
                            layers=[1]),
)  # fmt: skip

# Six experts: expert parallelism gives each of 2 ranks 3, which FSDP over the 2 ranks that
# hold the same experts shards 2 + 1.
EP_MODEL = replace(MOE_MODEL, moe=replace(MOE_MODEL.moe, num_experts=6))  # type: ignore[type-var]

HELD_LAYOUTS: dict[str, tuple[dict[str, Any], Layout, TransformerConfig]] = {
    "ddp": ({"dp_config": {"name": "ddp"}}, Layout(dp_replicate=2), MODEL),
    "fsdp": ({"dp_config": {"name": "fsdp"}}, Layout(dp_shard=2), MODEL),
    "fsdp-bf16-gather": (
        {"dp_config": {"name": "fsdp", "param_dtype": "bfloat16"}},
        Layout(dp_shard=2),
        MODEL,
    ),
    "hsdp-2x2": (
        {"dp_config": {"name": "hsdp", "num_replicas": 2}},
        Layout(dp_replicate=2, dp_shard=2),
        MODEL,
    ),
    "tp-2": ({"tp_config": {"degree": 2}}, Layout(tp=2), TP_MODEL),
    "tp-2-fsdp-2": (
        {"tp_config": {"degree": 2}, "dp_config": {"name": "fsdp"}},
        Layout(dp_shard=2, tp=2),
        TP_MODEL,
    ),
    # The pipeline ranks hold different stages: the first the embedding, the last the head.
    "pp-2": ({"pp_config": {"degree": 2}}, Layout(pp=2), MODEL),
    "pp-2-fsdp-2": (
        {"pp_config": {"degree": 2}, "dp_config": {"name": "fsdp"}},
        Layout(pp=2, dp_shard=2),
        MODEL,
    ),
    "pp-2-interleaved": (
        {"pp_config": {"degree": 2, "schedule": "interleaved_1f1b"}},
        Layout(pp=2, stages_per_rank=2, schedule=PipelineScheduleType.interleaved_1f1b),
        replace(MODEL, n_layers=4),
    ),
    # Context parallelism: FSDP shards over the data and context ranks together (4 shards);
    # DDP replicates over the context ranks.
    "cp-2-fsdp-2": (
        {"cp_config": {"degree": 2}, "dp_config": {"name": "fsdp"}},
        Layout(dp_shard=2, cp=2),
        MODEL,
    ),
    "cp-2-ddp": ({"cp_config": {"degree": 2}}, Layout(cp=2, cp_sharded=False), MODEL),
    # Needs TP x PP in the train module (TransformerTrainModuleConfig.validate refuses it
    # until then).
    "tp-2-pp-2": (
        {"tp_config": {"degree": 2}, "pp_config": {"degree": 2}},
        Layout(pp=2, tp=2),
        TP_MODEL,
    ),
    "moe-fsdp": ({"dp_config": {"name": "fsdp"}}, Layout(dp_shard=2), MOE_MODEL),
    "moe-tp-2": ({"tp_config": {"degree": 2}}, Layout(tp=2), MOE_MODEL),
    "moe-pp-2": ({"pp_config": {"degree": 2}}, Layout(pp=2), MOE_MODEL),
    # Expert parallelism: the experts over the EP ranks, then FSDP over the ranks that hold
    # the same experts; every other tensor over all of dp_shard (x cp).
    "moe-ep-2-fsdp-2": (
        {"dp_config": {"name": "fsdp"}, "ep_config": {"degree": 2}},
        Layout(dp_shard=4, ep=2),
        EP_MODEL,
    ),
    "moe-ep-2-tp-2": (
        {"dp_config": {"name": "fsdp"}, "ep_config": {"degree": 2}, "tp_config": {"degree": 2}},
        Layout(dp_shard=2, tp=2, ep=2),
        EP_MODEL,
    ),
    "moe-cp-2-ep-2": (
        {"dp_config": {"name": "fsdp"}, "ep_config": {"degree": 2}, "cp_config": {"degree": 2}},
        Layout(cp=2, ep=2),
        EP_MODEL,
    ),
}
"""Train-module config fields -> the layout they make, and the model."""


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _held_after_one_step(
    module_fields: dict[str, Any], model_config: TransformerConfig
) -> tuple[int, StateBytes]:
    # Two micro-batches of 2 x 8 tokens: what 1F1B over two pipeline ranks needs at least.
    config = TransformerTrainModuleConfig.from_dict({"rank_microbatch_size": 16, **module_fields})
    train_module = config.build(model_config.build(init_device="meta"), device=torch.device("cpu"))
    model, optim = train_module.model, train_module.optim
    input_ids = torch.randint(
        0, model_config.vocab_size, (4, 8), generator=torch.Generator().manual_seed(0)
    )
    train_module.train_batch({"input_ids": input_ids}, dry_run=True)  # the pipeline's schedule too
    optim.step()
    params = list(model.parameters())  # a tied weight appears once
    # A pipeline rank's RoPE tables are its stages' own (its parts hold none).
    holders = getattr(train_module, "stages", [model])
    held = StateBytes(
        params=sum(_local_bytes(p) for p in params),
        grads=sum(_local_bytes(p.grad) for p in params if p.grad is not None),
        optim=sum(
            _local_bytes(value)
            for state in optim.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        ),
        buffers=sum(_local_bytes(b) for holder in holders for b in holder.buffers()),
    )
    return get_rank(), held


def _held_in_every_layout(names: list[str]) -> dict[str, tuple[int, StateBytes] | str]:
    """:func:`_held_after_one_step` for each layout in turn on these ranks (one group for all
    the layouts of a world size: DTensor's sharding rules, worked out once per process, serve
    every layout that shares them). A layout that fails on some rank ends the sequence (the
    ranks' collectives would no longer match): its error, and nothing for the rest."""
    import torch.distributed as dist

    out: dict[str, tuple[int, StateBytes] | str] = {}
    for name in names:
        module_fields, _, model = HELD_LAYOUTS[name]
        try:
            out[name] = _held_after_one_step(module_fields, model)
        except Exception as e:
            out[name] = f"{type(e).__name__}: {e}"
        failed: list[bool | None] = [None] * dist.get_world_size()
        dist.all_gather_object(failed, isinstance(out[name], str))
        if any(failed):
            break
    return out


@pytest.fixture(scope="module")
def held() -> Any:
    """What each rank holds in each layout: one distributed call per world size, on first use."""
    by_world: dict[int, list[dict[str, tuple[int, StateBytes] | str]]] = {}

    def get(name: str) -> list[tuple[int, StateBytes] | str]:
        world = HELD_LAYOUTS[name][1].world_size
        if world not in by_world:
            names = [n for n, (_, layout, _) in HELD_LAYOUTS.items() if layout.world_size == world]
            by_world[world] = run_distributed_test(
                _held_in_every_layout, world, args=(names,), timeout=600
            )
        return [rank.get(name, "not run: an earlier layout failed") for rank in by_world[world]]

    return get


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(HELD_LAYOUTS))
def test_planned_state_equals_what_ranks_hold(name: str, held: Any) -> None:
    _, layout, model = HELD_LAYOUTS[name]
    optim = TransformerTrainModuleConfig(rank_microbatch_size=16).optim
    for outcome in held(name):
        assert not isinstance(outcome, str), outcome
        rank, bytes_held = outcome
        assert bytes_held == state_bytes(model, layout, optim, rank), f"rank {rank} of {layout}"
