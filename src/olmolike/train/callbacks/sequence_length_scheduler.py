"""Sequence-length warm-up: short sequences early in training, the full length later."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ...exceptions import ConfigurationError
from .callback import Callback

__all__ = [
    "SequenceLengthSchedulerCallback",
    "melt_batch",
    "split_sequence_length",
    "truncate_batch",
    "truncated_sequence_length",
]

log = logging.getLogger(__name__)


@dataclass
class SequenceLengthSchedulerCallback(Callback, name="sequence_length_scheduler"):
    """Grows the training sequence length linearly from ``min_sequence_length`` to the data's
    length over ``warmup_steps`` steps.

    By default each instance is split into shorter ones (``min_sequence_length`` times a
    power of 2, so the data's length must be such a multiple): every token is still trained
    on and batches keep their token count. With ``truncate`` the instances are cut instead
    (to a multiple of ``keep_multiple_of``) and the rest of each is dropped. The trainer's
    token count still counts whole batches, as in OLMo-core.

    The batch's per-token tensors (``input_ids``, ``labels``, masks) are reshaped together and
    per-instance ones repeated; any other entry (e.g. document lengths) cannot be split
    correctly and is an error.
    """

    min_sequence_length: int = 128
    """The sequence length (tokens) trained at step 1."""
    warmup_steps: int = 2000
    """Steps over which the length grows linearly to the data's own; from then on instances are left
    whole."""
    truncate: bool = False
    """Cut each instance to the current length and drop the rest, instead of splitting it into
    several shorter instances (which trains on every token)."""
    keep_multiple_of: int = 128
    """With ``truncate``: the length is always a multiple of this (kernels like round sizes)."""
    enabled: bool = True
    """``False`` turns the callback off while keeping it in the config (an override can turn it back
    on)."""

    _microbatch: tuple[Any, str, int] | None = field(default=None, init=False, repr=False)
    _last_len: int | None = field(default=None, init=False, repr=False)

    def validate(self) -> None:
        for name in ("min_sequence_length", "warmup_steps", "keep_multiple_of"):
            if getattr(self, name) < 1:
                raise ConfigurationError(f"must be >= 1, got {getattr(self, name)}", path=name)
        if self.truncate and self.min_sequence_length % self.keep_multiple_of:
            raise ConfigurationError(
                f"must be a multiple of keep_multiple_of ({self.keep_multiple_of}), got "
                f"{self.min_sequence_length}",
                path="min_sequence_length",
            )

    def pre_step(self, batch: dict[str, Any]) -> None:
        if not self.enabled or self.step > self.warmup_steps:
            return
        full = int(batch["input_ids"].shape[-1])
        self._check_length(full)
        if self.truncate:
            length = truncated_sequence_length(
                self.min_sequence_length, full, self.step, self.warmup_steps, self.keep_multiple_of
            )
            batch.update(truncate_batch(batch, length))
            self._scale_microbatch(length / full)
        else:
            length = split_sequence_length(
                self.min_sequence_length, full, self.step, self.warmup_steps
            )
            batch.update(melt_batch(batch, length))
        if length != self._last_len:
            log.info(
                "Sequence length %d (warm-up to %d by step %d)", length, full, self.warmup_steps
            )
            self._last_len = length

    def post_train_batch(self) -> None:
        if self._microbatch is not None:
            owner, attr, original = self._microbatch
            setattr(owner, attr, original)
            self._microbatch = None

    def _check_length(self, full: int) -> None:
        if full <= self.min_sequence_length:
            raise ConfigurationError(
                f"must be below the data's sequence length ({full})", path="min_sequence_length"
            )
        ratio = full // self.min_sequence_length
        if not self.truncate and (full % self.min_sequence_length or ratio & (ratio - 1)):
            raise ConfigurationError(
                f"the data's sequence length ({full}) must be min_sequence_length "
                f"({self.min_sequence_length}) times a power of 2 to split instances; "
                "choose another min_sequence_length or set truncate=True",
                path="min_sequence_length",
            )

    def _scale_microbatch(self, factor: float) -> None:
        """Keep the rows per micro-batch when truncation shortens them."""
        module = self.trainer.train_module
        owners: list[Any] = [module, getattr(module, "config", None)]
        for owner in owners:
            size = getattr(owner, "rank_microbatch_size", None)
            if isinstance(size, int):
                self._microbatch = (owner, "rank_microbatch_size", size)
                owner.rank_microbatch_size = round(size * factor)
                return


def _scheduled(min_len: int, max_len: int, step: int, warmup_steps: int) -> float:
    return min_len + (max_len - min_len) * min(step, warmup_steps) / warmup_steps


def split_sequence_length(min_len: int, max_len: int, step: int, warmup_steps: int) -> int:
    """The scheduled length, rounded down to ``min_len`` times a power of 2."""
    ratio = int(_scheduled(min_len, max_len, step, warmup_steps) // min_len)
    return min_len * 2 ** math.floor(math.log2(ratio))


def truncated_sequence_length(
    min_len: int, max_len: int, step: int, warmup_steps: int, keep_multiple_of: int
) -> int:
    """The scheduled length, rounded down to a multiple of ``keep_multiple_of``."""
    length = _scheduled(min_len, max_len, step, warmup_steps)
    return int(keep_multiple_of * (length // keep_multiple_of))


def _per_token(batch: dict[str, Any]) -> tuple[list[str], list[str]]:
    rows, length = batch["input_ids"].shape[:2]
    tokens, instances, other = [], [], []
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and tuple(value.shape[:2]) == (rows, length):
            tokens.append(key)
        elif isinstance(value, torch.Tensor) and tuple(value.shape) == (rows,):
            instances.append(key)
        else:
            other.append(key)
    if other:
        raise ConfigurationError(
            f"cannot change the sequence length of a batch with {', '.join(other)} (only "
            "per-token and per-instance tensors can be reshaped)",
            path="callbacks.sequence_length_scheduler",
        )
    return tokens, instances


def melt_batch(batch: dict[str, Any], seq_len: int) -> dict[str, Any]:
    """Split every instance into ``length / seq_len`` instances of ``seq_len`` tokens."""
    tokens, instances = _per_token(batch)
    rows, length = batch["input_ids"].shape[:2]
    pieces = length // seq_len
    out = {k: batch[k].reshape(rows * pieces, seq_len, *batch[k].shape[2:]) for k in tokens}
    out |= {k: batch[k].repeat_interleave(pieces) for k in instances}
    return out


def truncate_batch(batch: dict[str, Any], seq_len: int) -> dict[str, Any]:
    """Keep the first ``seq_len`` tokens of every instance."""
    tokens, _ = _per_token(batch)
    return {k: batch[k][:, :seq_len].contiguous() for k in tokens}
