"""Data loaders: which tokens come next, on which rank, and how to resume exactly there."""

from __future__ import annotations

import hashlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

import torch

from ..distributed.utils import get_rank, get_world_size
from ..exceptions import ConfigurationError, DataError

__all__ = ["DataLoaderBase", "TokenTensorDataLoader"]

log = logging.getLogger(__name__)

Batch = dict[str, Any]


class DataLoaderBase(ABC):
    """Base class for the trainer's data loader.

    A loader yields this rank's slice of each global batch. It counts what it has yielded in
    the current epoch so that :meth:`state_dict` / :meth:`load_state_dict` resume at exactly
    the next batch.

    :param global_batch_size: tokens per optimizer step across all data-parallel ranks.
    """

    def __init__(
        self,
        *,
        global_batch_size: int,
        dp_world_size: int | None = None,
        dp_rank: int | None = None,
    ) -> None:
        self.dp_world_size = get_world_size() if dp_world_size is None else dp_world_size
        self.dp_rank = get_rank() if dp_rank is None else dp_rank
        if not 0 <= self.dp_rank < self.dp_world_size:
            raise ConfigurationError(
                f"dp_rank must be in [0, {self.dp_world_size}), got {self.dp_rank}", path="dp_rank"
            )
        self.global_batch_size = global_batch_size
        self.batches_processed = 0
        """Batches yielded so far in the current epoch."""
        self.tokens_processed = 0
        """Tokens (global) yielded so far in the current epoch."""
        self.epoch: int | None = None

    @property
    def global_batch_size(self) -> int:
        return self._global_batch_size

    @global_batch_size.setter
    def global_batch_size(self, value: int) -> None:
        self._check_global_batch_size(value)
        self._global_batch_size = value

    def _check_global_batch_size(self, value: int) -> None:
        """Raise :class:`ConfigurationError` if this loader cannot serve ``value`` tokens a batch."""
        if value <= 0 or value % self.dp_world_size:
            raise ConfigurationError(
                f"must be a positive multiple of the data-parallel world size "
                f"({self.dp_world_size}), got {value}",
                path="global_batch_size",
            )

    @property
    def rank_batch_size(self) -> int:
        """Tokens per batch on this rank."""
        return self.global_batch_size // self.dp_world_size

    @property
    @abstractmethod
    def total_batches(self) -> int | None:
        """Batches in one epoch, or ``None`` if unknown ahead of time (e.g. streaming)."""

    @property
    def epoch_finished(self) -> bool:
        total = self.total_batches
        return total is not None and self.batches_processed >= total

    def __iter__(self) -> Iterator[Batch]:
        if self.epoch is None:
            raise RuntimeError("call reshuffle(epoch) before iterating over the data loader")
        for batch in self._iter_batches():
            self.batches_processed += 1
            self.tokens_processed += self.global_batch_size
            yield batch

    @abstractmethod
    def _iter_batches(self) -> Iterator[Batch]:
        """Yield this rank's batches of the current epoch, starting after ``batches_processed``."""

    def reshuffle(self, epoch: int | None = None) -> None:
        """Prepare to iterate over ``epoch`` (1-based; default: the next one).

        Keeps the position within the epoch, so a loader restored mid-epoch continues there.
        """
        if epoch is None:
            epoch = 1 if self.epoch is None else self.epoch + 1
        if epoch != self.epoch:
            self.batches_processed = self.tokens_processed = 0
        self.epoch = epoch

    def reset(self) -> None:
        """Forget the position within the epoch (called when an epoch ends)."""
        self.batches_processed = 0
        self.tokens_processed = 0

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Plain values (no tensors) from which :meth:`load_state_dict` resumes exactly."""

    @abstractmethod
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...

    @abstractmethod
    def get_mock_batch(self) -> Batch:
        """A batch of this rank's shape, for dry runs and benchmarks."""


