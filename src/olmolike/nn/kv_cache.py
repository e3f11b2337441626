"""The key/value cache that lets a :class:`~olmolike.nn.transformer.Transformer` decode
one token at a time without recomputing the whole context.

A forward call with a cache appends its tokens' keys and values to the cache and attends to
everything cached so far. The batch shares the cache's slots: slot ``j`` of every sequence was
filled by the same call, so prompts of different lengths are *left-padded*, and
:meth:`KVCache.set_padding` says which tokens of the next call are padding. Padding is never
attended to, and a sequence's rotary positions count only its real tokens: a left-padded
sequence gets the logits it would get alone.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["KVCache", "LayerKVCache"]


class KVCache:
    """Keys and values of every attention layer for a batch of sequences being extended.

    Tensors are allocated on first use with the dtype and device of the keys they hold, so a
    cache needs to know only the batch size, its capacity in slots (at most the model's
    ``max_sequence_length``: positions beyond it have no rotary table) and the layer count.
    """

    def __init__(self, *, batch_size: int, capacity: int, n_layers: int) -> None:
        if batch_size < 1 or capacity < 1 or n_layers < 1:
            raise ValueError(
                f"a KVCache needs positive sizes, got batch_size={batch_size}, "
                f"capacity={capacity}, n_layers={n_layers}"
            )
        self.batch_size, self.capacity = batch_size, capacity
        self.length = 0
        """Slots filled so far (the same for every sequence of the batch)."""
        self.keys: list[Tensor | None] = [None] * n_layers
        self.values: list[Tensor | None] = [None] * n_layers
        self.mask: Tensor | None = None
        """The attention mask (B, 1, T, length + T) of the forward call in progress."""
        self._valid: Tensor | None = None  # (B, capacity): which slots hold real tokens
        self._positions: Tensor | None = None  # (B,): each sequence's next rotary position
        self._padding: Tensor | None = None  # validity of the next call's tokens, if given
        self._step_len = 0

    def set_padding(self, valid: Tensor) -> None:
        """Mark the tokens of the next forward call: True for real tokens, False for padding."""
        if valid.dim() != 2 or valid.shape[0] != self.batch_size:
            raise ValueError(
                f"valid must be (batch={self.batch_size}, seq_len), got {tuple(valid.shape)}"
            )
        self._padding = valid.bool()

    def begin(self, input_ids: Tensor) -> Tensor:
        """Start a forward call over ``input_ids`` (B, T); returns their rotary positions (B, T).

        Builds the step's attention mask: query slot ``i`` sees key slots ``<= i`` that hold
        real tokens, and always itself (so a padding query attends to something and its
        output stays finite; nothing real ever attends to it).
        """
        batch, seq_len = input_ids.shape
        start, end = self.length, self.length + seq_len
        if batch != self.batch_size or end > self.capacity:
            raise ValueError(
                f"the cache holds {self.batch_size} sequences of {self.capacity} slots, "
                f"{self.length} filled; cannot add a ({batch}, {seq_len}) call; build a larger "
                "cache or start a new one"
            )
        device = input_ids.device
        if self._valid is None or self._positions is None:
            self._valid = torch.zeros(batch, self.capacity, dtype=torch.bool, device=device)
            self._positions = torch.zeros(batch, dtype=torch.long, device=device)
        valid = self._padding
        if valid is None or valid.shape[1] != seq_len:
            valid = torch.ones(batch, seq_len, dtype=torch.bool, device=device)
        self._valid[:, start:end] = valid
        positions = (self._positions[:, None] + valid.long().cumsum(1) - 1).clamp(min=0)
        slots = torch.arange(end, device=device)
        query_slots = slots[start:, None]
        causal, itself = slots <= query_slots, slots == query_slots  # (T, end) each
        self.mask = (causal & (self._valid[:, None, :end] | itself)).unsqueeze(1)
        self._positions += valid.sum(1)
        self._padding, self._step_len = None, seq_len
        return positions

    def store(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append one layer's keys and values (B, heads, T, head_dim); return all cached."""
        start, end = self.length, self.length + self._step_len
        cached_k, cached_v = self.keys[layer], self.values[layer]
        if cached_k is None or cached_v is None:
            shape = (*k.shape[:2], self.capacity, k.shape[-1])
            cached_k = self.keys[layer] = k.new_zeros(shape)
            cached_v = self.values[layer] = v.new_zeros(shape)
        cached_k[:, :, start:end] = k
        cached_v[:, :, start:end] = v
        return cached_k[:, :, :end], cached_v[:, :, :end]

    def end(self) -> None:
        """Finish the forward call: its slots now count as filled."""
        self.length += self._step_len
        self._step_len, self.mask = 0, None

    def layer(self, index: int) -> LayerKVCache:
        return LayerKVCache(self, index)


class LayerKVCache:
    """One attention layer's view of a :class:`KVCache`."""

    def __init__(self, cache: KVCache, index: int) -> None:
        self.cache, self.index = cache, index

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return self.cache.store(self.index, k, v)
