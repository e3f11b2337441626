"""The GRPO objective: group-normalised advantages and the clipped surrogate with a KL penalty.

For each prompt, G completions are sampled and scored; completion ``i`` of a group gets the
advantage ``A_i = (r_i - mean(r)) / (std + eps)``, ``std`` the group's or the whole batch's
(with Bessel's correction, as TRL computes it), or ``r_i - mean(r)`` (Dr. GRPO: the std
scaling up-weights groups whose rewards barely differ); see :class:`RewardScaling`. Each
completion token ``t`` then contributes::

    -min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A) + beta * KL_t
    rho_t = exp(log pi(t) - log pi_old(t))
    KL_t  = exp(log pi_ref(t) - log pi(t)) - (log pi_ref(t) - log pi(t)) - 1   (k3 estimator)
            (times rho_t with ``kl_importance_weighting``, the default)

where ``pi_old`` is the policy that sampled the completions (several optimisation steps per
generated batch make ``pi`` drift from it; the clip keeps each step in a trust region around
it) and ``pi_ref`` a frozen reference. How the token terms of an update become its loss, TRL's
``loss_type`` (``grpo``, ``bnpo``, ``dapo``, ``dr_grpo``), is :class:`LossAggregation`; each
gives TRL's numbers on one rank and on several (``test_grpo_trl_parity``).

AstrAI's GRPO strategy writes the objective differently: its ratio is ``pi / pi_ref`` (the
frozen reference, refreshed every ``sync_interval`` steps) rather than ``pi / pi_old``, so the
clip bounds the drift from the reference instead of from the sampling policy within one
generated batch; and its KL penalty is the squared log-ratio ``(log pi - log pi_ref)^2``, whose
expectation is not a KL divergence (k3 is unbiased for KL(pi || pi_ref) under samples of pi,
non-negative, and has lower variance than the plain log-ratio). Here the standard form
(DeepSeekMath's GRPO, as TRL implements it) is used.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ....config import Config, StrEnum, check_choice
from ....exceptions import ConfigurationError
from ....nn.vocab_parallel import VocabParallelLogits, is_vocab_parallel

__all__ = [
    "AdvantageStats",
    "GRPOLossConfig",
    "GRPOLossStats",
    "LossAggregation",
    "RewardScaling",
    "group_advantages",
    "grpo_loss",
    "token_entropy",
    "update_denominators",
]


class LossAggregation(StrEnum):
    """How the per-token loss terms of one optimizer update become one number: a sum over
    tokens (or over completions' token means) divided by a denominator. TRL's ``loss_type``
    names are accepted; each gives TRL's numbers (``grpo`` is an alias of ``sequence``)."""

    token = "token"
    """Divided by the completion tokens of the update, over every rank: each update's loss is
    the mean per token whatever its length. Equals ``dapo`` with one minibatch per step."""
    sequence = "sequence"
    """Mean within each completion, then over the update's completions of every rank: each
    completion weighs the same, so a long completion's tokens count less (TRL's ``grpo``)."""
    grpo = "sequence"
    bnpo = "bnpo"
    """Each rank's share of the update divided by that rank's own completion tokens, then the
    mean over ranks (TRL's ``bnpo`` with ``gradient_accumulation_steps=1``: TRL normalises
    each accumulation micro-batch by its own tokens, which makes its loss depend on how memory
    splits the batch; here the split into micro-batches never changes the loss)."""
    dapo = "dapo"
    """Divided by the completion tokens of the step's whole generated batch (every rank, every
    minibatch), over the number of updates per pass: every token of the step weighs the same,
    so an update with fewer tokens makes a smaller step (DAPO; TRL's default)."""
    dr_grpo = "dr_grpo"
    """Divided by the update's completions of every rank times ``max_completion_length`` (the
    sampling's ``max_new_tokens``): a constant, so neither length nor batch bias (Dr. GRPO)."""


class RewardScaling(StrEnum):
    """What advantages ``r - mean(group)`` are divided by (TRL's ``scale_rewards``)."""

    group = "group"
    """The std of the completion's group (GRPO)."""
    batch = "batch"
    """The std of every reward of the step, over all ranks (more robust than a group's few)."""
    none = "none"
    """Nothing (Dr. GRPO): a group whose rewards barely differ is not up-weighted."""


@dataclass
class GRPOLossConfig(Config):
    """The coefficients of the GRPO objective."""

    group_size: int = 4
    """Completions sampled per prompt (G). At least 2: advantages compare completions of the
    same prompt, and one completion alone has nothing to be compared with."""
    scale_rewards: RewardScaling = RewardScaling.group
    """The std advantages are divided by: the group's, the whole batch's, or none; see
    :class:`RewardScaling`."""
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
    """How token terms become the update's loss; see :class:`LossAggregation`."""

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
    rewards: Tensor,
    group_size: int,
    *,
    scale: RewardScaling = RewardScaling.group,
    eps: float = 1e-4,
    process_group: dist.ProcessGroup | None = None,
) -> tuple[Tensor, AdvantageStats]:
    """Advantages (N,) of rewards (N,) laid out as N / group_size consecutive groups.

    With ``scale="batch"`` the std is that of every rank's rewards in ``process_group`` (one
    all-gather; every rank must pass the same N), else of ``rewards`` alone. A group whose
    rewards are all equal gets advantages of exactly 0 (no division by a zero std);
    :attr:`AdvantageStats.zero_advantage_fraction` counts such groups.
    """
    scale = check_choice(scale, RewardScaling, "scale")
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
    groups = (rewards if rewards.is_floating_point() else rewards.float()).view(-1, group_size)
    centred = groups - groups.mean(-1, keepdim=True)
    std = groups.std(-1, keepdim=True)
    if scale == RewardScaling.group:
        centred = centred / (std + eps)
    elif scale == RewardScaling.batch:
        centred = centred / (_gathered(groups.reshape(-1), process_group).std() + eps)
    constant = groups.amax(-1) == groups.amin(-1)
    advantages = centred.masked_fill(constant[:, None], 0.0)
    stats = AdvantageStats(zero_advantage_fraction=constant.float().mean(), reward_std=std.mean())
    return advantages.reshape(-1), stats


