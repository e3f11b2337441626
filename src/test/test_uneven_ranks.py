"""Two FSDP2 ranks with deliberately uneven data: every train module keeps them in step.

Under FSDP every forward all-gathers and every backward reduce-scatters, so a rank that ran
fewer micro-batches than the other would leave it blocked in a collective (these tests would
time out). Here the ranks' batches differ in rows, widths and documents; the micro-batch
count is agreed and the rank with less runs padding micro-batches, which must change
nothing: each test checks the gradients against one process's over both ranks' data, and
that both ranks ran the same number of forward calls.
"""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from testutils import run_distributed_test

from olmolike.data.preference import PreferenceDataLoader, split_pair_rows
from olmolike.data.prompts import PromptRecord
from olmolike.data.tokenizer import ByteTokenizer
from olmolike.distributed.parallel import DataParallelConfig, DataParallelType
from olmolike.distributed.utils import agree_counts, broadcast_object, get_rank
from olmolike.nn import TransformerConfig
from olmolike.nn.functional import dpo_loss, sequence_log_probs, token_kl_divergence
from olmolike.optim import AdamWConfig
from olmolike.train import BasicTrainModule
from olmolike.train.train_module.dpo import DPOTrainModuleConfig
from olmolike.train.train_module.grpo import (
    GRPOLossConfig,
    GRPOTrainModuleConfig,
    RewardConfig,
    RewardRegistry,
    SamplingConfig,
)
from olmolike.train.train_module.grpo.loss import grpo_loss
from olmolike.train.train_module.grpo.rollout import Rollout, completion_logps
from olmolike.train.train_module.transformer import TransformerTrainModuleConfig
from olmolike.train.train_module.two_stage_kl import TwoStageKLTrainModuleConfig

VOCAB = 64
TOK = ByteTokenizer()
CPU = torch.device("cpu")


def model_config(vocab: int = VOCAB) -> TransformerConfig:
    return TransformerConfig(
        vocab_size=vocab, d_model=32, n_layers=2, n_heads=2, max_sequence_length=24
    )


def fsdp() -> DataParallelConfig:
    return DataParallelConfig(name=DataParallelType.fsdp)


@dataclass
class AtStep:
    """What the train modules read from their trainer in these tests' steps."""

    global_step: int = 1
    data_loader: Any = None
    work_dir: Path | None = None


def count_forwards(*models: torch.nn.Module) -> list[int]:
    calls: list[int] = []
    for model in models:
        model.register_forward_hook(lambda *_: calls.append(1))
    return calls


def full_grads(model: torch.nn.Module) -> list[torch.Tensor]:
    out = []
    for p in model.parameters():
        grad = p.grad
        assert grad is not None
        out.append((grad.full_tensor() if hasattr(grad, "full_tensor") else grad).clone())
    return out


def assert_same_grads(got: list[torch.Tensor], model: torch.nn.Module) -> None:
    want = [p.grad for p in model.parameters()]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


# -- language-model losses: SFT (packed), plain LM, two-stage KL ------------------------------


def lm_batch(rank: int) -> dict[str, torch.Tensor]:
    """Rank 0: 6 packed rows of 8 tokens, two documents each (2 micro-batches of 24 tokens);
    rank 1: one row of 12 tokens with three documents and padding (1 micro-batch)."""
    rows, width = (6, 8) if rank == 0 else (1, 12)
    ids = torch.randint(0, VOCAB, (rows, width), generator=torch.Generator().manual_seed(rank))
    docs = [0] * 5 + [1] * 3 if rank == 0 else [0] * 4 + [1] * 4 + [2] * 2 + [-1] * 2
    doc_ids = torch.tensor(docs).expand(rows, -1).clone()
    labels = F.pad(ids[:, 1:], (0, 1), value=-100)
    # Nothing is learnt across a document boundary or on padding.
    labels[(doc_ids != F.pad(doc_ids[:, 1:], (0, 1), value=-1)) | (doc_ids < 0)] = -100
    return {"input_ids": ids, "labels": labels, "doc_ids": doc_ids}


def build_lm_module(kind: str, model: torch.nn.Module) -> Any:
    if kind == "basic":
        # BasicTrainModule trains a model sharded beforehand: the mean is per rank.
        from olmolike.distributed.parallel import apply_fsdp

        apply_fsdp(model, fsdp().build_mesh("cpu"))
        return BasicTrainModule(model, torch.optim.SGD(model.parameters()), 24)
    kwargs: dict[str, Any] = {
        "rank_microbatch_size": 24,
        "dp_config": fsdp(),
        "optim": AdamWConfig(),
    }
    if kind == "two_stage_kl":
        module = TwoStageKLTrainModuleConfig(stage1_steps=0, beta=0.5, **kwargs).build(model, CPU)
        module._trainer = AtStep()  # type: ignore[assignment]  # step 1 is in stage 2
        return module
    return TransformerTrainModuleConfig(**kwargs).build(model, CPU)


