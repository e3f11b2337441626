"""The GRPO objective: group-normalised advantages and the clipped surrogate with a KL penalty.

For each prompt, G completions are sampled and scored; completion ``i`` of a group gets the
advantage ``A_i = (r_i - mean(r)) / (std(r) + eps)`` (``std`` with Bessel's correction, as
TRL computes it), or ``r_i - mean(r)`` with ``scale_by_std=False`` (Dr. GRPO: the std scaling
up-weights groups whose rewards barely differ). Each completion token ``t`` then contributes::

    -min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A) + beta * KL_t
    rho_t = exp(log pi(t) - log pi_old(t))
    KL_t  = exp(log pi_ref(t) - log pi(t)) - (log pi_ref(t) - log pi(t)) - 1   (k3 estimator)
            (times rho_t with ``kl_importance_weighting``, the default)

where ``pi_old`` is the policy that sampled the completions (several optimisation steps per
generated batch make ``pi`` drift from it; the clip keeps each step in a trust region around
it) and ``pi_ref`` a frozen reference. The token terms are averaged over all completion
tokens of the batch (``LossAggregation.token``, TRL's ``loss_type="bnpo"``) or within each
completion and then over completions (``LossAggregation.sequence``, TRL's ``"grpo"``).

AstrAI's GRPO strategy writes the objective differently: its ratio is ``pi / pi_ref`` (the
frozen reference, refreshed every ``sync_interval`` steps) rather than ``pi / pi_old``, so the
clip bounds the drift from the reference instead of from the sampling policy within one
generated batch; and its KL penalty is the squared log-ratio ``(log pi - log pi_ref)^2``, whose
expectation is not a KL divergence (k3 is unbiased for KL(pi || pi_ref) under samples of pi,
non-negative, and has lower variance than the plain log-ratio). Here the standard form
(DeepSeekMath's GRPO, as TRL implements it) is used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ....config import Config, StrEnum
from ....exceptions import ConfigurationError

__all__ = [
    "AdvantageStats",
    "GRPOLossConfig",
    "GRPOLossStats",
    "LossAggregation",
    "group_advantages",
    "grpo_loss",
    "token_entropy",
]


class LossAggregation(StrEnum):
    """How per-token loss terms become one number."""

    token = "token"
    """Mean over every completion token of the batch: long completions weigh more."""
    sequence = "sequence"
    """Mean within each completion, then over completions: each completion weighs the same."""


@dataclass
class GRPOLossConfig(Config):
    """The coefficients of the GRPO objective."""

    group_size: int = 4
    """Completions sampled per prompt (G). At least 2: advantages compare completions of the
    same prompt, and one completion alone has nothing to be compared with."""
    scale_by_std: bool = True
    """Divide advantages by the group's reward std. Off, advantages are ``r - mean`` (Dr.
    GRPO), which does not up-weight groups whose rewards barely differ."""
    advantage_eps: float = 1e-4
    """Added to the std before dividing, so a small std cannot blow advantages up."""
    clip_eps_low: float = 0.2
    """The ratio pi / pi_old is clipped below at ``1 - clip_eps_low``."""
    clip_eps_high: float | None = None
    """...and above at ``1 + clip_eps_high``; None uses ``clip_eps_low`` (symmetric). DAPO
    raises it (e.g. 0.28) to let unlikely tokens gain probability faster."""
    kl_coef: float = 0.0
    """beta, the weight of the k3 KL penalty to the reference. 0 needs no reference model."""
    kl_importance_weighting: bool = True
    """Multiply each token's KL term by its ratio pi / pi_old. The completions were sampled
    from pi_old, not pi: weighted, the KL term's gradient is the unbiased gradient of
    KL(pi || pi_ref) (DeepSeek-V3.2; TRL's ``use_bias_correction_kl``, on by default). The
    ratio carries gradient even where it equals 1, so this changes the update on the first
    step of a generated batch too. Off gives DeepSeekMath's original objective."""
    aggregation: LossAggregation = LossAggregation.token
    """Mean over tokens or over sequences; see :class:`LossAggregation`."""

    def validate(self) -> None:
        if self.group_size < 2:
            raise self._invalid(
                "group_size",
                f"must be >= 2, got {self.group_size}: GRPO's advantage compares the completions "
                "of one prompt with each other, so a group of one always has advantage 0",
            )
        if not self.advantage_eps > 0:
            raise self._invalid("advantage_eps", f"must be > 0, got {self.advantage_eps}")
        if not 0 <= self.clip_eps_low < 1:
            raise self._invalid("clip_eps_low", f"must be in [0, 1), got {self.clip_eps_low}")
        if self.clip_eps_high is not None and self.clip_eps_high < 0:
            raise self._invalid("clip_eps_high", f"must be >= 0, got {self.clip_eps_high}")
        if self.kl_coef < 0:
            raise self._invalid("kl_coef", f"must be >= 0, got {self.kl_coef}")

    @property
    def clip_high(self) -> float:
        return self.clip_eps_low if self.clip_eps_high is None else self.clip_eps_high


@dataclass
class AdvantageStats:
    """What the advantages of a batch say about its groups (float tensors, for metrics)."""

    zero_advantage_fraction: Tensor
    """Share of groups whose rewards were all equal: their advantages are 0 and they teach
    nothing (all right or all wrong: the task is too easy or too hard for the policy)."""
    reward_std: Tensor
    """Mean within-group reward std."""


def group_advantages(
    rewards: Tensor, group_size: int, *, scale_by_std: bool = True, eps: float = 1e-4
) -> tuple[Tensor, AdvantageStats]:
    """Advantages (N,) of rewards (N,) laid out as N / group_size consecutive groups.

    A group whose rewards are all equal gets advantages of exactly 0 (no division by a zero
    std); :attr:`AdvantageStats.zero_advantage_fraction` counts such groups.
    """
    if group_size < 2:
        raise ConfigurationError(
            f"must be >= 2, got {group_size}: a group of one has nothing to compare with",
            path="group_size",
        )
    if rewards.dim() != 1 or rewards.numel() == 0 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards must be (N,) with N a positive multiple of group_size={group_size}, got "
            f"shape {tuple(rewards.shape)}; sample group_size completions per prompt"
        )
    groups = rewards.float().view(-1, group_size)
    centred = groups - groups.mean(-1, keepdim=True)
    std = groups.std(-1, keepdim=True)
    advantages = centred / (std + eps) if scale_by_std else centred
    constant = groups.amax(-1) == groups.amin(-1)
    advantages = advantages.masked_fill(constant[:, None], 0.0)
    stats = AdvantageStats(zero_advantage_fraction=constant.float().mean(), reward_std=std.mean())
    return advantages.reshape(-1), stats


