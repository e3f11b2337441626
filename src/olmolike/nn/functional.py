"""Loss helpers for language models: cross-entropy with z-loss, and per-token log-probabilities.

Everything is computed in float32 whatever the dtype of the logits: a softmax over a
100k-token vocabulary in bf16 loses most of the probability mass of rare tokens. No function
here reads a tensor back to the host, so they are safe on the training hot path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from ..config import StrEnum, check_choice
from .vocab_parallel import VocabParallelLogits, is_vocab_parallel

__all__ = [
    "DPOLossType",
    "DPOOutput",
    "check_label_smoothing",
    "cross_entropy_loss",
    "dpo_loss",
    "log_probs_of_labels",
    "sequence_log_probs",
    "token_kl_divergence",
]


Reduction = Literal["sum", "mean", "none"]


def cross_entropy_loss(
    logits: Tensor,
    labels: Tensor,
    *,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    z_loss_multiplier: float | None = None,
    label_smoothing: float = 0.0,
) -> tuple[Tensor, Tensor | None]:
    """Cross-entropy of ``logits`` (..., V) against ``labels`` (...), and the optional z-loss.

    Returns ``(ce_loss, z_loss)``. The z-loss, ``z_loss_multiplier * logsumexp(logits)**2``
    (PaLM's auxiliary loss that keeps the softmax normaliser near 1, which stabilises bf16
    training), is reduced like the cross-entropy and is ``None`` without a multiplier. The
    cross-entropy does not include it, so the two can be logged separately; the training loss
    is their sum.

    ``"mean"`` averages over tokens whose label is not ``ignore_index``; a batch where every
    label is ignored gives 0 rather than NaN. ``"none"`` returns per-token values shaped like
    ``labels``, 0 at ignored tokens.

    Vocabulary-sharded logits (a tensor-parallel head's DTensor) are reduced without gathering
    a full row (:mod:`olmolike.nn.vocab_parallel`); the results are plain tensors.
    """
    reduction = check_choice(reduction, Reduction, "reduction")
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree: logits "
            "must be labels' shape plus a trailing vocabulary dimension"
        )
    flat_labels = labels.reshape(-1)
    mask = flat_labels != ignore_index
    logsumexp: Tensor | None
    if is_vocab_parallel(logits):
        sharded = VocabParallelLogits.of(logits)
        per_token, logsumexp = _sharded_cross_entropy(sharded, flat_labels, mask, label_smoothing)
    else:
        flat_logits = logits.reshape(-1, logits.shape[-1]).float()
        per_token = F.cross_entropy(
            flat_logits,
            flat_labels,
            ignore_index=ignore_index,
            reduction="none",
            label_smoothing=label_smoothing,
        )
        logsumexp = None if z_loss_multiplier is None else torch.logsumexp(flat_logits, dim=-1)
    ce_loss = _reduce(per_token, mask, reduction, labels.shape)
    if z_loss_multiplier is None:
        return ce_loss, None
    assert logsumexp is not None
    z_squared = logsumexp.pow(2) * mask
    return ce_loss, z_loss_multiplier * _reduce(z_squared, mask, reduction, labels.shape)


def _sharded_cross_entropy(
    logits: VocabParallelLogits, labels: Tensor, mask: Tensor, label_smoothing: float
) -> tuple[Tensor, Tensor]:
    """Per-token cross-entropy (0 at ignored tokens) and log-partition, as
    ``F.cross_entropy`` computes them: with smoothing ``e``, ``(1 - e) * nll + e * (logsumexp -
    mean logit)``."""
    nll = logits.logsumexp - logits.label_logits(labels)
    if label_smoothing:
        uniform = logits.logsumexp - logits.mean_logit()
        nll = (1 - label_smoothing) * nll + label_smoothing * uniform
    return nll * mask, logits.logsumexp


def _reduce(values: Tensor, mask: Tensor, reduction: Reduction, shape: torch.Size) -> Tensor:
    if reduction == "none":
        return values.view(shape)
    total = values.sum()
    if reduction == "sum":
        return total
    # clamp keeps an all-ignored batch at 0 / 1 = 0 without a host-side branch.
    return total / mask.sum().clamp(min=1)


def log_probs_of_labels(logits: Tensor, labels: Tensor, *, ignore_index: int = -100) -> Tensor:
    """``log p(label)`` per token, shaped like ``labels``; 0 where the label is ignored.

    The building block for sequence log-likelihoods (evaluation, DPO): sum over a sequence's
    tokens to score the sequence. Computed as ``logit[label] - logsumexp(logits)``, which never
    materialises the full log-softmax.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree: logits "
            "must be labels' shape plus a trailing vocabulary dimension"
        )
    mask = labels != ignore_index
    # An ignored label may be out of the vocabulary range: gather a valid index instead.
    safe_labels = torch.where(mask, labels, torch.zeros_like(labels))
    if is_vocab_parallel(logits):
        sharded = VocabParallelLogits.of(logits)
        picked = sharded.label_logits(safe_labels) - sharded.logsumexp
        return picked.view(labels.shape) * mask
    logits = logits.float()
    picked = logits.gather(-1, safe_labels.unsqueeze(-1)).squeeze(-1)
    return (picked - torch.logsumexp(logits, dim=-1)) * mask


