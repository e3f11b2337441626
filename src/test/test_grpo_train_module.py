"""The GRPO train module in the Trainer: metrics, exact resume on 1 and 2 ranks, bad inputs."""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from testutils import assert_within_adam_reach, run_distributed_test

from olmolike.data.prompts import PromptDataLoader, PromptRecord
from olmolike.data.tokenizer import ByteTokenizer
from olmolike.distributed.parallel import DataParallelConfig, DataParallelType
from olmolike.distributed.utils import broadcast_object, get_rank, get_world_size
from olmolike.exceptions import ConfigurationError, DataError
from olmolike.nn import TransformerConfig
from olmolike.optim import AdamWConfig, LinearWithWarmup
from olmolike.train import Callback, Duration, Trainer, TrainerConfig
from olmolike.train.train_module.grpo import (
    GRPOLossConfig,
    GRPOTrainModuleConfig,
    RewardConfig,
    RewardFunctionError,
    RewardRegistry,
    SamplingConfig,
)

TOK = ByteTokenizer()
STEPS = 4
RECORDS = [PromptRecord(f"{i}+{i % 3}=", {"answer": str(i + i % 3)}) for i in range(16)]


@dataclass
class Log(Callback):
    metrics: dict[int, dict[str, float]] = field(default_factory=dict)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.metrics[step] = dict(metrics)


def registry(**extra: Any) -> RewardRegistry:
    rewards = RewardRegistry()
    rewards.register("digits", lambda completions, **_: [sum(c.isdigit() for c in s) / 4 for s in completions])  # fmt: skip
    rewards.register(
        "exact", lambda completions, answer, **_: [float(c == a) for c, a in zip(completions, answer)]
    )  # fmt: skip
    for name, fn in extra.items():
        rewards.register(name, fn)
    return rewards


def model_config(context: int = 24) -> TransformerConfig:
    return TransformerConfig(
        vocab_size=TOK.vocab_size, d_model=32, n_layers=2, n_heads=2, max_sequence_length=context
    )


