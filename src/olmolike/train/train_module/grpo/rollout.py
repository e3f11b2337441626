"""The rollout of a GRPO step: sample G completions per prompt, score them, and turn the
rewards into advantages, with the metrics of all that.

A :class:`Rollout` stores each sequence as ``prompt + completion`` *without* left padding
(padding only after it), so the training forward pass needs no attention mask: a token never
attends to the padding after it, and its rotary positions start at 0, as they did while
sampling. :func:`completion_logps` computes the completion tokens' log-probabilities from it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch import Tensor

from ....config import Config
from ....data.prompts import PromptRecord
from ....data.tokenizer import Tokenizer
from ....exceptions import DataError
from ....nn.functional import log_probs_of_labels
from ....nn.generation import sample
from ....nn.vocab_parallel import gather_positions, limit_vocab
from .loss import GRPOLossConfig, group_advantages, token_entropy
from .rewards import RewardConfig, RewardRegistry, score_completions

__all__ = ["Rollout", "SamplingConfig", "check_prompt_lengths", "completion_logps", "rollout"]

log = logging.getLogger(__name__)


@dataclass
class SamplingConfig(Config):
    """How completions are sampled from the policy."""

    max_new_tokens: int = 64
    """The longest completion; a completion ends earlier at the tokenizer's EOS."""
    temperature: float = 1.0
    """1 samples the policy itself, which the clipped ratio assumes; lower sharpens it."""
    top_k: int | None = None
    """Sample among the k likeliest tokens only; ``None``: all of them."""
    top_p: float | None = None
    """Sample from the smallest set of likeliest tokens whose probabilities reach this total
    (nucleus sampling); ``None``: off."""

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise self._invalid("max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        if self.temperature <= 0:
            raise self._invalid(
                "temperature",
                f"must be > 0 (GRPO needs samples, not greedy), got {self.temperature}",
            )
        if self.top_k is not None and self.top_k < 1:
            raise self._invalid("top_k", f"must be >= 1 or null, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise self._invalid("top_p", f"must be in (0, 1] or null, got {self.top_p}")


@dataclass
class Rollout:
    """N = prompts x G sampled sequences, group by group (the G of a prompt are adjacent)."""

    input_ids: Tensor
    """(N, L) prompt then completion, padded after (with the tokenizer's pad id)."""
    completion_start: Tensor
    """(N,) where each completion starts in ``input_ids`` (its prompt's length)."""
    completion_ids: Tensor
    """(N, C) the sampled tokens (the EOS that ended one included)."""
    completion_mask: Tensor
    """(N, C) 1.0 on sampled tokens, 0.0 on padding."""
    rewards: Tensor
    """(N,) the weighted total reward."""
    advantages: Tensor
    """(N,) advantages, scaled as ``loss.scale_rewards`` says (``batch``: by this rollout's
    std; the GRPO train module rescales them by every rank's)."""
    completions: list[str]
    """The completions as text, decoded with the tokenizer, in the order of the rows (what the
    reward functions scored)."""
    metrics: dict[str, Tensor]
    """Reward mean/std (total and per function), zero-advantage share, completion lengths,
    generation tokens/s and seconds."""


def rollout(
    model: nn.Module,
    tokenizer: Tokenizer,
    records: Sequence[PromptRecord],
    *,
    sampling: SamplingConfig,
    loss: GRPOLossConfig,
    registry: RewardRegistry,
    rewards: Sequence[RewardConfig],
    generator: torch.Generator | None = None,
) -> Rollout:
    """Sample ``loss.group_size`` completions of each record's prompt and score them.

    Raises :class:`DataError` for a prompt whose tokens plus ``max_new_tokens`` exceed the
    model's context (training could not see the whole completion), and
    :class:`~.rewards.RewardFunctionError` for a failing reward function.
    """
    group = loss.group_size
    prompt_ids = [tokenizer.encode(r.prompt) for r in records for _ in range(group)]
    check_prompt_lengths(model, records, prompt_ids[::group], sampling.max_new_tokens)
    started = time.perf_counter()
    out = sample(
        model,
        prompt_ids,
        max_new_tokens=sampling.max_new_tokens,
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        stop_token_ids=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
        vocab_size=tokenizer.vocab_size,
        generator=generator,
    )
    seconds = time.perf_counter() - started
    completions = [tokenizer.decode(ids) for ids in out.completions()]
    fields = {
        key: [r.fields.get(key) for r in records for _ in range(group)]
        for key in sorted({k for r in records for k in r.fields})
    }
    prompts = [r.prompt for r in records for _ in range(group)]
    scores = score_completions(registry, rewards, prompts, completions, fields)
    advantages, stats = group_advantages(
        scores.total, group, scale=loss.scale_rewards, eps=loss.advantage_eps
    )
    lengths = out.completion_lengths.float().cpu()
    metrics = {
        "reward/mean": scores.total.mean(),
        "reward/std": scores.total.std(),
        "reward/zero advantage groups": stats.zero_advantage_fraction,
        "completion length/mean": lengths.mean(),
        "completion length/max": lengths.max(),
        "completion stopped": out.stopped.float().mean().cpu(),
        "generation tokens/s": torch.tensor(float(lengths.sum()) / max(seconds, 1e-9)),
        "generation seconds": torch.tensor(seconds),
    }
    for name, values in scores.per_function.items():
        metrics[f"reward/{name}/mean"] = values.mean()
        metrics[f"reward/{name}/std"] = values.std()
    input_ids, start = _pack(prompt_ids, out.completion_ids, tokenizer.pad_token_id)
    device = out.completion_ids.device
    return Rollout(
        input_ids=input_ids.to(device),
        completion_start=start.to(device),
        completion_ids=out.completion_ids,
        completion_mask=out.completion_mask.float(),
        rewards=scores.total.to(device),
        advantages=advantages.to(device),
        completions=completions,
        metrics=metrics,
    )


def check_prompt_lengths(
    model: nn.Module, records: Sequence[PromptRecord], ids: Sequence[Sequence[int]], max_new: int
) -> None:
    """Raise :class:`DataError` for the first record whose prompt ``ids`` plus ``max_new``
    sampled tokens exceed ``model``'s context (a model without ``config`` is not checked)."""
    context = getattr(getattr(model, "config", None), "max_sequence_length", None)
    if context is None:
        return
    for record, prompt in zip(records, ids):
        if len(prompt) + max_new > context:
            raise DataError(
                f"prompt {record.prompt[:60]!r} has {len(prompt)} tokens; with max_new_tokens="
                f"{max_new} that exceeds the model's context of {context} tokens. Shorten or drop "
                "the prompt, or lower sampling.max_new_tokens"
            )


def _pack(prompts: list[list[int]], completions: Tensor, pad: int) -> tuple[Tensor, Tensor]:
    """Each prompt followed directly by its completion, padded after: (N, L) and starts (N,)."""
    starts = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    width = int(starts.max()) + completions.shape[1]
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        ids[i, len(prompt) : len(prompt) + completions.shape[1]] = completions[i].cpu()
    return ids, starts


def completion_logps(
    model: nn.Module,
    batch: Rollout,
    *,
    with_entropy: bool = False,
    temperature: float = 1.0,
    vocab_size: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probabilities (N, C) of the completion tokens under ``model`` (with gradient when
    enabled), and the mean entropy of its next-token distributions over them if asked.

    ``temperature`` divides the logits and ``vocab_size`` drops the ids at and above it (a
    model's padded vocabulary), as :func:`rollout` sampled: the log-probabilities are then those
    of the distribution the completions were drawn from. A tensor-parallel model's
    vocabulary-sharded logits are never gathered (:mod:`olmolike.nn.vocab_parallel`)."""
    logits = model(batch.input_ids)
    width = batch.completion_ids.shape[1]
    # The logits that predict completion token j sit at position start + j - 1.
    positions = batch.completion_start[:, None] - 1 + torch.arange(width, device=logits.device)
    picked = gather_positions(logits, positions)
    if temperature != 1.0:
        picked = picked / temperature
    if vocab_size is not None:  # after the division, which could take a masked id to -inf
        picked = limit_vocab(picked, vocab_size)
    labels = batch.completion_ids.masked_fill(batch.completion_mask == 0, -100)
    logps = log_probs_of_labels(picked, labels)
    entropy = token_entropy(picked.detach(), batch.completion_mask) if with_entropy else None
    return logps, entropy