def sequence_log_probs(
    logits: Tensor, labels: Tensor, *, ignore_index: int = -100
) -> tuple[Tensor, Tensor]:
    """Sum of ``log p(label)`` over each row's trained tokens, and the count of those tokens.

    ``logits`` is (B, T, V) and ``labels`` (B, T), already shifted (label t is the token that
    follows position t). Returns two (B,) float32 tensors: a response's log-likelihood under the
    model, and its length in tokens (what length-normalised losses divide by).
    """
    per_token = log_probs_of_labels(logits, labels, ignore_index=ignore_index)
    return per_token.sum(-1), (labels != ignore_index).sum(-1).float()


def token_kl_divergence(
    policy_logits: Tensor, reference_logits: Tensor, labels: Tensor, *, ignore_index: int = -100
) -> Tensor:
    """Exact ``KL(policy || reference)`` per token over the whole vocabulary, masked mean.

    ``sum_v p(v) * (log p(v) - log q(v))`` at every position whose label is not
    ``ignore_index``, averaged over those positions (0 when there are none). Gradients flow to
    ``policy_logits`` only: the reference is a frozen model, so its logits are detached here.
    Unlike the one-sample estimate ``log p(y) - log q(y)`` at the observed token (whose gradient
    is just the cross-entropy's), this moves probability on every token of the vocabulary.
    """
    if policy_logits.shape != reference_logits.shape:
        raise ValueError(
            f"policy logits {tuple(policy_logits.shape)} and reference logits "
            f"{tuple(reference_logits.shape)} differ: both models must share the vocabulary"
        )
    mask = labels != ignore_index
    if is_vocab_parallel(policy_logits):
        p, q = VocabParallelLogits.of(policy_logits), VocabParallelLogits.of(reference_logits)
        log_p = p.local - p.logsumexp[:, None]
        log_q = (q.local - q.logsumexp[:, None]).detach()
        per_token = p.sum_over_vocab(log_p.exp() * (log_p - log_q)).view(labels.shape)
        return (per_token * mask).sum() / mask.sum().clamp(min=1)
    log_p = F.log_softmax(policy_logits.float(), dim=-1)
    log_q = F.log_softmax(reference_logits.detach().float(), dim=-1)
    per_token = (log_p.exp() * (log_p - log_q)).sum(-1)
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


class DPOLossType(StrEnum):
    """Which preference loss :func:`dpo_loss` computes from the four sequence log-probs, under
    TRL's names and with TRL 1.16's numbers.

    With ``h = (log pi(c) - log ref(c)) - (log pi(r) - log ref(r))`` on summed response
    log-probs, ``h_avg`` the same on per-token averaged ones, and ``e`` the label smoothing:
    """

    sigmoid = "sigmoid"
    """DPO (Rafailov et al. 2023): ``-log sigmoid(beta * h)``. Takes no label smoothing (TRL's
    ``sigmoid`` ignores it; :attr:`cdpo` is the smoothed form)."""
    cdpo = "cdpo"
    """Conservative DPO, for pairs whose labels are wrong with probability e:
    ``-(1 - e) log sigmoid(beta h) - e log sigmoid(-beta h)`` (TRL's ``sigmoid`` before 1.0)."""
    robust = "robust"
    """Robust DPO (Chowdhury et al. 2024), an unbiased loss under label noise e:
    ``(-(1 - e) log sigmoid(beta h) + e log sigmoid(-beta h)) / (1 - 2e)``."""
    hinge = "hinge"
    """SLiC-style hinge: ``relu(1 - beta * h)``; pairs past the margin give no gradient."""
    ipo = "ipo"
    """IPO (Azar et al. 2023): ``(h_avg - 1 / (2 beta))**2``, on per-token averaged log-probs
    (as in the paper's token-level formulation and TRL): a regression to a fixed margin that
    does not push the margin to infinity on deterministic preferences."""
    length_normalized = "length_normalized"
    """Length-normalised DPO (Tulu 3): ``-log sigmoid(beta * h_avg)``, so a long response is not
    favoured for its length. TRL's name for it, ``sigmoid_norm``, is an alias."""
    sigmoid_norm = "length_normalized"

    @property
    def averages_lengths(self) -> bool:
        """Whether the loss compares per-token averages (needs the response lengths)."""
        return self in (DPOLossType.ipo, DPOLossType.length_normalized)

    @property
    def smooths_labels(self) -> bool:
        """Whether ``label_smoothing`` enters the loss; for the others it must be 0."""
        return self in (DPOLossType.cdpo, DPOLossType.robust)


