"""Data loaders: which tokens come next, on which rank, and how to resume exactly there."""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any, ClassVar

import torch

from ..distributed.utils import get_rank, get_world_size
from ..exceptions import ConfigurationError, DataError

__all__ = [
    "DataLoaderBase",
    "FixedLengthDataLoader",
    "TokenTensorDataLoader",
    "check_resized_resume",
    "check_same_data",
    "check_same_settings",
]


Batch = dict[str, Any]


class DataLoaderBase(ABC):
    """Base class for the trainer's data loader.

    A loader yields this rank's slice of each global batch. Its position in the current epoch
    is :attr:`tokens_processed`, the global tokens yielded so far: a count that stays exact when
    the batch size changes mid-epoch, so :meth:`state_dict` / :meth:`load_state_dict` resume at
    exactly the next batch either way.

    :param global_batch_size: tokens per optimizer step across all data-parallel ranks.
    """

    supports_batch_size_changes: ClassVar[bool] = False
    """Whether ``global_batch_size`` may change between two batches of an epoch. Loaders that
    read the size again for every batch set this; the rest fix their layout per epoch."""

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
        self.batches_processed = 0
        """Batches yielded so far in the current epoch (of whatever size each had)."""
        self.tokens_processed = 0
        """Tokens (global) yielded so far in the current epoch: the position in the epoch."""
        self.epoch: int | None = None
        self.global_batch_size = global_batch_size

    def check_data_parallel(self, dp_rank: int, dp_world_size: int) -> None:
        """Refuse to serve a trainer whose data-parallel group differs from this loader's."""
        if self.dp_rank != dp_rank:
            raise ConfigurationError(
                f"the data loader serves data-parallel rank {self.dp_rank}, but this process is "
                f"rank {dp_rank} of the data-parallel group; build the loader with "
                f"dp_rank={dp_rank}",
                path="data_loader.dp_rank",
            )
        if self.dp_world_size != dp_world_size:
            raise ConfigurationError(
                f"the data loader splits batches over {self.dp_world_size} ranks but the "
                f"data-parallel group has {dp_world_size}; build the loader with "
                f"dp_world_size={dp_world_size}",
                path="data_loader.dp_world_size",
            )

    @property
    def global_batch_size(self) -> int:
        return self._global_batch_size

    @global_batch_size.setter
    def global_batch_size(self, value: int) -> None:
        self._check_global_batch_size(value)
        if self.tokens_processed % value:
            # Batches of each size are windows at multiples of that size in the epoch's order;
            # an unaligned start would break that, and with it epoch ends and exact resumes.
            raise DataError(
                f"cannot change global_batch_size to {value} tokens now: {self.tokens_processed} "
                f"tokens of this epoch are consumed, which is not a multiple of {value}. Change "
                "it at a step where the consumed tokens are a multiple of the new size, or at "
                "the start of an epoch"
            )
        self._global_batch_size = value

    @property
    def _instance_tokens(self) -> int:
        """Tokens in one instance, the unit batches are made of (1: any number of tokens)."""
        return 1

    def _check_global_batch_size(self, value: int) -> None:
        """Raise :class:`ConfigurationError` if this loader cannot serve ``value`` tokens a
        batch: whole instances on every data-parallel rank."""
        multiple = self._instance_tokens * self.dp_world_size
        if value <= 0 or value % multiple:
            what = "the data-parallel world size"
            if self._instance_tokens > 1:
                what = (
                    f"the instance length x {what} = {self._instance_tokens} x {self.dp_world_size}"
                )
            raise ConfigurationError(
                f"must be a positive multiple of {what} = {multiple} tokens, got {value}",
                path="global_batch_size",
            )

    @property
    def rank_batch_size(self) -> int:
        """Tokens per batch on this rank."""
        return self.global_batch_size // self.dp_world_size

    @property
    @abstractmethod
    def total_batches(self) -> int | None:
        """Batches of the current size in one epoch, or ``None`` if unknown (e.g. streaming)."""

    @property
    def next_batch_index(self) -> int:
        """Which batch of the current size comes next in the epoch (0-based).

        Exact because the setter keeps :attr:`tokens_processed` a multiple of the batch size.
        """
        return self.tokens_processed // self._global_batch_size

    @property
    def epoch_finished(self) -> bool:
        total = self.total_batches
        return total is not None and self.tokens_processed // self._global_batch_size >= total

    def __iter__(self) -> Iterator[Batch]:
        if self.epoch is None:
            raise RuntimeError("call reshuffle(epoch) before iterating over the data loader")
        for batch in self._iter_batches():
            # Nothing runs between building the batch and this line: the size is the batch's.
            self.batches_processed += 1
            self.tokens_processed += self._global_batch_size
            yield batch

    @abstractmethod
    def _iter_batches(self) -> Iterator[Batch]:
        """Yield this rank's batches of the current epoch from :attr:`next_batch_index` on.

        A loader that supports batch size changes reads the size again for every batch.
        """

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


