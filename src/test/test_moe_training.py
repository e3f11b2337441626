"""Training a mixture of experts: the auxiliary losses and routing metrics a run records, and
every non-expert-parallel layout (DDP, FSDP2, tensor parallelism for attention, pipeline
schedules) equal to one process: metrics, every gradient of every step, final weights.

The model has a dense layer among its MoE layers, a shared expert, QK-norm and large
auxiliary-loss coefficients, so a layout that dropped a stage's auxiliary losses, counted a
token twice or weighted a micro-batch wrongly would show in the router gradients.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from testutils import assert_within_adam_reach, run_distributed_test

from olmolike.data import TokenTensorDataLoader
from olmolike.distributed.parallel import DataParallelConfig
from olmolike.distributed.pipeline import PipelineParallelConfig
from olmolike.distributed.tensor_parallel import ContextParallelConfig, TensorParallelConfig
from olmolike.distributed.utils import broadcast_object, get_rank
from olmolike.exceptions import ConfigurationError
from olmolike.nn import TransformerConfig
from olmolike.nn.moe import MoEConfig
from olmolike.optim import AdamWConfig
from olmolike.testing import random_token_instances
from olmolike.train import Callback, Duration, TrainerConfig
from olmolike.train.callbacks import CheckpointerCallback
from olmolike.train.callbacks.moe_load import MoELoadCallback
from olmolike.train.train_module import (
    ActivationCheckpointingConfig,
    TransformerTrainModuleConfig,
)

SEQ_LEN = 16
VOCAB = 64
INSTANCES_PER_BATCH = 8
MICROBATCH_INSTANCES = 2
STEPS = 3
LR = 1e-2
MOE_LAYERS = [1, 2, 3]


def model_config(**moe: Any) -> TransformerConfig:
    fields: dict[str, Any] = dict(
        num_experts=4, top_k=2, hidden_size=16, shared_expert_hidden_size=8, layers=MOE_LAYERS,
        load_balancing_loss_coefficient=0.1, router_z_loss_coefficient=0.01,
    )  # fmt: skip
    return TransformerConfig.moe_tiny(
        VOCAB, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, mlp_hidden_size=24,
        max_sequence_length=SEQ_LEN, moe=MoEConfig(**{**fields, **moe}),
    )  # fmt: skip


@dataclass
class Record(Callback):
    """Every logged metric, and every parameter's gradient before each optimizer step."""

    metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    grads: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)

    def pre_optim_step(self) -> None:
        model = self.trainer.train_module.model  # type: ignore[attr-defined]
        self.grads[self.trainer.global_step] = {
            name: _full(p.grad) for name, p in model.named_parameters() if p.grad is not None
        }

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.metrics[step] = dict(metrics)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return whole.detach().clone()


@dataclass
class Run:
    metrics: dict[int, dict[str, float]]
    grads: dict[int, dict[str, torch.Tensor]]
    params: dict[str, torch.Tensor]


def train(
    *,
    pp: dict[str, Any] | None = None,
    dp: dict[str, Any] | None = None,
    tp: int = 1,
    cp: int = 1,
    collect: int = 1,
    steps: int = STEPS,
    save_folder: str | None = None,
    **module: Any,
) -> Run:
    module_config = TransformerTrainModuleConfig(
        rank_microbatch_size=MICROBATCH_INSTANCES * SEQ_LEN,
        optim=AdamWConfig(lr=LR, weight_decay=0.1),
        max_grad_norm=1.0,
        pp_config=PipelineParallelConfig.from_dict(pp) if pp else None,
        dp_config=DataParallelConfig.from_dict(dp) if dp else None,
        tp_config=TensorParallelConfig(degree=tp) if tp > 1 else None,
        cp_config=ContextParallelConfig(degree=cp) if cp > 1 else None,
        **module,
    )
    model = model_config().build(init_device="meta")
    train_module = module_config.build(model)
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
    trainer = TrainerConfig(
        save_folder=save_folder or broadcast_object(tempfile.mkdtemp()),
        metrics_collect_interval=collect,
        device="cpu",
        callbacks=callbacks,
        max_duration=Duration.steps(steps),
        no_checkpoints=save_folder is None,
    ).build(train_module, loader, dp_process_group=group)
    trainer.fit()
    params = {n: _full(p) for n, p in train_module.model.state_dict().items()}
    return Run(record.metrics, record.grads, params)


def assert_same_run(got: Run, want: Run) -> None:
    """Same metrics (names and values) and gradients, within 1e-5 in fp32, at every step; the
    weights after the AdamW updates within what Adam can move them apart (an element whose
    gradient is near zero moves by up to ~lr per update, in a direction the layout's summation
    order decides: ``testutils.assert_within_adam_reach``)."""
    assert sorted(got.metrics) == list(range(1, STEPS + 1))
    for step in got.metrics:
        assert got.metrics[step].keys() == want.metrics[step].keys()
        for name, value in got.metrics[step].items():
            assert value == pytest.approx(want.metrics[step][name], rel=1e-5, abs=1e-6), (
                step,
                name,
            )
        assert got.grads[step].keys() <= want.grads[step].keys()
        for name, grad in got.grads[step].items():
            torch.testing.assert_close(
                grad, want.grads[step][name], rtol=1e-5, atol=1e-6, msg=f"{step} {name}"
            )
    want_params = {name: want.params[name] for name in got.params}  # a stage's share
    assert_within_adam_reach(got.params, want_params, lr=LR, updates=STEPS)


