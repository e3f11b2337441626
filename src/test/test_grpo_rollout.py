"""The GRPO rollout: sampling G completions per prompt, scoring, advantages, log-probs."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from olmolike.data.prompts import PromptRecord
from olmolike.data.tokenizer import ByteTokenizer
from olmolike.exceptions import ConfigurationError, DataError
from olmolike.nn import Transformer, TransformerConfig
from olmolike.train.train_module.grpo import (
    GRPOLossConfig,
    RewardConfig,
    RewardFunctionError,
    RewardRegistry,
    group_advantages,
    grpo_loss,
)
from olmolike.train.train_module.grpo.rollout import SamplingConfig, completion_logps, rollout

TOKENIZER = ByteTokenizer()
RECORDS = [PromptRecord("ab", {"target": "a"}), PromptRecord("hello", {"target": "l"})]


@pytest.fixture(scope="module")
def model() -> Transformer:
    config = TransformerConfig(
        vocab_size=264, d_model=32, n_layers=2, n_heads=4, max_sequence_length=32
    )
    return config.build(seed=0)


def registry() -> RewardRegistry:
    rewards = RewardRegistry()
    rewards.register("length", lambda completions, **_: [len(c) for c in completions])

    @rewards.reward("count")
    def count(completions: list[str], target: list[str], **_: Any) -> list[float]:
        return [c.count(t) for c, t in zip(completions, target)]

    return rewards


def run(model: Transformer, seed: int = 0, **overrides: Any) -> Any:
    args: dict[str, Any] = dict(
        sampling=SamplingConfig(max_new_tokens=10, temperature=1.5),
        loss=GRPOLossConfig(group_size=3),
        registry=registry(),
        rewards=[RewardConfig("length", weight=0.1), RewardConfig("count")],
        generator=torch.Generator().manual_seed(seed),
    )
    return rollout(model, TOKENIZER, RECORDS, **{**args, **overrides})


def test_rollout_groups_scores_and_packs(model: Transformer) -> None:
    out = run(model)
    assert out.completion_ids.shape[0] == 6 and len(out.completions) == 6
    targets = ["a"] * 3 + ["l"] * 3
    expected = torch.tensor([0.1 * len(c) + c.count(t) for c, t in zip(out.completions, targets)])
    torch.testing.assert_close(out.rewards, expected)
    torch.testing.assert_close(out.advantages, group_advantages(expected, 3)[0])
    for i, record in enumerate(r for r in RECORDS for _ in range(3)):
        prompt = TOKENIZER.encode(record.prompt)
        start, width = int(out.completion_start[i]), out.completion_ids.shape[1]
        assert start == len(prompt) and out.input_ids[i, :start].tolist() == prompt
        assert torch.equal(out.input_ids[i, start : start + width], out.completion_ids[i])
    for name in ("reward/mean", "reward/count/mean", "reward/length/std", "generation tokens/s",
                 "reward/zero advantage groups", "completion length/mean"):  # fmt: skip
        assert torch.isfinite(out.metrics[name])
    assert torch.equal(run(model).completion_ids, out.completion_ids)  # seeded
    assert not torch.equal(run(model, seed=1).completion_ids, out.completion_ids)


def test_completion_logps_equal_each_sequence_alone(model: Transformer) -> None:
    out = run(model)
    logps, entropy = completion_logps(model, out, with_entropy=True)
    assert entropy is not None and float(entropy) > 0
    for i in range(6):
        start, length = int(out.completion_start[i]), int(out.completion_mask[i].sum())
        ids = out.input_ids[i, : start + length]
        with torch.no_grad():
            alone = torch.log_softmax(model(ids[None])[0].float(), -1)
        expected = alone[start - 1 : start + length - 1].gather(-1, ids[start:, None])[:, 0]
        torch.testing.assert_close(logps[i, :length], expected, atol=1e-5, rtol=0)
        assert (logps[i, length:] == 0).all()
    logps.sum().backward()
    assert model.lm_head.weight.grad is not None
    model.zero_grad(set_to_none=True)


def test_completion_logps_are_those_of_the_sampled_distribution(model: Transformer) -> None:
    """At the sampling temperature, over the tokenizer's 258 ids of the model's 264."""
    out = run(model)
    with torch.no_grad():
        logps, _ = completion_logps(model, out, temperature=1.5, vocab_size=TOKENIZER.vocab_size)
        start, length = int(out.completion_start[0]), int(out.completion_mask[0].sum())
        ids = out.input_ids[0, : start + length]
        logits = model(ids[None])[0, :, : TOKENIZER.vocab_size].float()
        scaled = torch.log_softmax(logits / 1.5, -1)
    expected = scaled[start - 1 : start + length - 1].gather(-1, ids[start:, None])[:, 0]
    torch.testing.assert_close(logps[0, :length], expected, atol=1e-5, rtol=0)


def test_a_prompt_longer_than_the_context_is_refused(model: Transformer) -> None:
    long = [PromptRecord("x" * 25)]
    with pytest.raises(DataError, match=r"25 tokens; with max_new_tokens=10.*context of 32"):
        rollout(
            model,
            TOKENIZER,
            long,
            sampling=SamplingConfig(max_new_tokens=10),
            loss=GRPOLossConfig(group_size=2),
            registry=registry(),
            rewards=[RewardConfig("length")],
        )


def test_a_failing_reward_stops_the_rollout(model: Transformer) -> None:
    rewards = registry()
    rewards.register("broken", lambda completions, **_: [float("nan")] * len(completions))
    with pytest.raises(RewardFunctionError, match="'broken' returned a non-finite value"):
        run(model, registry=rewards, rewards=[RewardConfig("broken")])


def test_sampling_config_refuses_greedy() -> None:
    with pytest.raises(ConfigurationError, match="temperature"):
        SamplingConfig(temperature=0)


def fsdp_rollouts() -> dict[str, Any]:
    import torch.distributed as dist

    from olmolike.data.prompts import PromptSampler
    from olmolike.distributed.parallel import apply_fsdp

    rank = dist.get_rank()
    config = TransformerConfig(
        vocab_size=264, d_model=32, n_layers=2, n_heads=4, max_sequence_length=32
    )
    policy, reference = config.build(seed=0), config.build(seed=0)
    apply_fsdp(policy, dist.device_mesh.init_device_mesh("cpu", (2,)))
    records = [PromptRecord(f"q{i}", {"target": "q"}) for i in range(8)]
    batch = PromptSampler(records, prompts_per_rank=2, seed=0, rank=rank, world_size=2).next_batch()
    out, alone = (
        rollout(
            model,
            TOKENIZER,
            batch,
            sampling=SamplingConfig(max_new_tokens=6),
            loss=GRPOLossConfig(group_size=2),
            registry=registry(),
            rewards=[RewardConfig("count")],
            generator=torch.Generator().manual_seed(10 + rank),  # each rank its own samples
        )
        for model in (policy, reference)
    )
    return {
        "prompts": [r.prompt for r in batch],
        "same": torch.equal(out.completion_ids, alone.completion_ids)
        and torch.equal(out.advantages, alone.advantages),
    }


@pytest.mark.timeout(200)
def test_fsdp_ranks_roll_out_their_own_prompts() -> None:
    from testutils import run_distributed_test

    ranks = run_distributed_test(fsdp_rollouts, timeout=180)
    assert all(r["same"] for r in ranks)
    assert not set(ranks[0]["prompts"]) & set(ranks[1]["prompts"])


def tensor_parallel_logps() -> dict[tuple[bool, str], Any]:
    """Completion log-probs and entropy of a TP=2 model (vocabulary 264 split 132 + 132, the
    second half past the tokenizer's 258 in part) and of the unsplit model, at temperature 0.7,
    with the gradient of their sum; in fp32 and under bf16 autocast."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from olmolike.nn.parallel_plan import apply_tensor_parallel

    config = TransformerConfig(
        vocab_size=264, d_model=32, n_layers=2, n_heads=4, qk_norm=True, max_sequence_length=32
    )
    split, alone = config.build(seed=0), config.build(seed=0)
    apply_tensor_parallel(split, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
    out = run(alone)
    got = {}
    for autocast, (name, model) in itertools.product(
        (False, True), (("split", split), ("alone", alone))
    ):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logps, entropy = completion_logps(
                model, out, with_entropy=True, temperature=0.7, vocab_size=TOKENIZER.vocab_size
            )
        (logps.float() * out.completion_mask).sum().backward()
        grad = model.lm_head.weight.grad
        assert grad is not None and entropy is not None
        full = grad.full_tensor() if isinstance(grad, DTensor) else grad
        got[autocast, name] = (logps.float() * out.completion_mask, entropy.float(), full)
    return got


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_tensor_parallel_log_probs_and_entropy_equal_the_unsplit_models() -> None:
    """From the vocabulary-sharded logits, no row gathered: fp32 within 1e-5, and finite and
    close under bf16 autocast (a masked id divided by the temperature must not become -inf)."""
    from testutils import run_distributed_test

    for result in run_distributed_test(tensor_parallel_logps, timeout=180):
        for autocast, tolerance in ((False, 1e-5), (True, 5e-2)):
            split, alone = result[autocast, "split"], result[autocast, "alone"]
            for got, want in zip(split, alone, strict=True):
                assert torch.isfinite(got).all()
                torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)


@pytest.mark.timeout(300)
def test_the_pieces_together_raise_a_toy_reward() -> None:
    """Rollout, log-probs, loss and AdamW, 12 steps of 2 updates per generated batch: the
    share of ASCII bytes in the completions (about 1/2 for a random byte model) rises."""
    config = TransformerConfig(
        vocab_size=258, d_model=32, n_layers=2, n_heads=4, max_sequence_length=32
    )
    policy, reference = config.build(seed=0), config.build(seed=0)
    rewards = RewardRegistry()
    rewards.register(
        "ascii",
        lambda completions, **_: [sum(c < "\x80" for c in s) / max(len(s), 1) for s in completions],
    )
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    loss_config = GRPOLossConfig(group_size=8, kl_coef=0.01)
    generator = torch.Generator().manual_seed(0)
    means = []
    for step in range(12):
        batch = rollout(
            policy,
            TOKENIZER,
            [PromptRecord(p) for p in "abcd"],
            sampling=SamplingConfig(max_new_tokens=8),
            loss=loss_config,
            registry=rewards,
            rewards=[RewardConfig("ascii")],
            generator=generator,
        )
        means.append(float(batch.metrics["reward/mean"]))
        with torch.no_grad():
            old_logps, _ = completion_logps(policy, batch)
            ref_logps, _ = completion_logps(reference, batch)
        for update in range(2):
            logps, _ = completion_logps(policy, batch)
            loss, stats = grpo_loss(
                logps, old_logps, batch.advantages, batch.completion_mask, loss_config, ref_logps
            )
            if step == update == 0:  # policy = sampling policy = reference
                assert float(stats.ratio_mean) == 1.0 and float(stats.kl) == 0.0
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    assert sum(means[-3:]) / 3 > sum(means[:3]) / 3 + 0.1, means
