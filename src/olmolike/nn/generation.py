"""Autoregressive sampling: batched, KV-cached, seeded, and safe to call from every rank.

:func:`sample` extends a batch of prompts of any lengths (left-padded internally) and returns
a :class:`Generation` with the completions and their masks; :func:`generate` is the
tensor-in, tensor-out form for one prompt or equal-length prompts.

With an olmolike :class:`~olmolike.nn.transformer.Transformer` each new token costs one
forward call over that token alone, reading the others' keys and values from a
:class:`~olmolike.nn.kv_cache.KVCache`; any other model ``ids (B, T) -> logits (B, T, V)``
is run over the whole context at every step (as ``use_cache=False`` does).

Distributed models: a DDP-wrapped model samples from its local replica (DDP's own forward
would broadcast buffers at every call). An FSDP2-sharded model gathers its parameters in
every forward call, so every rank of the job must call :func:`sample` together, with the same
``max_new_tokens`` and ``use_cache``; a rank whose sequences all finish early keeps stepping the
model without sampling (nothing is drawn from its generator, and the extra steps are dropped
from its output) until every rank is done, agreed by one small collective per step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from ..distributed.utils import agree_counts
from .kv_cache import KVCache
from .transformer import Transformer

__all__ = ["Generation", "filter_logits", "generate", "sample"]

log = logging.getLogger(__name__)

StopTokens = Sequence[int] | Sequence[Sequence[int]]


@dataclass
class Generation:
    """What :func:`sample` produced for a batch of B prompts."""

    prompt_ids: Tensor
    """(B, P) the prompts, left-padded with the pad token to the longest one."""
    prompt_mask: Tensor
    """(B, P) True on real prompt tokens, False on padding."""
    completion_ids: Tensor
    """(B, N) the sampled tokens, a stop token included; the pad token after a sequence stops.
    N is the number of steps taken: ``max_new_tokens``, or fewer if every sequence stopped."""
    completion_mask: Tensor
    """(B, N) True on sampled tokens (the stop token included), False on padding after it."""
    stopped: Tensor
    """(B,) True where a stop token ended the sequence, False where it ran out of steps."""

    @property
    def completion_lengths(self) -> Tensor:
        return self.completion_mask.sum(-1)

    @property
    def sequences(self) -> Tensor:
        """(B, P + N) prompts and completions side by side."""
        return torch.cat((self.prompt_ids, self.completion_ids), dim=-1)

    def completions(self, *, include_stop: bool = False) -> list[list[int]]:
        """Each sequence's sampled ids, without padding (and without its stop token unless
        ``include_stop``)."""
        out = []
        for ids, length, stopped in zip(
            self.completion_ids.tolist(), self.completion_lengths.tolist(), self.stopped.tolist()
        ):
            out.append(ids[: length - (1 if stopped and not include_stop else 0)])
        return out


@torch.no_grad()
def sample(
    model: nn.Module,
    prompts: Tensor | Sequence[Sequence[int] | Tensor],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_token_ids: StopTokens | None = None,
    pad_token_id: int = 0,
    vocab_size: int | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
) -> Generation:
    """Extend each prompt by up to ``max_new_tokens`` sampled tokens.

    ``prompts`` is a (B, T) tensor or a list of B id sequences of any (non-zero) lengths.
    ``temperature=0`` picks the most likely token (greedy). Otherwise logits are divided by
    the temperature and optionally restricted to the ``top_k`` most likely tokens and/or the
    smallest set whose probability reaches ``top_p`` (nucleus), then sampled with
    ``generator`` (on the logits' device): the same seed and batch give the same tokens.
    ``vocab_size`` limits sampling to ids below it (a model's vocabulary is often padded past
    its tokenizer's, and the padding ids cannot be decoded).

    ``stop_token_ids`` is one list of ids for every sequence, or one list per sequence; a
    sequence that samples one of its stop tokens is finished and padded with ``pad_token_id``.
    Sampling ends when all are finished. The context is cropped to the model's
    ``max_sequence_length`` (with the cache, by refilling it with its last three quarters when
    full). ``use_cache=False`` recomputes the whole context at every step (the baseline of
    ``src/benchmarks/generation.py``); models other than an olmolike Transformer always do.
    The model runs in eval mode and gets its mode back afterwards.
    """
    _check_sampling_args(max_new_tokens, temperature, top_k, top_p)
    core = model.module if isinstance(model, DistributedDataParallel) else model
    if getattr(core, "context_parallel", None) is not None:
        raise ValueError(
            "the model runs under context parallelism, which splits the sequences of training "
            "steps over ranks, not decoding's one new token per step: sample with a model "
            "built without it (a train module without cp_config)"
        )
    ids, valid = _left_pad(prompts, pad_token_id, _device_of(core))
    stops = _stop_table(stop_token_ids, ids.shape[0], ids.device)
    lockstep = dist.is_initialized() and (
        any(isinstance(m, FSDPModule) for m in core.modules())
        or any(isinstance(p, DTensor) for p in core.parameters())  # tensor parallelism
    )
    if lockstep:
        _check_same_on_every_rank(max_new_tokens)
    if not isinstance(core, Transformer) and not bool(valid.all()):
        raise ValueError(
            "prompts of different lengths need a model that takes a padding mask (an olmolike "
            "Transformer); pass equal-length prompts for this model"
        )
    empty = ids.new_zeros(ids.shape[0], 0)
    completion_ids, completion_mask = empty, empty.bool()
    stopped = valid.new_zeros(ids.shape[0])
    if max_new_tokens > 0:
        was_training = core.training
        core.eval()
        try:
            columns, emitted, stopped = _sample_steps(
                _Steps(core, ids, valid, max_new_tokens, use_cache),
                max_new_tokens,
                lambda logits: _pick_next(logits, temperature, top_k, top_p, generator),
                stops,
                pad_token_id,
                vocab_size,
                lockstep,
            )
        finally:
            core.train(was_training)
        # In lockstep, steps taken after this rank's sequences all stopped are dropped: the
        # result does not depend on what the other ranks sampled.
        steps_here = int(emitted.any(0).sum())
        completion_ids, completion_mask = columns[:, :steps_here], emitted[:, :steps_here]
    return Generation(ids, valid, completion_ids, completion_mask, stopped)


def _sample_steps(
    steps: _Steps,
    max_new_tokens: int,
    pick: Callable[[Tensor], Tensor],
    stops: Tensor | None,
    pad_token_id: int,
    vocab_size: int | None,
    lockstep: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """The decoding loop: sampled ids (B, N), which were sampled before a stop (B, N), and
    which sequences stopped (B,)."""
    logits = steps.first()
    finished = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    columns: list[Tensor] = []
    emitted: list[Tensor] = []
    done_here = False
    for step in range(max_new_tokens):
        if done_here:  # in lockstep, waiting for other ranks: step the model, draw nothing
            next_ids = torch.full_like(finished, pad_token_id, dtype=torch.long)
        else:
            next_ids = pick(logits[:, :vocab_size].float()).masked_fill(finished, pad_token_id)
        columns.append(next_ids)
        emitted.append(~finished)
        if stops is not None:
            finished = finished | (next_ids[:, None] == stops).any(-1)
        if step + 1 == max_new_tokens:
            break
        done_here, done_everywhere = _finished(finished, lockstep)
        if done_everywhere:
            break
        logits = steps.next(next_ids)
    return torch.stack(columns, 1), torch.stack(emitted, 1), finished


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
    vocab_size: int | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
) -> Tensor:
    """Extend ``prompt_ids`` (T,) or (B, T) by up to ``max_new_tokens`` tokens; returns
    prompt + new with the same number of dimensions.

    The arguments are those of :func:`sample`; a sequence that produced ``eos_token_id`` is
    padded with it while others continue.
    """
    if prompt_ids.dim() not in (1, 2) or prompt_ids.shape[-1] == 0:
        raise ValueError(
            f"prompt_ids must be a non-empty (T,) or (B, T) tensor, got shape "
            f"{tuple(prompt_ids.shape)}"
        )
    out = sample(
        model,
        prompt_ids.unsqueeze(0) if prompt_ids.dim() == 1 else prompt_ids,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        stop_token_ids=None if eos_token_id is None else [eos_token_id],
        pad_token_id=0 if eos_token_id is None else eos_token_id,
        vocab_size=vocab_size,
        generator=generator,
        use_cache=use_cache,
    ).sequences
    return out[0] if prompt_ids.dim() == 1 else out


class _Steps:
    """Runs the model, one forward call per step: ``first()`` over the prompts, ``next(ids)``
    after each sampled token; both return the logits (B, V) of the token to sample next.

    With a cache, ``next`` feeds the new token alone; a full cache is refilled from the last
    three quarters of the context. Without one, every step runs over the whole context,
    cropped to the model's ``max_sequence_length`` when it has one.
    """

    def __init__(
        self, model: nn.Module, ids: Tensor, valid: Tensor, max_new_tokens: int, use_cache: bool
    ) -> None:
        self.model, self.ids, self.valid = model, ids, valid
        self.max_new_tokens = max_new_tokens
        self.use_cache = use_cache and isinstance(model, Transformer)
        self.context: int | None = getattr(
            getattr(model, "config", None), "max_sequence_length", None
        )
        self.cache: KVCache | None = None

    def first(self) -> Tensor:
        return self._refill(self.ids.shape[1])

    def next(self, new_ids: Tensor) -> Tensor:
        new_ids = new_ids[:, None].to(self.ids.dtype)
        self.ids = torch.cat((self.ids, new_ids), dim=-1)
        self.valid = torch.cat((self.valid, self.valid.new_ones(new_ids.shape)), dim=-1)
        if self.use_cache and self.cache is not None and self.cache.length < self.cache.capacity:
            return _last_position(self.model(new_ids, cache=self.cache))
        if self.use_cache and self.context is not None:
            return self._refill(self.context - self.context // 4)
        return self._refill(self.ids.shape[1])

    def _refill(self, keep: int) -> Tensor:
        """Logits after the last ``keep`` slots, computed afresh (and cached, with a cache)."""
        if self.context is not None:
            keep = min(keep, self.context)
        window, valid = self.ids[:, -keep:], self.valid[:, -keep:]
        model = self.model
        if not isinstance(model, Transformer) or not (self.use_cache or not bool(valid.all())):
            return _last_position(model(window))
        capacity = min(model.config.max_sequence_length, keep + self.max_new_tokens)
        self.cache = KVCache(batch_size=len(window), capacity=capacity, n_layers=len(model.blocks))
        self.cache.set_padding(valid)
        return _last_position(model(window, cache=self.cache))


def _last_position(logits: Tensor) -> Tensor:
    """The logits (B, V) that pick the next tokens; a tensor-parallel head's vocabulary shards
    are gathered for these B rows only."""
    last = logits[:, -1]
    return last.full_tensor() if isinstance(last, DTensor) else last


def _device_of(model: nn.Module) -> torch.device:
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def _left_pad(
    prompts: Tensor | Sequence[Sequence[int] | Tensor], pad_token_id: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """Prompts as one left-padded (B, P) id tensor and its (B, P) mask of real tokens."""
    if isinstance(prompts, Tensor):
        if prompts.dim() != 2 or 0 in prompts.shape:
            raise ValueError(
                f"prompts must be a non-empty (batch, seq_len) tensor or a list of id "
                f"sequences, got a tensor of shape {tuple(prompts.shape)}"
            )
        ids = prompts.to(device=device, dtype=torch.long)
        return ids, torch.ones_like(ids, dtype=torch.bool)
    rows = [torch.as_tensor(p, dtype=torch.long).reshape(-1) for p in prompts]
    if not rows or any(len(row) == 0 for row in rows):
        raise ValueError("prompts must be a non-empty list of non-empty id sequences")
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    valid = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = row
        valid[i, width - len(row) :] = True
    return ids.to(device), valid.to(device)


def _stop_table(
    stop_token_ids: StopTokens | None, batch: int, device: torch.device
) -> Tensor | None:
    """(B, S) stop ids per sequence, padded with -1 (never sampled); None without stops."""
    if stop_token_ids is None or len(stop_token_ids) == 0:
        return None
    if all(isinstance(t, int) for t in stop_token_ids):
        per_row: list[list[int]] = [[int(t) for t in stop_token_ids]] * batch  # type: ignore[arg-type]
    else:
        per_row = [[int(t) for t in row] for row in stop_token_ids]  # type: ignore[union-attr]
        if len(per_row) != batch:
            raise ValueError(
                f"stop_token_ids has {len(per_row)} lists for {batch} prompts; give one list "
                "per prompt, or one flat list of ids for all"
            )
    width = max(1, *(len(row) for row in per_row))
    table = torch.full((batch, width), -1, dtype=torch.long)
    for i, row in enumerate(per_row):
        table[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return table.to(device)


def _check_same_on_every_rank(max_new_tokens: int) -> None:
    most, negated_least = agree_counts([max_new_tokens, -max_new_tokens]).max
    if most != -negated_least:
        raise ValueError(
            f"max_new_tokens differs across ranks (from {-negated_least} to {most}): "
            "a sharded (FSDP) model needs every rank to take the same number of steps; pass "
            "the same value everywhere"
        )


def _finished(finished: Tensor, lockstep: bool) -> tuple[bool, bool]:
    """Whether every sequence of this rank stopped, and whether every sequence stopped on every
    rank that steps in lockstep with this one (one small collective per step)."""
    here = bool(finished.all())
    if not lockstep:
        return here, here
    return here, agree_counts([0 if here else 1]).max[0] == 0


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


def filter_logits(
    logits: Tensor, *, top_k: int | None = None, top_p: float | None = None
) -> Tensor:
    """``logits`` (B, V) with the tokens outside the top-k and/or the nucleus set to -inf.

    The nucleus is the smallest set of most likely tokens whose probability reaches ``top_p``;
    the most likely token always survives.
    """
    if top_k is not None and top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


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
    probs = filter_logits(logits / temperature, top_k=top_k, top_p=top_p).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