@pytest.fixture(scope="module")
def single() -> Run:
    return train()


# -- one process ------------------------------------------------------------------------------


def test_a_run_records_the_auxiliary_losses_and_every_experts_load(single: Run) -> None:
    for step, metrics in single.metrics.items():
        # A balanced layer's load-balancing loss is top_k; a random router is near it.
        assert 1.9 < metrics["train/load balancing loss"] < 3.0
        assert metrics["train/router z-loss"] > 0
        assert metrics["moe/dropped tokens"] == 0
        for layer in MOE_LAYERS:
            counts = [metrics[f"moe/layer {layer}/expert {e} tokens"] for e in range(4)]
            assert sum(counts) == INSTANCES_PER_BATCH * SEQ_LEN * 2  # every token, top-2
            imbalance = metrics[f"moe/layer {layer}/load max/mean"]
            assert imbalance == pytest.approx(max(counts) / (sum(counts) / 4))
        assert "moe/layer 0/expert 0 tokens" not in metrics  # the dense layer
        assert step in single.grads
    router = single.grads[1]["blocks.1.feed_forward.router.weight"]
    assert router.abs().sum() > 0


def test_loads_add_up_over_the_collect_interval() -> None:
    run = train(collect=2)
    assert sorted(run.metrics) == [1, 2, 3]
    assert "train/load balancing loss" in run.metrics[1]
    assert "moe/layer 1/expert 0 tokens" not in run.metrics[1]
    for step, steps in ((2, 2), (3, 1)):  # the last step is collected too
        counts = [run.metrics[step][f"moe/layer 1/expert {e} tokens"] for e in range(4)]
        assert sum(counts) == steps * INSTANCES_PER_BATCH * SEQ_LEN * 2


def test_stop_and_resume_is_exact(single: Run, tmp_path: Path) -> None:
    train(steps=2, save_folder=str(tmp_path))
    resumed = train(save_folder=str(tmp_path))
    assert sorted(resumed.metrics) == [3]
    assert resumed.metrics[3] == single.metrics[3]
    for name, param in resumed.params.items():
        assert torch.equal(param, single.params[name]), name


def test_activation_checkpointing_changes_nothing(single: Run) -> None:
    assert_same_run(train(ac_config=ActivationCheckpointingConfig()), single)


def test_the_load_callback_is_added_once_by_the_trainers_config() -> None:
    # The train module only names it (default_callbacks); TrainerConfig.build adds it, once.
    def callbacks(model: Any, configured: dict[str, Callback]) -> list[str]:
        module = TransformerTrainModuleConfig(rank_microbatch_size=SEQ_LEN).build(model)
        loader = TokenTensorDataLoader(
            random_token_instances(8, SEQ_LEN, VOCAB, seed=1), global_batch_size=SEQ_LEN
        )
        trainer = TrainerConfig(
            save_folder=tempfile.mkdtemp(), device="cpu", max_duration=Duration.steps(1),
            no_checkpoints=True, callbacks=configured,
        ).build(module, loader)  # fmt: skip
        return [n for n, c in trainer.callbacks.items() if isinstance(c, MoELoadCallback)]

    assert callbacks(model_config().build(seed=0), {}) == ["moe_load"]
    assert callbacks(model_config().build(seed=0), {"mine": MoELoadCallback()}) == ["mine"]
    dense = TransformerConfig.tiny(VOCAB, max_sequence_length=SEQ_LEN)
    assert callbacks(dense.build(seed=0), {}) == []
    # A name no callback registered is refused when the trainer is built, naming it.
    module = TransformerTrainModuleConfig(rank_microbatch_size=SEQ_LEN).build(dense.build(seed=0))
    module.default_callbacks = lambda: ("no_such_callback",)  # type: ignore[method-assign]
    loader = TokenTensorDataLoader(
        random_token_instances(8, SEQ_LEN, VOCAB, seed=1), global_batch_size=SEQ_LEN
    )
    with pytest.raises(ConfigurationError, match="no_such_callback"):
        TrainerConfig(
            save_folder=tempfile.mkdtemp(), device="cpu", max_duration=Duration.steps(1)
        ).build(module, loader)


# -- two ranks ----------------------------------------------------------------------------------