def check_label_smoothing(loss_type: DPOLossType, label_smoothing: float) -> str | None:
    """Why ``label_smoothing`` does not fit ``loss_type``, or ``None`` if it does."""
    loss_type = check_choice(loss_type, DPOLossType, "loss_type")
    if not 0.0 <= label_smoothing < 0.5:
        return f"must be in [0, 0.5), got {label_smoothing}"
    if label_smoothing and not loss_type.smooths_labels:
        return (
            f"has no effect on loss_type={loss_type} (TRL ignores it there); use "
            "loss_type=cdpo for conservative DPO or robust for robust DPO, or set it to 0"
        )
    return None


@dataclass
class DPOOutput:
    """The loss and the per-pair quantities logged as metrics (all (B,) except ``loss``)."""

    loss: Tensor
    """Mean of the per-pair losses."""
    chosen_rewards: Tensor
    """Implicit reward ``beta * (log pi(c) - log ref(c))`` on *summed* log-probs, detached, for
    every loss type (TRL's definition: the logged margins keep the sign of TRL's even where
    the loss compares averages)."""
    rejected_rewards: Tensor
    """The same for the rejected response, detached."""


def dpo_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    reference_chosen: Tensor,
    reference_rejected: Tensor,
    *,
    beta: float,
    loss_type: DPOLossType = DPOLossType.sigmoid,
    label_smoothing: float = 0.0,
    chosen_lengths: Tensor | None = None,
    rejected_lengths: Tensor | None = None,
) -> DPOOutput:
    """Preference loss of a batch of pairs from summed response log-probs, each (B,).

    ``ipo`` and ``length_normalized`` divide each log-ratio by its response's token count
    (``chosen_lengths`` / ``rejected_lengths``, required for them). Reference log-probs are
    treated as constants. The operations follow TRL's ``DPOTrainer._compute_loss`` in order,
    so the results agree to float rounding.
    """
    loss_type = check_choice(loss_type, DPOLossType, "loss_type")
    if beta <= 0:
        raise ValueError(f"beta must be positive, got {beta}")
    if (problem := check_label_smoothing(loss_type, label_smoothing)) is not None:
        raise ValueError(f"label_smoothing {problem}")
    chosen_ratio = policy_chosen - reference_chosen.detach()
    rejected_ratio = policy_rejected - reference_rejected.detach()
    if loss_type.averages_lengths:
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError(f"loss_type {loss_type} needs chosen_lengths and rejected_lengths")
        c_len, r_len = chosen_lengths.clamp(min=1), rejected_lengths.clamp(min=1)
        h = chosen_ratio / c_len - rejected_ratio / r_len
    else:
        h = chosen_ratio - rejected_ratio
    return DPOOutput(
        loss=_preference_losses(loss_type, h, beta, label_smoothing).mean(),
        chosen_rewards=(beta * chosen_ratio).detach(),
        rejected_rewards=(beta * rejected_ratio).detach(),
    )


def _preference_losses(loss_type: DPOLossType, h: Tensor, beta: float, e: float) -> Tensor:
    if loss_type in (DPOLossType.sigmoid, DPOLossType.length_normalized):
        return -F.logsigmoid(beta * h)
    if loss_type == DPOLossType.cdpo:
        return -(1 - e) * F.logsigmoid(beta * h) - e * F.logsigmoid(-beta * h)
    if loss_type == DPOLossType.robust:
        clean, flipped = -(1 - e) * F.logsigmoid(beta * h), -e * F.logsigmoid(-beta * h)
        return (clean - flipped) / (1 - 2 * e)
    if loss_type == DPOLossType.hinge:
        return torch.relu(1 - beta * h)
    if loss_type == DPOLossType.ipo:
        return (h - 1 / (2 * beta)) ** 2
    raise NotImplementedError(f"dpo_loss has no formula for loss_type {loss_type}")