def _lm_step(kind: str) -> dict[str, Any]:
    rank = get_rank()
    module = build_lm_module(kind, model_config().build(seed=0))
    calls = count_forwards(module.model)
    batch = lm_batch(rank)
    if kind != "transformer":  # packed documents are for the transformer module
        batch.pop("doc_ids")
    module.train_batch(batch, dry_run=True)
    return {
        "grads": full_grads(module.model),
        "calls": len(calls),
        "agreed": agree_counts([rank + 1, 5]),
        # A process group whenever distributed: None would read as "one process" to helpers.
        "dp_group_is_world": module.dp_process_group is torch.distributed.group.WORLD,
    }


def lm_expected_grads(kind: str) -> torch.nn.Module:
    """One process's gradients over both ranks' batches."""
    model = model_config().build(seed=0)
    parts = []
    for rank in (0, 1):
        batch = lm_batch(rank)
        kwargs = {"doc_ids": batch["doc_ids"]} if kind == "transformer" else {}
        logits = model(batch["input_ids"], **kwargs)
        labels = batch["labels"]
        ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        tokens = (labels != -100).sum()
        kl = token_kl_divergence(logits, logits.detach(), labels) * tokens
        parts.append((ce + 0.5 * kl if kind == "two_stage_kl" else ce, tokens))
    if kind == "basic":  # each rank's own token mean, averaged over the ranks
        loss = sum(total / tokens for total, tokens in parts) / 2
    else:  # the token mean over both ranks
        loss = sum(total for total, _ in parts) / sum(tokens for _, tokens in parts)
    assert isinstance(loss, torch.Tensor)
    loss.backward()
    return model


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["transformer", "basic", "two_stage_kl"])
def test_uneven_rows_lengths_and_documents(kind: str) -> None:
    ranks = run_distributed_test(_lm_step, 2, args=(kind,), timeout=200)
    assert ranks[0]["calls"] == ranks[1]["calls"]
    want = lm_expected_grads(kind)
    for result in ranks:
        assert_same_grads(result["grads"], want)
        assert result["agreed"].max == [2, 5] and result["agreed"].sum == [3, 10]
        assert result["dp_group_is_world"]


def test_one_process_agrees_with_itself_without_a_collective() -> None:
    agreed = agree_counts([3, 0])
    assert agreed.max == agreed.sum == [3, 0]


# -- DPO, with a live or a precomputed reference ----------------------------------------------