def _two_rank_cases() -> dict[str, Run]:
    return {
        "ddp": train(dp={"name": "ddp"}),
        "fsdp": train(dp={"name": "fsdp"}),
        "tp": train(tp=2, dp={"name": "fsdp"}),
        "pp_1f1b": train(pp={"degree": 2, "schedule": "1f1b"}),
        "pp_interleaved": train(
            pp={"degree": 2, "schedule": "interleaved_1f1b"},
            ac_config=ActivationCheckpointingConfig(),
        ),
        "cp": train(cp=2, dp={"name": "fsdp"}),
    }


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Run]]:
    return run_distributed_test(_two_rank_cases, 2, timeout=400)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", ["ddp", "fsdp", "tp", "pp_1f1b", "pp_interleaved"])
def test_each_layout_trains_as_one_process(
    layout: str, two_ranks: list[dict[str, Run]], single: Run
) -> None:
    for rank in two_ranks:
        assert_same_run(rank[layout], single)


# -- post-training --------------------------------------------------------------------------------


def test_dpo_trains_an_moe_policy_against_an_moe_reference(tmp_path: Path) -> None:
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
        rank_microbatch_size=2 * seq, optim=AdamWConfig(lr=3e-3), beta=0.5
    ).build(config.build(seed=0))
    reference = {n: p.detach().clone() for n, p in module.reference.model.named_parameters()}
    loader = PreferenceDataLoader(
        encode_preference_pairs(pairs, tok, seq), global_batch_size=4 * 4 * seq, seed=0
    )
    record = Record()
    TrainerConfig(
        save_folder=str(tmp_path), metrics_collect_interval=1, device="cpu",
        max_duration=Duration.steps(3), no_checkpoints=True, callbacks={"record": record},
    ).build(module, loader).fit()  # fmt: skip
    first, last = record.metrics[1], record.metrics[3]
    # The reference is the initial policy: the MoE routes the same in train and eval mode.
    assert first["train/DPO loss"] == pytest.approx(0.6931472, abs=1e-6)
    assert last["train/DPO loss"] < first["train/DPO loss"]
    assert 1.5 < first["train/load balancing loss"] < 3.0 and first["moe/dropped tokens"] == 0
    # 4 pairs per step, chosen and rejected: every token of both, top-2.
    counts = [first[f"moe/layer 0/expert {e} tokens"] for e in range(4)]
    assert sum(counts) == 4 * 2 * seq * 2
    assert record.grads[1]["blocks.0.feed_forward.router.weight"].abs().sum() > 0
    for name, param in module.reference.model.named_parameters():
        assert torch.equal(param, reference[name]) and param.grad is None, name


class PackedLoader(TokenTensorDataLoader):
    """SFT-shaped batches: masked labels and two packed documents per sequence."""

    def _iter_batches(self) -> Iterator[dict[str, Any]]:
        for batch in super()._iter_batches():
            ids = batch["input_ids"]
            labels = torch.where(ids % 3 == 0, -100, torch.roll(ids, -1, 1))
            doc_ids = (torch.arange(SEQ_LEN) >= SEQ_LEN // 2).long().expand_as(ids)
            yield {"input_ids": ids, "labels": labels, "doc_ids": doc_ids.contiguous()}


def test_sft_batches_train_an_moe() -> None:
    """Packed documents with masked labels (what SFT trains on): every token is routed."""
    module = TransformerTrainModuleConfig(
        rank_microbatch_size=2 * SEQ_LEN, optim=AdamWConfig(lr=1e-2)
    ).build(model_config().build(seed=0))
    loader = PackedLoader(
        random_token_instances(16, SEQ_LEN, VOCAB, seed=3), global_batch_size=4 * SEQ_LEN
    )
    record = Record()
    TrainerConfig(
        save_folder=tempfile.mkdtemp(), metrics_collect_interval=1, device="cpu",
        max_duration=Duration.steps(2), no_checkpoints=True, callbacks={"record": record},
    ).build(module, loader).fit()  # fmt: skip
    for metrics in record.metrics.values():
        assert "train/padding fraction" in metrics and metrics["moe/dropped tokens"] == 0
        counts = [metrics[f"moe/layer 2/expert {e} tokens"] for e in range(4)]
        assert sum(counts) == 4 * SEQ_LEN * 2
    assert record.metrics[2]["train/CE loss"] < record.metrics[1]["train/CE loss"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_context_parallelism_routes_every_token_once(
    two_ranks: list[dict[str, Run]], single: Run
) -> None:
    """Each context-parallel rank routes its share of every sequence: the first step's loss
    and expert loads are one process's. Its load-balancing loss is each share's (the
    fractions are per rank, as under data parallelism), so later steps may differ slightly."""
    for rank in two_ranks:
        got, want = rank["cp"].metrics[1], single.metrics[1]
        assert got["train/CE loss"] == pytest.approx(want["train/CE loss"], rel=1e-5)
        assert got["moe/dropped tokens"] == 0
        for name, value in want.items():
            if name.startswith("moe/layer") and name.endswith("tokens"):
                assert got[name] == value, name
        assert 1.9 < got["train/load balancing loss"] < 3.0