class TokenTensorDataLoader(DataLoaderBase):
    """Fixed-length instances from an in-memory ``(num_instances, seq_len)`` token tensor.

    The order of instances is a permutation seeded by ``seed + epoch``, the same on every rank;
    each rank takes its contiguous share of every global batch. Instances that do not fill a
    whole global batch at the end of an epoch are dropped.
    """

    def __init__(
        self,
        instances: torch.Tensor,
        *,
        global_batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        dp_world_size: int | None = None,
        dp_rank: int | None = None,
    ) -> None:
        if instances.ndim != 2 or instances.shape[0] == 0 or instances.shape[1] == 0:
            raise DataError(
                f"instances must be a non-empty (num_instances, seq_len) tensor, "
                f"got shape {tuple(instances.shape)}"
            )
        if instances.dtype not in (torch.int32, torch.int64):
            raise DataError(f"instances must hold integer token ids, got {instances.dtype}")
        self.instances = instances
        self.seq_len = int(instances.shape[1])
        self.seed = seed
        self.shuffle = shuffle
        super().__init__(
            global_batch_size=global_batch_size, dp_world_size=dp_world_size, dp_rank=dp_rank
        )
        self._fingerprint: str | None = None

    def _check_global_batch_size(self, value: int) -> None:
        if value <= 0 or value % (self.seq_len * self.dp_world_size):
            raise ConfigurationError(
                f"must be a positive multiple of seq_len x dp world size "
                f"({self.seq_len} x {self.dp_world_size}), got {value}",
                path="global_batch_size",
            )

    @property
    def instances_per_batch(self) -> int:
        return self.global_batch_size // self.seq_len

    @property
    def total_batches(self) -> int | None:
        return self._batches_per_epoch

    @property
    def _batches_per_epoch(self) -> int:
        return self.instances.shape[0] // self.instances_per_batch

    @property
    def fingerprint(self) -> str:
        """A hash of the token data, so a resumed run can tell it is reading the same data."""
        if self._fingerprint is None:
            data = self.instances.contiguous().to(torch.int64).numpy().tobytes()
            self._fingerprint = hashlib.sha256(data).hexdigest()
        return self._fingerprint

    def _order(self) -> torch.Tensor:
        count = self.instances.shape[0]
        if not self.shuffle:
            return torch.arange(count)
        generator = torch.Generator().manual_seed(self.seed + (self.epoch or 1))
        return torch.randperm(count, generator=generator)

    def _iter_batches(self) -> Iterator[Batch]:
        order = self._order()
        per_batch, per_rank = (
            self.instances_per_batch,
            self.instances_per_batch // self.dp_world_size,
        )
        for batch_index in range(self.batches_processed, self._batches_per_epoch):
            start = batch_index * per_batch + self.dp_rank * per_rank
            yield {"input_ids": self.instances[order[start : start + per_rank]]}

    def state_dict(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "batches_processed": self.batches_processed,
            "tokens_processed": self.tokens_processed,
            "global_batch_size": self.global_batch_size,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict["fingerprint"] != self.fingerprint:
            raise DataError(
                "the checkpoint was trained on different token data than this loader holds; "
                "resuming would not continue the same run. Load without trainer state "
                "(load_trainer_state=False) to start the data from the beginning."
            )
        for key in ("seed", "shuffle", "global_batch_size"):
            if state_dict[key] != getattr(self, key):
                raise DataError(
                    f"data loader {key} was {state_dict[key]!r} in the checkpoint but is "
                    f"{getattr(self, key)!r} now; set it back to resume exactly"
                )
        self.epoch = state_dict["epoch"]
        self.batches_processed = state_dict["batches_processed"]
        self.tokens_processed = state_dict["tokens_processed"]

    def get_mock_batch(self) -> Batch:
        per_rank = self.instances_per_batch // self.dp_world_size
        generator = torch.Generator().manual_seed(self.seed)
        rows = torch.randint(0, self.instances.shape[0], (per_rank,), generator=generator)
        return {"input_ids": self.instances[rows].clone()}