def _gathered(values: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """``values`` of every rank of ``group``, in rank order (``values`` alone without one)."""
    if group is None or dist.get_world_size(group) == 1:
        return values
    parts = [torch.empty_like(values) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, values.contiguous(), group=group)
    return torch.cat(parts)


@dataclass
class GRPOLossStats:
    """Diagnostics of one loss evaluation (detached float tensors). The ``clip`` fractions
    are TRL's ``clip_ratio`` metrics: a token is clipped low when its ratio is below
    ``1 - clip_eps_low`` with a negative advantage, high when above ``1 + clip_eps_high`` with
    a positive one (its gradient is 0 either way)."""

    kl: Tensor
    """Mean k3 estimate of KL(pi || pi_ref) per token, importance-weighted if so configured
    (0 without a reference)."""
    clip_fraction: Tensor
    """Share of tokens clipped low or high (TRL's ``clip_ratio/region_mean``)."""
    clip_low_fraction: Tensor
    """Share of tokens clipped low (``clip_ratio/low_mean``)."""
    clip_high_fraction: Tensor
    """Share of tokens clipped high (``clip_ratio/high_mean``)."""
    clip_low_min: Tensor
    """The smallest share of tokens clipped low within one completion, over the completions
    that have tokens (``clip_ratio/low_min``); NaN if none has."""
    clip_high_max: Tensor
    """The largest share of tokens clipped high within one completion (``clip_ratio/high_max``)."""
    ratio_mean: Tensor
    """Mean pi / pi_old: 1 on the first optimisation step of a generated batch."""


def grpo_loss(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    mask: Tensor,
    config: GRPOLossConfig,
    ref_logps: Tensor | None = None,
    *,
    denominator: Tensor | None = None,
    max_completion_length: int | None = None,
) -> tuple[Tensor, GRPOLossStats]:
    """The GRPO loss of completion tokens, and its diagnostics.

    ``logps`` (B, T) are the current policy's log-probabilities of the sampled completion
    tokens (with gradient), ``old_logps`` those of the policy that sampled them, ``ref_logps``
    the frozen reference's (needed when ``kl_coef > 0``); ``advantages`` (B,) one per
    completion; ``mask`` (B, T) 1 on completion tokens, 0 on padding. A completion with no
    tokens contributes 0.

    The loss is the sum of the batch's token terms (per-completion means with ``sequence``
    aggregation) over ``denominator``: by default the batch's own (:func:`update_denominators`
    of this batch alone; ``dr_grpo`` needs ``max_completion_length``). A part of a larger
    update passes that update's denominator, so the parts' losses add up to the update's.
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
    if denominator is None:
        denominator = update_denominators(
            [mask], config, max_completion_length=max_completion_length
        )[0]
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
    if config.aggregation == LossAggregation.sequence:
        summed = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
    else:
        summed = (per_token * mask).sum()
    with torch.no_grad():
        stats = _stats(ratio, adv, kl, mask, config)
    return summed / denominator, stats


def _stats(
    ratio: Tensor, adv: Tensor, kl: Tensor, mask: Tensor, config: GRPOLossConfig
) -> GRPOLossStats:
    low = ((ratio < 1 - config.clip_eps_low) & (adv < 0)).to(mask.dtype)
    high = ((ratio > 1 + config.clip_high) & (adv > 0)).to(mask.dtype)
    lengths = mask.sum(-1)
    has_tokens = lengths > 0
    per_completion = torch.stack([(low * mask).sum(-1), (high * mask).sum(-1)]) / lengths
    low_seq, high_seq = per_completion[:, has_tokens]
    nan = torch.full((), float("nan"), dtype=mask.dtype, device=mask.device)
    return GRPOLossStats(
        kl=_token_mean(kl, mask),
        clip_fraction=_token_mean(low + high, mask),  # exclusive: A < 0 or A > 0
        clip_low_fraction=_token_mean(low, mask),
        clip_high_fraction=_token_mean(high, mask),
        clip_low_min=low_seq.min() if low_seq.numel() else nan,
        clip_high_max=high_seq.max() if high_seq.numel() else nan,
        ratio_mean=_token_mean(ratio, mask),
    )


def update_denominators(
    masks: Sequence[Tensor],
    config: GRPOLossConfig,
    *,
    max_completion_length: int | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> Tensor:
    """The denominator of each update's loss (:class:`LossAggregation`), given this rank's
    completion ``masks`` of the step's updates (one per minibatch of a pass over the generated
    batch): a (len(masks),) tensor, the sums ``grpo_loss`` divides by.

    With a ``process_group`` of several ranks, the counts are agreed with one all-reduce (call
    it once per step on every rank); the losses of all ranks' parts of an update then add up to
    the update's loss, so a rank's gradient is the world size times its part's (data-parallel
    training averages gradients). ``bnpo``'s denominator is this rank's own tokens times the
    world size: its update loss is the mean over ranks of each rank's token mean.
    """
    if config.aggregation == LossAggregation.dr_grpo and max_completion_length is None:
        raise ValueError("aggregation dr_grpo needs max_completion_length (the sampling's "
                         "max_new_tokens): its denominator is completions x that length")  # fmt: skip
    local = torch.stack([torch.stack([m.sum(), m.new_tensor(float(m.shape[0]))]) for m in masks])
    world = 1 if process_group is None else dist.get_world_size(process_group)
    total = local.clone()
    if world > 1:
        dist.all_reduce(total, group=process_group)
    tokens, completions = total.unbind(-1)
    aggregation = config.aggregation
    if aggregation == LossAggregation.token:
        return tokens.clamp(min=1.0)
    if aggregation == LossAggregation.dapo:
        return (tokens.sum().clamp(min=1.0) / len(masks)).expand(len(masks))
    if aggregation == LossAggregation.dr_grpo:
        assert max_completion_length is not None
        return completions * max_completion_length
    if aggregation == LossAggregation.bnpo:
        return local[:, 0].clamp(min=1.0) * world
    return completions


def _token_mean(values: Tensor, mask: Tensor) -> Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def token_entropy(logits: Tensor, mask: Tensor) -> Tensor:
    """Mean entropy (nats) of the next-token distributions ``logits`` (B, T, V) over ``mask``;
    vocabulary-sharded logits (a tensor-parallel head's) are not gathered."""
    if is_vocab_parallel(logits):
        entropy = VocabParallelLogits.of(logits).entropy().view(mask.shape)
    else:
        logp = torch.log_softmax(logits.float(), dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)
    return _token_mean(entropy, mask.to(entropy.dtype))
