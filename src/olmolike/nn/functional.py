"""Loss helpers for language models: cross-entropy with z-loss, and per-token log-probabilities.

Everything is computed in float32 whatever the dtype of the logits: a softmax over a
100k-token vocabulary in bf16 loses most of the probability mass of rare tokens. No function
here reads a tensor back to the host, so they are safe on the training hot path.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["cross_entropy_loss", "log_probs_of_labels"]

log = logging.getLogger(__name__)

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
    """
    if reduction not in ("sum", "mean", "none"):
        raise ValueError(f"reduction must be 'sum', 'mean' or 'none', got {reduction!r}")
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree: logits "
            "must be labels' shape plus a trailing vocabulary dimension"
        )
    flat_logits = logits.reshape(-1, logits.shape[-1]).float()
    flat_labels = labels.reshape(-1)
    mask = flat_labels != ignore_index
    per_token = F.cross_entropy(
        flat_logits,
        flat_labels,
        ignore_index=ignore_index,
        reduction="none",
        label_smoothing=label_smoothing,
    )
    ce_loss = _reduce(per_token, mask, reduction, labels.shape)
    if z_loss_multiplier is None:
        return ce_loss, None
    z_squared = torch.logsumexp(flat_logits, dim=-1).pow(2) * mask
    return ce_loss, z_loss_multiplier * _reduce(z_squared, mask, reduction, labels.shape)


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
    logits = logits.float()
    picked = logits.gather(-1, safe_labels.unsqueeze(-1)).squeeze(-1)
    return (picked - torch.logsumexp(logits, dim=-1)) * mask
