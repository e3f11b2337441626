"""The dataset over ``prepare-data --sft`` output: token ids, labels and document ids.

An item is ``{"input_ids", "labels", "doc_ids", "index"}`` (int64 tensors of
``sequence_length``). ``labels[t]`` is the token at ``t + 1`` where that token is trained on
(an assistant token of the same example) and ``-100`` everywhere else: the prompt, the
padding, and across the boundary between two packed examples. ``doc_ids`` tell the model
where each packed example starts (see :func:`olmolike.nn.rope.document_attention`).

It serves :class:`~olmolike.data.numpy_data_loader.NumpyDataLoader` like a token dataset, so
SFT runs get the same global batches, rank slices and exact resume as pretraining.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from ..exceptions import DataError
from .numpy_dataset import METADATA_FILE
from .prepared_io import PreparedSplitConfig

__all__ = ["IGNORE_INDEX", "SFTDataset", "SFTDatasetConfig"]

log = logging.getLogger(__name__)

_DESCRIBED: set[tuple[str, str]] = set()
"""The (folder, split) pairs already described in the log by this process."""

IGNORE_INDEX = -100
ARRAYS = ("input_ids", "label_mask", "doc_ids")


def labels_from_mask(ids: np.ndarray, mask: np.ndarray, docs: np.ndarray) -> np.ndarray:
    """Next-token labels: ``ids[t + 1]`` where that token is trained on and in the same
    example as ``t``, else :data:`IGNORE_INDEX`."""
    labels = np.full(ids.shape, IGNORE_INDEX, dtype=np.int64)
    keep = mask[..., 1:].astype(bool) & (docs[..., 1:] == docs[..., :-1])
    labels[..., :-1] = np.where(keep, ids[..., 1:].astype(np.int64), IGNORE_INDEX)
    return labels


class SFTDataset(torch.utils.data.Dataset):
    """The sequences of one split of a ``prepare-data --sft`` folder (memory-mapped)."""

    def __init__(self, folder: str | Path, split: str = "train") -> None:
        folder = Path(folder)
        meta_path = folder / METADATA_FILE
        if not meta_path.is_file():
            raise DataError(
                f"{folder} holds no {METADATA_FILE}; make it with olmolike prepare-data --sft"
            )
        self.metadata = json.loads(meta_path.read_text())
        if self.metadata.get("kind") != "sft":
            raise DataError(
                f"{folder} holds pretraining token shards, not SFT sequences; prepare the "
                "chat data with olmolike prepare-data --sft"
            )
        stats = self.metadata["splits"].get(split)
        if not stats or not stats["sequences"]:
            raise DataError(
                f"{folder} has no {split!r} sequences; prepare it with --val-fraction > 0 for "
                "a validation split"
            )
        self.folder, self.split = folder, split
        self.sequence_length = int(self.metadata["sequence_length"])
        self.vocab_size: int | None = int(self.metadata["vocab_size"])
        self.eos_token_id = int(self.metadata["eos_token_id"])
        self.stats: dict[str, Any] = stats
        self._arrays: dict[str, np.ndarray] = {}
        described = {"split": split, "stats": stats, "args": self.metadata["arguments"]}
        self._fingerprint = hashlib.sha256(json.dumps(described).encode()).hexdigest()
        shape = self._array("input_ids").shape
        if shape != (stats["sequences"], self.sequence_length):
            raise DataError(f"{folder}/{split} is damaged: shapes disagree with the metadata")
        if (str(folder), split) not in _DESCRIBED:  # a script may open a split twice
            _DESCRIBED.add((str(folder), split))
            log.info(
                "SFT data %s/%s: %d sequences, %d examples, padding %.1f%%",
                folder, split, stats["sequences"], stats["examples"],
                100 * stats["padding_fraction"],
            )  # fmt: skip

    def _array(self, name: str) -> np.ndarray:
        if name not in self._arrays:
            self._arrays[name] = np.load(self.folder / self.split / f"{name}.npy", mmap_mode="r")
        return self._arrays[name]

    @property
    def fingerprint(self) -> str:
        """Identifies the sequences (their statistics and how they were prepared)."""
        return self._fingerprint

    @property
    def padding_fraction(self) -> float:
        return float(self.stats["padding_fraction"])

    def __len__(self) -> int:
        return int(self.stats["sequences"])

    def __getitem__(self, index: int) -> dict[str, Any]:
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"sequence {index} is out of range for {len(self)} sequences")
        ids, mask, docs = (np.asarray(self._array(name)[index]) for name in ARRAYS)
        return {
            "input_ids": torch.from_numpy(ids.astype(np.int64)),
            "labels": torch.from_numpy(labels_from_mask(ids, mask, docs)),
            "doc_ids": torch.from_numpy(docs.astype(np.int64)),
            "index": index,
        }

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_arrays": {}}  # reopened where the dataset lands


@dataclass
class SFTDatasetConfig(PreparedSplitConfig):
    """One split of a ``prepare-data --sft`` folder (local)."""

    registered_name: ClassVar[str] = "sft"

    def build(self) -> SFTDataset:
        return SFTDataset(self.path, self.split)

    @property
    def sequence_length(self) -> int:
        """From the folder's metadata (the data fixes it at preparation)."""
        data = json.loads((Path(self.path) / METADATA_FILE).read_text())
        return int(data["sequence_length"])
