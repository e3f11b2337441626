"""The loader over a :class:`NumpyFSLDataset`: global batches, rank slices, exact resume.

The order of an epoch's instances is a permutation seeded by ``seed + epoch`` (the same on
every rank, computed locally: no communication). Global batch ``b`` is the window
``[b * I, (b + 1) * I)`` of that permutation, where ``I`` is the number of instances per global
batch, and data-parallel rank ``r`` of ``W`` takes the ``r``-th contiguous ``I / W`` of it.
Instances left over after the last whole global batch are not used in that epoch.

Because a batch is a window over a fixed order, the position in an epoch is one number, the
instances consumed, which :meth:`NumpyDataLoader.state_dict` saves: resuming continues with
exactly the next batch, also with a global batch size changed by an integer factor. The size
is read again for every batch, so it may also change between two batches of a running epoch
(e.g. by a batch size schedule) as long as the instances consumed are a multiple of the new
batch: the next batch is then the next window of the new size.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..config import Config
from ..exceptions import ConfigurationError, DataError
from .data_loader import Batch, FixedLengthDataLoader, check_resized_resume, check_same_settings
from .numpy_dataset import NumpyFSLDataset
from .sft_dataset import SFTDataset

__all__ = ["NumpyDataLoader", "NumpyDataLoaderConfig", "iter_eval_batches"]

log = logging.getLogger(__name__)


Instances = NumpyFSLDataset | SFTDataset
"""What the loader serves: token instances, or SFT sequences (which add labels, doc ids)."""


def _collate(dataset: Instances, indices: np.ndarray) -> Batch:
    items = [dataset[int(i)] for i in indices]
    batch = {
        key: torch.stack([item[key] for item in items])
        for key, value in items[0].items()
        if isinstance(value, torch.Tensor)
    }
    batch["index"] = torch.as_tensor(indices, dtype=torch.long)
    return batch


class _Batches(torch.utils.data.Dataset):
    """Batch ``k`` is the instances in row ``k``: lets DataLoader workers build whole batches
    while the DataLoader keeps them in order."""

    def __init__(self, dataset: Instances, rows: np.ndarray) -> None:
        self.dataset = dataset
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, k: int) -> Batch:
        return _collate(self.dataset, self.rows[k])


class NumpyDataLoader(FixedLengthDataLoader):
    """Yields ``{"input_ids": (B, T) LongTensor, "index": (B,) LongTensor}`` for this rank
    (over an :class:`SFTDataset`, also ``"labels"`` and ``"doc_ids"``).

    ``global_batch_size`` counts tokens across all ranks and must be a multiple of
    ``sequence_length x dp_world_size``. With ``num_workers > 0``, batches are read in
    ``torch.utils.data.DataLoader`` worker processes (pinned when CUDA is available); they are
    the same batches, in the same order, as with no workers.
    """

    supports_batch_size_changes = True

    def __init__(
        self,
        dataset: Instances,
        *,
        global_batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        num_workers: int = 0,
        prefetch_factor: int = 2,
        ignore_fingerprint_mismatch: bool = False,
        dp_world_size: int | None = None,
        dp_rank: int | None = None,
    ) -> None:
        self.dataset = dataset
        self.sequence_length = dataset.sequence_length
        self.seed = seed
        self.shuffle = shuffle
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self.ignore_fingerprint_mismatch = ignore_fingerprint_mismatch
        super().__init__(
            global_batch_size=global_batch_size, dp_world_size=dp_world_size, dp_rank=dp_rank
        )
        if self.total_batches == 0:
            raise DataError(
                f"the dataset has {len(dataset)} instances, fewer than one global batch "
                f"({self.instances_per_batch}); lower global_batch_size or add data"
            )
        self._order_cache: tuple[int, np.ndarray] | None = None

    @property
    def _instance_tokens(self) -> int:
        return self.sequence_length

    @property
    def total_batches(self) -> int:
        return len(self.dataset) // self.instances_per_batch

    def order(self, epoch: int) -> np.ndarray:
        """Dataset indices in the order ``epoch`` visits them (identical on every rank)."""
        if self._order_cache is None or self._order_cache[0] != epoch:
            count = len(self.dataset)
            order = (
                np.random.default_rng(self.seed + epoch).permutation(count)
                if self.shuffle
                else np.arange(count)
            )
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    def _rank_rows(self) -> np.ndarray:
        """This rank's instances of each remaining batch of the current size, one row each."""
        per_batch = self.instances_per_batch
        per_rank = per_batch // self.dp_world_size
        order = self.order(self.epoch or 1)
        windows = order[self.instances_consumed : self.total_batches * per_batch]
        rows = windows.reshape(-1, per_batch)
        return rows[:, self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]

    def _next_rank_row(self) -> np.ndarray:
        """This rank's instances of the next batch of the current size."""
        return self.order(self.epoch or 1)[self._rank_window()]

    def _iter_batches(self) -> Iterator[Batch]:
        if self.num_workers == 0:
            while not self.epoch_finished:
                yield _collate(self.dataset, self._next_rank_row())
            return
        while not self.epoch_finished:
            size = self.global_batch_size
            for batch in self._worker_loader(self._rank_rows()):
                yield batch
                if self.global_batch_size != size:
                    # The workers read ahead in the old layout: restart them in the new one.
                    break

    def _worker_loader(self, rows: np.ndarray) -> torch.utils.data.DataLoader[Batch]:
        return torch.utils.data.DataLoader(
            _Batches(self.dataset, rows),
            batch_size=None,
            shuffle=False,
            num_workers=self.num_workers,
            prefetch_factor=self.prefetch_factor,
            pin_memory=torch.cuda.is_available(),
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "fingerprint": self.dataset.fingerprint,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "instances_consumed": self.instances_consumed,
            "sequence_length": self.sequence_length,
            "global_batch_size": self.global_batch_size,
            "batches_processed": self.batches_processed,
            "tokens_processed": self.tokens_processed,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue at the next batch after the saved position.

        Refuses another seed or shuffle setting, and (unless ``ignore_fingerprint_mismatch``)
        another dataset. With ``ignore_fingerprint_mismatch``, a different dataset continues
        from the saved epoch and position in *its own* order (or at the epoch's end, if the
        new epoch is shorter): nothing already trained on is repeated by position.
        """
        check_same_settings(state_dict, self, ("seed", "shuffle"))
        if state_dict["fingerprint"] != self.dataset.fingerprint:
            if not self.ignore_fingerprint_mismatch:
                raise DataError(
                    "the checkpoint was trained on a different dataset (files, sizes, "
                    "sequence length or mixture changed); restore it, or set "
                    "ignore_fingerprint_mismatch=True to continue from the saved position"
                )
            log.warning(
                "The dataset differs from the checkpoint's; continuing from epoch %s, "
                "instance %d of the new data's order",
                state_dict["epoch"],
                state_dict["instances_consumed"],
            )
        consumed = int(state_dict["instances_consumed"])
        saved = state_dict["global_batch_size"] // state_dict["sequence_length"]
        check_resized_resume(consumed, saved, self.instances_per_batch)
        self.epoch = state_dict["epoch"]
        self.batches_processed = int(state_dict["batches_processed"])
        # Another dataset's epoch may be shorter: then the saved position is its end.
        self.tokens_processed = (
            min(consumed, self.total_batches * self.instances_per_batch) * self.sequence_length
        )

    def get_mock_batch(self) -> Batch:
        rows = self.instances_per_batch // self.dp_world_size
        if isinstance(self.dataset, SFTDataset):  # real rows: labels and doc ids must agree
            return _collate(self.dataset, np.arange(rows) % len(self.dataset))
        high = self.dataset.vocab_size or 256
        generator = torch.Generator().manual_seed(self.seed)
        return {
            "input_ids": torch.randint(0, high, (rows, self.sequence_length), generator=generator),
            "index": torch.arange(rows),
        }


@dataclass
class NumpyDataLoaderConfig(Config):
    """Builds a :class:`NumpyDataLoader`; ``global_batch_size`` is in tokens."""

    global_batch_size: int
    """Tokens per optimizer step over all data-parallel ranks: a multiple of the sequence length
    times the data-parallel ranks (each rank gets an equal share of instances)."""
    seed: int = 0
    """Seeds the order of the instances: each epoch is shuffled from ``seed`` and the epoch number,
    so the same seed gives the same batches (and a resumed run the same ones it would have had)."""
    shuffle: bool = True
    """Off for validation: every epoch in dataset order."""
    num_workers: int = 0
    """Worker processes that read batches ahead of the training loop
    (``torch.utils.data.DataLoader``'s); 0 reads them in the training process."""
    prefetch_factor: int = 2
    """Batches each worker reads ahead (with ``num_workers > 0``)."""
    ignore_fingerprint_mismatch: bool = False
    """Resume from a checkpoint made on different data (see ``load_state_dict``)."""

    def validate(self) -> None:
        if self.global_batch_size <= 0:
            raise self._invalid(
                "global_batch_size", f"must be positive, got {self.global_batch_size}"
            )
        if self.num_workers < 0:
            raise self._invalid("num_workers", f"must be >= 0, got {self.num_workers}")
        if self.prefetch_factor < 1:
            raise self._invalid("prefetch_factor", f"must be >= 1, got {self.prefetch_factor}")

    def build(
        self,
        dataset: Instances,
        *,
        dp_process_group: dist.ProcessGroup | None = None,
        dp_rank: int | None = None,
        dp_world_size: int | None = None,
    ) -> NumpyDataLoader:
        """The loader for this rank: of ``dp_process_group`` if given, else the explicit
        ``dp_rank``/``dp_world_size``, else the default process group (or a single process)."""
        if dp_process_group is not None:
            dp_rank = dist.get_rank(dp_process_group)
            dp_world_size = dist.get_world_size(dp_process_group)
        try:
            return NumpyDataLoader(
                dataset,
                global_batch_size=self.global_batch_size,
                seed=self.seed,
                shuffle=self.shuffle,
                num_workers=self.num_workers,
                prefetch_factor=self.prefetch_factor,
                ignore_fingerprint_mismatch=self.ignore_fingerprint_mismatch,
                dp_world_size=dp_world_size,
                dp_rank=dp_rank,
            )
        except ConfigurationError as e:
            raise e.under("data_loader") from None


def iter_eval_batches(
    dataset: Instances, batch_size_instances: int, dp_rank: int = 0, dp_world_size: int = 1
) -> Iterator[Batch]:
    """Every instance once, in order, in batches of ``batch_size_instances``.

    Rank ``r`` takes the ``r``-th contiguous share of the instances (shares differ by at most
    one), and its last batch may be partial: nothing is dropped, so an evaluation covers the
    whole dataset. Ranks can therefore get different numbers of batches.
    """
    if batch_size_instances < 1:
        raise ConfigurationError(f"must be positive, got {batch_size_instances}", path="batch_size")
    if not 0 <= dp_rank < dp_world_size:
        raise ConfigurationError(f"must be in [0, {dp_world_size}), got {dp_rank}", path="dp_rank")
    count = len(dataset)
    start, end = count * dp_rank // dp_world_size, count * (dp_rank + 1) // dp_world_size
    for first in range(start, end, batch_size_instances):
        yield _collate(dataset, np.arange(first, min(first + batch_size_instances, end)))