class FixedLengthDataLoader(DataLoaderBase):
    """A loader of fixed-length instances (:attr:`_instance_tokens` tokens each, set by the
    subclass): batches are whole instances on every rank, positions count instances, and each
    rank reads its contiguous share of every global batch from the epoch's order."""

    @property
    def instances_per_batch(self) -> int:
        """Instances in one global batch (all ranks)."""
        return self.global_batch_size // self._instance_tokens

    @property
    def instances_consumed(self) -> int:
        """Instances of the current epoch already yielded, summed over all ranks."""
        return self.tokens_processed // self._instance_tokens

    def _rank_window(self) -> slice:
        """This rank's share of the next batch, as positions in the epoch's order."""
        # Asked once per step: the arithmetic of instances_per_batch and instances_consumed
        # without their property calls.
        tokens = self._instance_tokens
        per_rank = self._global_batch_size // tokens // self.dp_world_size
        start = self.tokens_processed // tokens + self.dp_rank * per_rank
        return slice(start, start + per_rank)


class TokenTensorDataLoader(FixedLengthDataLoader):
    """Fixed-length instances from an in-memory ``(num_instances, seq_len)`` token tensor.

    The order of instances is a permutation seeded by ``seed + epoch``, the same on every rank;
    each rank takes its contiguous share of every global batch. Instances that do not fill a
    whole global batch at the end of an epoch are dropped. Batch ``b`` of the current size is
    the window ``[b * I, (b + 1) * I)`` of the order, so the size may change between batches.
    """

    supports_batch_size_changes = True

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

    @property
    def _instance_tokens(self) -> int:
        return self.seq_len

    @property
    def _batches_per_epoch(self) -> int:
        # instances // instances_per_batch, asked twice a step: without the property calls.
        return self.instances.shape[0] // (self._global_batch_size // self.seq_len)

    total_batches = _batches_per_epoch  # one property: epoch_finished asks it every step

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
        # The epoch's instances in order, gathered once (a private copy also when unshuffled,
        # so a train module that edits a batch in place cannot change the data), and split into
        # views of one rank's batch each when a batch size is first seen: the training loop
        # then takes a batch with no tensor op (a slice per step costs ~5 us, ~20 us with the
        # caches cold after a step). The views hold no data: ~300 bytes per batch, besides
        # the copy's seq_len * 8 bytes per instance.
        order = self._order()
        ordered = self.instances[order] if self.shuffle else self.instances.clone()
        views: dict[int, tuple[torch.Tensor, ...]] = {}  # by rows per rank batch
        while self.tokens_processed // self._global_batch_size < self._batches_per_epoch:
            window = self._rank_window()
            rows = window.stop - window.start
            if rows not in views:
                views[rows] = ordered.split(rows)
            # Windows start at multiples of their size (batch size changes keep that).
            yield self._make_batch(views[rows][window.start // rows], order, window)

    def _make_batch(self, rows: torch.Tensor, order: torch.Tensor, window: slice) -> Batch:
        """The batch of ``rows``, the instances at ``order[window]`` of :attr:`instances`."""
        return {"input_ids": rows}

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
        """Continue at the next batch after the saved position.

        The global batch size may differ from the saved one by an integer factor, as long as
        the saved position is a whole number of batches of the current size.
        """
        check_same_data(state_dict["fingerprint"], self.fingerprint, "token data")
        check_same_settings(state_dict, self, ("seed", "shuffle"))
        consumed = state_dict["tokens_processed"] // self.seq_len
        check_resized_resume(
            consumed, state_dict["global_batch_size"] // self.seq_len, self.instances_per_batch
        )
        self.epoch = state_dict["epoch"]
        self.batches_processed = state_dict["batches_processed"]
        self.tokens_processed = state_dict["tokens_processed"]

    def get_mock_batch(self) -> Batch:
        per_rank = self.instances_per_batch // self.dp_world_size
        generator = torch.Generator().manual_seed(self.seed)
        rows = torch.randint(0, self.instances.shape[0], (per_rank,), generator=generator)
        return self._make_batch(self.instances[rows].clone(), rows, slice(None))


def check_same_data(saved: str, fingerprint: str, data: str) -> None:
    """Refuse to resume on other ``data`` (e.g. "prompts") than the checkpoint was trained on:
    the saved position would point into another order, and the run would not continue."""
    if saved != fingerprint:
        raise DataError(
            f"the checkpoint was trained on different {data} than this loader holds; "
            "resuming would not continue the same run. Load without trainer state "
            f"(load_trainer_state=False) to start the {data} from the beginning"
        )


def check_same_settings(state_dict: dict[str, Any], loader: object, keys: tuple[str, ...]) -> None:
    """Refuse to resume with another value of a setting that decides which data comes next
    (the seed, shuffling, ...): each of ``keys`` must be as the checkpoint saved it."""
    for key in keys:
        saved, now = state_dict[key], getattr(loader, key)
        if saved != now:
            raise DataError(
                f"the data loader's {key} was {saved!r} in the checkpoint but is {now!r} now; "
                "set it back to resume the same data order"
            )


def check_resized_resume(consumed: int, saved: int, now: int) -> None:
    """Check a loader can resume ``consumed`` instances into an epoch with a global batch of
    ``now`` instances where the checkpoint had ``saved``.

    :raises DataError: if the sizes differ by no integer factor, or the position is not a
        whole number of the new batches (the next batch would not be a window of the order).
    """
    if max(saved, now) % min(saved, now):
        raise DataError(
            f"the global batch changed from {saved} to {now} instances, not by an integer "
            "factor; resume with a size that is a multiple or divisor of the saved one"
        )
    if consumed % now:
        raise DataError(
            f"the checkpoint consumed {consumed} instances of the epoch, not a multiple of "
            f"the new global batch of {now} instances; resume from a step where it is, or "
            "keep the old global_batch_size until the epoch ends"
        )
