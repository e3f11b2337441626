"""Autoregressive sampling from a language model, for eyeballing what a small model learned."""

from __future__ import annotations

import logging

import torch
import torch.nn as nn
from torch import Tensor

__all__ = ["generate"]

log = logging.getLogger(__name__)


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt_ids: Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Extend ``prompt_ids`` by up to ``max_new_tokens`` sampled tokens; returns prompt + new.

    ``model`` maps ids (B, T) to logits (B, T, V). ``prompt_ids`` is (T,) or (B, T) and the
    result has the same number of dimensions. Each step runs the model over the whole context
    (no KV cache: the models sampled here are small, and the full recompute keeps any model
    usable), cropped to the last ``model.config.max_sequence_length`` tokens when the model
    has such a config.

    ``temperature=0`` picks the most likely token (greedy). Otherwise logits are divided by the
    temperature and, optionally, restricted to the ``top_k`` most likely tokens and/or the
    smallest set whose probability reaches ``top_p`` (nucleus sampling), then sampled with
    ``generator`` (which must live on the logits' device): the same seed gives the same text.

    With ``eos_token_id``, a sequence that produced it is finished: it is padded with
    ``eos_token_id`` while others continue, and generation stops once all are finished.
    The model runs in eval mode and gets its previous mode back afterwards.
    """
    _check_sampling_args(max_new_tokens, temperature, top_k, top_p)
    if prompt_ids.dim() not in (1, 2) or prompt_ids.shape[-1] == 0:
        raise ValueError(
            f"prompt_ids must be a non-empty (T,) or (B, T) tensor, got shape "
            f"{tuple(prompt_ids.shape)}"
        )
    ids = prompt_ids.unsqueeze(0) if prompt_ids.dim() == 1 else prompt_ids
    config = getattr(model, "config", None)
    context_length: int | None = getattr(config, "max_sequence_length", None)
    finished = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            context = ids if context_length is None else ids[:, -context_length:]
            logits = model(context)[:, -1, :].float()
            next_ids = _pick_next(logits, temperature, top_k, top_p, generator)
            if eos_token_id is not None:
                next_ids = next_ids.masked_fill(finished, eos_token_id)
                finished |= next_ids == eos_token_id
            ids = torch.cat((ids, next_ids.unsqueeze(-1).to(ids.dtype)), dim=-1)
            if eos_token_id is not None and bool(finished.all()):
                break
    finally:
        model.train(was_training)
    return ids[0] if prompt_ids.dim() == 1 else ids


def _check_sampling_args(
    max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None
) -> None:
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 or None (no limit), got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] or None (no limit), got {top_p}")


def _pick_next(
    logits: Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> Tensor:
    """One token id per row of ``logits`` (B, V)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p: the most likely
        # token always survives.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
