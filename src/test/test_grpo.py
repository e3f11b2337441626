"""GRPO building blocks: reward registry and scoring, group advantages, the clipped loss."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from olmolike.exceptions import ConfigurationError
from olmolike.train.train_module.grpo import (
    GRPOLossConfig,
    LossAggregation,
    RewardConfig,
    RewardFunctionError,
    RewardRegistry,
    group_advantages,
    grpo_loss,
    score_completions,
    token_entropy,
)

# -- rewards ----------------------------------------------------------------------------------


def registry() -> RewardRegistry:
    rewards = RewardRegistry()

    @rewards.reward("exact")
    def exact(completions: list[str], answer: list[str], **_: Any) -> list[float]:
        return [float(c.strip() == a) for c, a in zip(completions, answer)]

    rewards.register("short", lambda completions, **_: [-len(c) / 10 for c in completions])
    return rewards


def test_rewards_are_weighted_and_reported_per_function() -> None:
    scores = score_completions(
        registry(),
        [RewardConfig("exact", weight=2.0), RewardConfig("short", weight=0.5)],
        prompts=["1+1=", "1+1=", "2+2="],
        completions=["2", " 3", "4 "],
        fields={"answer": ["2", "2", "4"]},
    )
    assert scores.per_function["exact"].tolist() == [1.0, 0.0, 1.0]
    torch.testing.assert_close(scores.per_function["short"], torch.tensor([-0.1, -0.2, -0.2]))
    torch.testing.assert_close(scores.total, torch.tensor([1.95, -0.1, 1.9]))


def test_unknown_reward_name_is_a_configuration_error_listing_the_known_ones() -> None:
    with pytest.raises(ConfigurationError, match=r"rewards\[1\].name.*'exakt'.*exact, short"):
        registry().check([RewardConfig("exact"), RewardConfig("exakt")])
    with pytest.raises(ConfigurationError, match="at least one"):
        registry().check([])
    with pytest.raises(ConfigurationError, match="already registered"):
        registry().register("exact", lambda **_: [])
    with pytest.raises(ConfigurationError, match="weight"):
        RewardConfig("exact", weight=math.nan)
    # A config names functions, it never imports them: the registry is the only source.
    assert RewardConfig.from_dict({"name": "short", "weight": 3}).weight == 3.0


@pytest.mark.parametrize(
    ("fn", "match"),
    [
        (lambda completions, **_: 1 / 0, "'bad' raised ZeroDivisionError"),
        (lambda completions, **_: [1.0], "returned 1 values for 2 completions"),
        (lambda completions, **_: [0.0, math.nan], "non-finite value \\(nan\\) for completion 1"),
        (lambda completions, **_: [math.inf, 0.0], "non-finite value \\(inf\\) for completion 0"),
        (lambda completions, **_: ["x", 1], "raised ValueError"),
    ],
)
def test_a_failing_reward_function_is_named(fn: Any, match: str) -> None:
    rewards = RewardRegistry()
    rewards.register("bad", fn)
    with pytest.raises(RewardFunctionError, match=match):
        score_completions(rewards, [RewardConfig("bad")], ["p", "q"], ["a", "b"])


def test_a_field_named_like_an_argument_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="shadow"):
        score_completions(registry(), [RewardConfig("short")], ["p"], ["a"], {"prompts": ["x"]})


# -- advantages -------------------------------------------------------------------------------


def test_group_advantages_normalise_within_each_group() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 2.0, 2.0])
    advantages, stats = group_advantages(rewards, 4, eps=1e-4)
    for start in (0, 4):
        group = rewards[start : start + 4]
        expected = (group - group.mean()) / (group.std() + 1e-4)  # Bessel-corrected std
        torch.testing.assert_close(advantages[start : start + 4], expected)
    raw, _ = group_advantages(rewards, 4, scale="none")
    torch.testing.assert_close(raw, torch.tensor([0.5, -0.5, -0.5, 0.5, 1.0, -1.0, 0.0, 0.0]))
    batch, _ = group_advantages(rewards, 4, scale="batch", eps=1e-4)
    torch.testing.assert_close(batch, raw / (rewards.std() + 1e-4))
    assert float(stats.zero_advantage_fraction) == 0.0
    with pytest.raises(ConfigurationError, match=r"scale: 'group_std' is not .*group, batch, none"):
        group_advantages(rewards, 4, scale="group_std")  # type: ignore[arg-type]


def test_groups_with_equal_rewards_get_zero_advantage_and_are_counted() -> None:
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 1.0, 7.0, 7.0, 7.0])
    advantages, stats = group_advantages(rewards, 3)
    assert advantages[:3].tolist() == [0.0, 0.0, 0.0] and advantages[6:].tolist() == [0.0] * 3
    assert torch.isfinite(advantages).all() and advantages[3:6].abs().min() > 0.5
    torch.testing.assert_close(stats.zero_advantage_fraction, torch.tensor(2 / 3))


def test_group_of_one_and_ragged_groups_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="group_size"):
        group_advantages(torch.ones(4), 1)
    with pytest.raises(ConfigurationError, match="group_size: must be >= 2"):
        GRPOLossConfig(group_size=1)
    with pytest.raises(ValueError, match="multiple of group_size=4"):
        group_advantages(torch.ones(6), 4)


# -- the loss ---------------------------------------------------------------------------------


def reference_loss(
    logps: torch.Tensor,
    old: torch.Tensor,
    ref: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    config: GRPOLossConfig,
) -> torch.Tensor:
    """The formula written out token by token with Python floats."""
    terms: list[list[float]] = []
    for b in range(logps.shape[0]):
        row = []
        for t in range(logps.shape[1]):
            if not mask[b, t]:
                continue
            rho = math.exp(float(logps[b, t] - old[b, t]))
            a = float(adv[b])
            clipped = min(max(rho, 1 - config.clip_eps_low), 1 + config.clip_high)
            d = float(ref[b, t] - logps[b, t])
            kl = (math.exp(d) - d - 1) * (rho if config.kl_importance_weighting else 1.0)
            row.append(-min(rho * a, clipped * a) + config.kl_coef * kl)
        terms.append(row)
    flat = [x for row in terms for x in row]
    if config.aggregation == LossAggregation.sequence:
        return torch.tensor(sum(sum(r) / max(len(r), 1) for r in terms) / len(terms))
    if config.aggregation == LossAggregation.dr_grpo:
        return torch.tensor(sum(flat) / (len(terms) * MAX_LENGTH))
    return torch.tensor(sum(flat) / len(flat))  # one batch on one rank: every token mean


MAX_LENGTH = 8


def loss_inputs(seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(4, 6, generator=g, dtype=torch.float64) * 3
    old = logps + torch.randn(4, 6, generator=g, dtype=torch.float64) * 0.3
    ref = logps + torch.randn(4, 6, generator=g, dtype=torch.float64) * 0.5
    adv = torch.tensor([1.0, -1.5, 0.5, -0.2], dtype=torch.float64)
    mask = torch.tensor([[1] * 6, [1] * 3 + [0] * 3, [1] * 5 + [0], [1] * 2 + [0] * 4])
    return logps, old, ref, adv, mask


@pytest.mark.parametrize("aggregation", list(LossAggregation))
@pytest.mark.parametrize(("clip_high", "weighting"), [(None, True), (0.28, False)])
def test_loss_matches_the_formula(
    aggregation: LossAggregation, clip_high: float | None, weighting: bool
) -> None:
    logps, old, ref, adv, mask = loss_inputs()
    config = GRPOLossConfig(
        kl_coef=0.1,
        aggregation=aggregation,
        clip_eps_high=clip_high,
        kl_importance_weighting=weighting,
    )
    loss, stats = grpo_loss(
        logps, old, adv, mask, config, ref_logps=ref, max_completion_length=MAX_LENGTH
    )
    torch.testing.assert_close(loss, reference_loss(logps, old, ref, adv, mask, config).double())
    assert 0 < float(stats.clip_fraction) < 1 and float(stats.kl) > 0


def test_clipped_tokens_have_no_gradient_and_clip_fraction_counts_them() -> None:
    logps = torch.log(torch.tensor([[1.5, 1.0], [0.5, 1.0]])).requires_grad_()
    old = torch.zeros(2, 2)
    adv = torch.tensor([1.0, -1.0])
    loss, stats = grpo_loss(logps, old, adv, torch.ones(2, 2), GRPOLossConfig())
    loss.backward()
    assert logps.grad is not None
    # ratio 1.5 > 1.2 with A > 0, and 0.5 < 0.8 with A < 0: clipped, zero gradient.
    assert logps.grad[0, 0] == 0 and logps.grad[1, 0] == 0
    assert logps.grad[0, 1] == -0.25 and logps.grad[1, 1] == 0.25
    assert float(stats.clip_fraction) == 0.5
    assert float(stats.clip_high_fraction) == 0.25 and float(stats.clip_low_fraction) == 0.25
    # Per completion: the first has 1 of 2 tokens clipped high, none low; the second 1 low.
    assert float(stats.clip_high_max) == 0.5 and float(stats.clip_low_min) == 0.0


def test_loss_guards() -> None:
    logps, old, ref, adv, mask = loss_inputs()
    with pytest.raises(ValueError, match="needs ref_logps"):
        grpo_loss(logps, old, adv, mask, GRPOLossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="advantages must be"):
        grpo_loss(logps, old, adv[:2], mask, GRPOLossConfig())
    with pytest.raises(ValueError, match="dr_grpo needs max_completion_length"):
        grpo_loss(logps, old, adv, mask, GRPOLossConfig(aggregation="dr_grpo"))
    # Without a KL coefficient the reference only feeds the KL metric.
    loss, stats = grpo_loss(logps, old, adv, mask, GRPOLossConfig(), ref_logps=ref)
    loss_no_ref, _ = grpo_loss(logps, old, adv, mask, GRPOLossConfig())
    assert torch.equal(loss, loss_no_ref) and float(stats.kl) > 0
    # An all-padding completion contributes 0 and no NaN.
    empty = torch.zeros_like(mask)
    assert float(grpo_loss(logps, old, adv, empty, GRPOLossConfig())[0]) == 0.0


def test_token_entropy() -> None:
    logits = torch.zeros(1, 2, 4)
    logits[0, 1] = torch.tensor([100.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(
        token_entropy(logits, torch.tensor([[1, 0]])), torch.tensor(math.log(4))
    )
    assert float(token_entropy(logits, torch.tensor([[0, 1]]))) < 1e-6