def pair_rows(pairs: int, seq_len: int, seed: int) -> torch.Tensor:
    """Preference rows (chosen ids, labels, rejected ids, labels): the first half of each
    sequence is the prompt (not trained on)."""
    gen = torch.Generator().manual_seed(seed)
    sides = []
    for _ in range(2):
        ids = torch.randint(0, VOCAB, (pairs, seq_len), generator=gen)
        labels = F.pad(ids[:, 1:], (0, 1), value=-100)
        labels[:, : seq_len // 2] = -100
        sides += [ids, labels]
    return torch.cat(sides, dim=1)


def dpo_rank_rows(variant: str, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, their index among all pairs). Live: rank 0 has 1 pair of 8 tokens (1 micro-batch
    of 3 pairs), rank 1 3 pairs of 12 (2 of 2). Precomputed: all 8 tokens wide, 1 pair per
    micro-batch: 1 against 3."""
    if variant == "live":
        rows = pair_rows(1, 8, seed=0) if rank == 0 else pair_rows(3, 12, seed=1)
        return rows, torch.arange(rows.shape[0])
    every = pair_rows(4, 8, seed=2)
    index = torch.tensor([0]) if rank == 0 else torch.tensor([1, 2, 3])
    return every[index], index


def _dpo_step(variant: str) -> dict[str, Any]:
    rank = get_rank()
    work_dir = Path(broadcast_object(tempfile.mkdtemp()))
    precompute = variant == "precomputed"
    module = DPOTrainModuleConfig(
        rank_microbatch_size=8 if precompute else 24,
        dp_config=fsdp(),
        precompute_reference_logps=precompute,
    ).build(model_config().build(seed=0), CPU)
    loader = PreferenceDataLoader(pair_rows(4, 8, seed=2), global_batch_size=4 * 32, seed=0)
    module._trainer = AtStep(data_loader=loader, work_dir=work_dir)  # type: ignore[assignment]
    calls = count_forwards(module.model, module.reference.model)
    rows, index = dpo_rank_rows(variant, rank)
    batch: dict[str, Any] = split_pair_rows(rows)
    if precompute:
        batch["index"] = index
    module.train_batch(batch, dry_run=True)
    return {"grads": full_grads(module.model), "calls": len(calls)}


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("variant", ["live", "precomputed"])
def test_dpo_with_uneven_pairs_and_lengths(variant: str) -> None:
    ranks = run_distributed_test(_dpo_step, 2, args=(variant,), timeout=200)
    assert ranks[0]["calls"] == ranks[1]["calls"]
    model = model_config().build(seed=0)
    logps: dict[str, list[tuple[torch.Tensor, ...]]] = {"pol": [], "ref": []}
    for rank in (0, 1):
        batch = split_pair_rows(dpo_rank_rows(variant, rank)[0])
        pol, _ = sequence_log_probs(model(batch["input_ids"]), batch["labels"])
        logps["pol"].append(pol.chunk(2))
        logps["ref"].append(pol.detach().chunk(2))  # the reference is the initial policy
    pol_c, pol_r = (torch.cat(side) for side in zip(*logps["pol"]))
    ref_c, ref_r = (torch.cat(side) for side in zip(*logps["ref"]))
    dpo_loss(pol_c, pol_r, ref_c, ref_r, beta=0.1).loss.backward()  # the mean over all 4 pairs
    for result in ranks:
        assert_same_grads(result["grads"], model)


# -- GRPO: rollouts of different widths and numbers of prompts --------------------------------

RANK_PROMPTS = [["1+1="], ["123456+654321=", "99999+1="]]
"""Rank 0's rollout is about 10 tokens wide (2 completions per 24-token micro-batch), rank 1's
about 20 (1 per micro-batch), and rank 1 has twice the prompts."""


def digits(completions: list[str], **_: Any) -> list[float]:
    return [sum(c.isdigit() for c in s) / 4 for s in completions]


def grpo_loss_config(kl_coef: float) -> GRPOLossConfig:
    return GRPOLossConfig(group_size=2, kl_coef=kl_coef)


def _grpo_step(kl_coef: float, iterations: int, minibatches: int) -> dict[str, Any]:
    registry = RewardRegistry()
    registry.register("digits", digits)
    module = GRPOTrainModuleConfig(
        rank_microbatch_size=24,
        loss=grpo_loss_config(kl_coef),
        sampling=SamplingConfig(max_new_tokens=6),
        rewards=[RewardConfig("digits")],
        num_iterations=iterations,
        num_minibatches=minibatches,
        dp_config=fsdp(),
        seed=3,
    ).build(model_config(TOK.vocab_size).build(seed=0), CPU, tokenizer=TOK, registry=registry)
    module._trainer = AtStep()  # type: ignore[assignment]
    models = [module.model] + ([module.reference.model] if module.reference else [])
    calls = count_forwards(*models)
    records = [PromptRecord(p, {}) for p in RANK_PROMPTS[get_rank()]]
    module.train_batch({"records": records}, dry_run=True)
    rollout = module._pending["rollout"]
    return {
        "grads": full_grads(module.model),
        "calls": len(calls),
        "rollout": dataclasses.replace(rollout, metrics={}),
    }


def grpo_expected_grads(rollouts: list[Rollout], kl_coef: float) -> torch.nn.Module:
    """One process's gradient of the first update over both ranks' rollouts: the token mean."""
    model = model_config(TOK.vocab_size).build(seed=0)
    total, tokens = torch.zeros(()), torch.zeros(())
    for out in rollouts:
        logps, _ = completion_logps(model, out, vocab_size=TOK.vocab_size)
        ref = logps.detach() if kl_coef else None  # the reference is the step-1 policy
        loss, _ = grpo_loss(
            logps, logps.detach(), out.advantages, out.completion_mask,
            grpo_loss_config(kl_coef), ref_logps=ref,
        )  # fmt: skip
        total = total + loss * out.completion_mask.sum()
        tokens = tokens + out.completion_mask.sum()
    (total / tokens).backward()
    return model


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("kl_coef", "iterations", "minibatches"),
    [(0.0, 1, 1), (0.05, 1, 1), (0.05, 2, 2)],
    ids=["plain", "kl", "kl-two-updates-two-minibatches"],
)
def test_grpo_with_rollouts_of_different_widths(
    kl_coef: float, iterations: int, minibatches: int
) -> None:
    ranks = run_distributed_test(
        _grpo_step, 2, args=(kl_coef, iterations, minibatches), timeout=260
    )
    assert ranks[0]["calls"] == ranks[1]["calls"]
    (rows_0, width_0), (rows_1, width_1) = (r["rollout"].input_ids.shape for r in ranks)
    assert (rows_0, rows_1) == (2, 4) and width_0 <= 12 < width_1  # 2 and 1 per micro-batch
    if iterations == 1:  # after two updates the gradient is of weights that moved
        want = grpo_expected_grads([r["rollout"] for r in ranks], kl_coef)
        for result in ranks:
            assert_same_grads(result["grads"], want)