@dataclass
class GRPOLossStats:
    """Diagnostics of one loss evaluation (detached float tensors, averaged over tokens)."""

    kl: Tensor
    """Mean k3 estimate of KL(pi || pi_ref) per token, importance-weighted if so configured
    (0 without a reference)."""
    clip_fraction: Tensor
    """Share of tokens whose clipped term was the smaller one (their gradient is 0)."""
    clip_low_fraction: Tensor
    clip_high_fraction: Tensor
    ratio_mean: Tensor
    """Mean pi / pi_old: 1 on the first optimisation step of a generated batch."""


def grpo_loss(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    mask: Tensor,
    config: GRPOLossConfig,
    ref_logps: Tensor | None = None,
) -> tuple[Tensor, GRPOLossStats]:
    """The GRPO loss of completion tokens, and its diagnostics.

    ``logps`` (B, T) are the current policy's log-probabilities of the sampled completion
    tokens (with gradient), ``old_logps`` those of the policy that sampled them, ``ref_logps``
    the frozen reference's (needed when ``kl_coef > 0``); ``advantages`` (B,) one per
    completion; ``mask`` (B, T) 1 on completion tokens, 0 on padding. A completion with no
    tokens contributes 0.
    """
    if logps.shape != old_logps.shape or logps.shape != mask.shape or logps.dim() != 2:
        raise ValueError(
            f"logps, old_logps and mask must be equal (B, T) shapes, got {tuple(logps.shape)}, "
            f"{tuple(old_logps.shape)} and {tuple(mask.shape)}"
        )
    if advantages.shape != logps.shape[:1]:
        raise ValueError(f"advantages must be ({logps.shape[0]},), got {tuple(advantages.shape)}")
    if config.kl_coef > 0 and ref_logps is None:
        raise ValueError("kl_coef > 0 needs ref_logps, the reference model's log-probabilities")
    mask = mask.to(logps.dtype)
    ratio = torch.exp(logps - old_logps.detach())
    clipped = torch.clamp(ratio, 1 - config.clip_eps_low, 1 + config.clip_high)
    adv = advantages.detach()[:, None].to(logps.dtype)
    per_token = -torch.min(ratio * adv, clipped * adv)
    kl = torch.zeros_like(logps)
    if ref_logps is not None:
        log_ratio_ref = ref_logps.detach() - logps
        kl = torch.exp(log_ratio_ref) - log_ratio_ref - 1
        if config.kl_importance_weighting:
            kl = kl * ratio
        if config.kl_coef > 0:
            per_token = per_token + config.kl_coef * kl
    loss = _aggregate(per_token, mask, config.aggregation)
    with torch.no_grad():
        low = (ratio < 1 - config.clip_eps_low) & (adv < 0)
        high = (ratio > 1 + config.clip_high) & (adv > 0)
        stats = GRPOLossStats(
            kl=_token_mean(kl, mask),
            clip_fraction=_token_mean((low | high).to(mask.dtype), mask),
            clip_low_fraction=_token_mean(low.to(mask.dtype), mask),
            clip_high_fraction=_token_mean(high.to(mask.dtype), mask),
            ratio_mean=_token_mean(ratio, mask),
        )
    return loss, stats


def _aggregate(per_token: Tensor, mask: Tensor, aggregation: LossAggregation) -> Tensor:
    if aggregation == LossAggregation.token:
        return _token_mean(per_token, mask)
    per_sequence = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    return per_sequence.mean()


def _token_mean(values: Tensor, mask: Tensor) -> Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def token_entropy(logits: Tensor, mask: Tensor) -> Tensor:
    """Mean entropy (nats) of the next-token distributions ``logits`` (B, T, V) over ``mask``."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return _token_mean(entropy, mask.to(entropy.dtype))