def build(
    folder: str | Path,
    *,
    dp: str | None = None,
    rewards: list[RewardConfig] | None = None,
    registry_extra: dict[str, Any] | None = None,
    records: list[PromptRecord] | None = None,
    context: int = 24,
    module_kwargs: dict[str, Any] | None = None,
    **trainer_kwargs: Any,
) -> tuple[Trainer, Log]:
    kwargs: dict[str, Any] = dict(
        rank_microbatch_size=48,  # 4 completions of width 12 per forward: 2 per minibatch
        optim=AdamWConfig(lr=3e-3),
        scheduler=LinearWithWarmup(warmup=3),
        max_grad_norm=1.0,
        loss=GRPOLossConfig(group_size=4, kl_coef=0.05),
        sampling=SamplingConfig(max_new_tokens=6),
        rewards=rewards or [RewardConfig("digits"), RewardConfig("exact", weight=2.0)],
        num_iterations=2,
        num_minibatches=2,
        sync_interval=2,
        seed=3,
        dp_config=DataParallelConfig(name=DataParallelType(dp)) if dp else None,
    )
    kwargs.update(module_kwargs or {})
    module = GRPOTrainModuleConfig(**kwargs).build(
        model_config(context).build(seed=0),
        tokenizer=TOK,
        registry=registry(**(registry_extra or {})),
    )
    loader = PromptDataLoader(records or RECORDS, prompts_per_rank=4 // get_world_size(), seed=1)
    log = Log()
    trainer_kwargs.setdefault("max_duration", Duration.steps(STEPS))
    trainer = TrainerConfig(
        save_folder=str(folder), metrics_collect_interval=1, device="cpu",
        callbacks={"log": log}, **trainer_kwargs,
    ).build(module, loader)  # fmt: skip
    return trainer, log


def params(trainer: Trainer) -> list[torch.Tensor]:
    out = []
    for p in trainer.train_module.model.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out.append(full.detach().clone())
    return out


def test_metrics_are_reported_and_consistent(tmp_path: Path) -> None:
    trainer, log = build(tmp_path, no_checkpoints=True)
    trainer.fit()
    first = log.metrics[1]
    for name in ("reward/mean", "reward/std", "reward/digits/mean", "reward/exact/std", "KL",
                 "clip fraction", "entropy", "completion length/mean", "generation tokens/s",
                 "generation share", "reward/zero advantage groups", "GRPO loss", "ratio",
                 "clip fraction/low", "clip fraction/high", "clip fraction/low min",
                 "clip fraction/high max"):  # fmt: skip
        assert math.isfinite(first[f"train/{name}"]), name
    for step in log.metrics.values():  # a completion's shares bound the token means
        assert 0 <= step["train/clip fraction/low min"] <= step["train/clip fraction/low"]
        assert step["train/clip fraction/high"] <= step["train/clip fraction/high max"] <= 1
    assert "train/CE loss" not in first  # GRPO's loss is train/GRPO loss, its module's name
    assert trainer.train_module.loss_metric == "train/GRPO loss"
    assert 0 < first["train/generation share"] < 1
    assert 0 <= first["train/reward/zero advantage groups"] <= 1
    assert first["train/entropy"] > 0
    assert 1 <= first["train/completion length/mean"] <= 6
    assert 0 <= first["train/KL"] < 0.1 and 0 <= first["train/clip fraction"] <= 1
    assert first["train/reference step"] == 0 and log.metrics[3]["train/reference step"] == 2
    total = first["train/reward/digits/mean"] + 2 * first["train/reward/exact/mean"]
    assert first["train/reward/mean"] == pytest.approx(total, abs=1e-6)


def test_one_update_per_step_is_on_policy(tmp_path: Path) -> None:
    """With one update, pi = pi_old = pi_ref at step 1: ratio 1, nothing clipped, KL 0."""
    one = {"num_iterations": 1, "num_minibatches": 1, "sync_interval": None, "scheduler": None}
    trainer, log = build(tmp_path, module_kwargs=one, no_checkpoints=True,
                         max_duration=Duration.steps(1))  # fmt: skip
    trainer.fit()
    first = log.metrics[1]
    assert first["train/ratio"] == 1.0 and first["train/clip fraction"] == 0.0
    assert first["train/KL"] == pytest.approx(0.0, abs=1e-7)


@pytest.mark.parametrize("aggregation", ["token", "sequence", "bnpo", "dapo", "dr_grpo"])
def test_micro_batches_do_not_change_the_update(tmp_path: Path, aggregation: str) -> None:
    loss = GRPOLossConfig(
        group_size=4, kl_coef=0.05, aggregation=aggregation, scale_rewards="batch"
    )  # type: ignore[arg-type]
    got, first_grads = [], []
    for micro in (12, 48, 960):  # 1, 4 and all 16 completions of width 12 per forward
        trainer, _ = build(tmp_path / str(micro), no_checkpoints=True,
                           max_duration=Duration.steps(1),
                           module_kwargs={"rank_microbatch_size": micro, "loss": loss})  # fmt: skip
        first_grads.append(first_update_grads(trainer))
        trainer.fit()
        got.append(params(trainer))
    # The first update's gradients match tightly; after the step's 4 AdamW updates the weights
    # can differ by what Adam moves an element whose gradient is near zero (rounding decides
    # its direction, and the split into micro-batches changes the rounding).
    for other, other_grads in zip(got[1:], first_grads[1:]):
        assert len(other_grads) == len(first_grads[0]) == len(got[0])
        for a, b in zip(first_grads[0], other_grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        assert_within_adam_reach(other, got[0], lr=3e-3, updates=4)


def first_update_grads(trainer: Trainer) -> list[torch.Tensor]:
    """Filled, when ``trainer`` runs, with the gradients its first optimizer update applies."""
    grads: list[torch.Tensor] = []

    def take(*_: Any) -> None:
        if not grads:
            model = trainer.train_module.model  # type: ignore[attr-defined]
            grads.extend(p.grad.detach().clone() for p in model.parameters() if p.grad is not None)

    trainer.train_module.optim.register_step_pre_hook(take)  # type: ignore[attr-defined]
    return grads


def test_lr_schedule_counts_optimizer_updates(tmp_path: Path) -> None:
    trainer, log = build(tmp_path, no_checkpoints=True)
    trainer.fit()
    schedule = LinearWithWarmup(warmup=3)
    updates = 4  # 2 iterations x 2 minibatches
    for step in (1, STEPS):
        want = schedule.get_lr(3e-3, step * updates, STEPS * updates)  # the step's last update
        assert log.metrics[step]["optim/LR (decay)"] == pytest.approx(want)


def test_resume_is_bit_identical(tmp_path: Path) -> None:
    full, full_log = build(tmp_path / "full")
    full.fit()
    first, _ = build(tmp_path / "resumed", hard_stop=Duration.steps(STEPS // 2))
    first.fit()
    second, second_log = build(tmp_path / "resumed")
    second.fit()
    for a, b in zip(params(full), params(second)):
        assert torch.equal(a, b)
    for step in (3, 4):
        assert (
            second_log.metrics[step]["train/GRPO loss"] == full_log.metrics[step]["train/GRPO loss"]
        )


def _two_rank_resume(dp: str) -> dict[str, Any]:
    folder = broadcast_object(tempfile.mkdtemp())
    # The collectives of the whole-batch reward std and of dapo's generated-batch token count.
    loss = GRPOLossConfig(group_size=4, kl_coef=0.05, aggregation="dapo", scale_rewards="batch")  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {"dp": dp, "module_kwargs": {"loss": loss}}
    full, _ = build(f"{folder}/full", **kwargs)
    full.fit()
    first, _ = build(f"{folder}/resumed", hard_stop=Duration.steps(3), **kwargs)
    first.fit()
    second, log = build(f"{folder}/resumed", **kwargs)
    second.fit()
    loader = second.data_loader
    assert isinstance(loader, PromptDataLoader)
    return {
        "same": all(torch.equal(a, b) for a, b in zip(params(full), params(second))),
        "prompts": [r.prompt for r in loader.get_mock_batch()["records"]],
        "rank": get_rank(),
        "reward": log.metrics[STEPS]["train/reward/mean"],
    }


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("dp", ["ddp", "fsdp"])
def test_two_ranks_resume_bit_identical_with_their_own_prompts(dp: str) -> None:
    ranks = run_distributed_test(_two_rank_resume, 2, args=(dp,), timeout=280)
    assert all(r["same"] for r in ranks)
    assert not set(ranks[0]["prompts"]) & set(ranks[1]["prompts"])
    assert ranks[0]["reward"] == ranks[1]["reward"]  # the logged metric is reduced over ranks


def _raises(*_: Any, **__: Any) -> list[float]:
    raise KeyError("answer")


@pytest.mark.parametrize(
    ("fn", "match"),
    [(_raises, "'bad' raised KeyError"),
     (lambda completions, **_: [float("nan")] * len(completions), "'bad' returned a non-finite")],
)  # fmt: skip
def test_a_failing_reward_stops_the_run_naming_it(tmp_path: Path, fn: Any, match: str) -> None:
    trainer, _ = build(
        tmp_path, rewards=[RewardConfig("bad")], registry_extra={"bad": fn}, no_checkpoints=True
    )
    with pytest.raises(RewardFunctionError, match=match):
        trainer.fit()


def _fails_on_rank_1(completions: list[str], **_: Any) -> list[float]:
    if get_rank() == 1:
        raise ValueError("rank 1 cannot score")
    return [0.0] * len(completions)


def _one_rank_fails() -> str:
    trainer, _ = build(
        broadcast_object(tempfile.mkdtemp()), rewards=[RewardConfig("flaky")],
        registry_extra={"flaky": _fails_on_rank_1}, no_checkpoints=True,
    )  # fmt: skip
    with pytest.raises(RewardFunctionError) as caught:
        trainer.fit()
    return str(caught.value)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_reward_failing_on_one_rank_fails_every_rank_at_once() -> None:
    messages = run_distributed_test(_one_rank_fails, 2, timeout=180)
    assert "failed on rank 1 at step 1" in messages[0]
    assert "'flaky' raised ValueError: rank 1 cannot score" in messages[1]


def test_equal_rewards_give_zero_advantage_and_say_so(tmp_path: Path) -> None:
    trainer, log = build(
        tmp_path, rewards=[RewardConfig("one")], no_checkpoints=True,
        registry_extra={"one": lambda completions, **_: [1.0] * len(completions)},
        module_kwargs={"loss": GRPOLossConfig(group_size=4), "sync_interval": None},
    )  # fmt: skip
    before = params(trainer)
    trainer.fit()
    metrics = log.metrics[1]
    assert metrics["train/reward/zero advantage groups"] == 1.0
    assert metrics["train/reward/std"] == 0.0 and metrics["train/GRPO loss"] == 0.0
    # No advantage and no KL term: AdamW's weight decay is the only change.
    assert all(torch.allclose(a, b, atol=1e-3) for a, b in zip(before, params(trainer)))


def test_a_prompt_longer_than_the_context_fails_before_the_first_step(tmp_path: Path) -> None:
    records = [*RECORDS, PromptRecord("9" * 20, {"answer": "9"})]
    with pytest.raises(DataError, match="exceeds the model's context of 24 tokens"):
        build(tmp_path, records=records, no_checkpoints=True)


def test_bad_configs_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="group_size"):
        GRPOLossConfig(group_size=1)
    with pytest.raises(ConfigurationError, match=r"unknown reward function 'nope'.*digits, exact"):
        build(tmp_path, rewards=[RewardConfig("nope")])
    with pytest.raises(ConfigurationError, match="sync_interval"):
        GRPOTrainModuleConfig(rewards=[RewardConfig("digits")], sync_interval=2)
    in_tokens = LinearWithWarmup(warmup=3, units="tokens")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="counts optimizer updates") as info:
        GRPOTrainModuleConfig(rewards=[RewardConfig("digits")], scheduler=in_tokens)
    assert info.value.path == "scheduler.units"
    with pytest.raises(ConfigurationError, match="num_minibatches"):
        build(tmp_path, module_kwargs={"num_minibatches": 3})
