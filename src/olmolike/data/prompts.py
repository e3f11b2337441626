"""Prompt data for on-policy training (GRPO): JSONL records of a prompt and the fields its
rewards need, a seeded, resumable sampler that gives each rank its own prompts, and
:class:`PromptDataLoader`, the same order as a data loader for the :class:`~olmolike.train.Trainer`.

Each line of the file is a JSON object with a string ``prompt`` (or the key given as
``prompt_key``) and any other fields, e.g. ``{"prompt": "12+30=", "answer": "42"}``. The other
fields are handed to the reward functions by name, as lists aligned with the completions.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import io
from ..distributed.utils import get_world_size
from ..exceptions import ConfigurationError, DataError
from .data_loader import DataLoaderBase, check_same_data, check_same_settings
from .prepared_io import read_jsonl

__all__ = ["PromptDataLoader", "PromptRecord", "PromptSampler", "read_prompt_jsonl"]


# Reward functions receive these as keyword arguments of their own.
RESERVED_FIELDS = ("prompts", "completions")


@dataclass
class PromptRecord:
    """One line of a GRPO prompt file: the prompt, and the rest of the record for the rewards."""

    prompt: str
    """The text the policy continues (the record's ``prompt_key`` field)."""
    fields: dict[str, Any] = field(default_factory=dict)
    """Every other key of the record, for the reward functions (e.g. ``answer``)."""


def read_prompt_jsonl(path: io.PathOrStr, *, prompt_key: str = "prompt") -> list[PromptRecord]:
    """Read prompt records from a JSONL file (local or remote); blank lines are skipped.

    Raises :class:`DataError` naming the line for a line that is not a JSON object, a missing
    or non-string prompt, or a field named like a reward function argument, and for a file
    without records.
    """
    records = []
    for number, record in read_jsonl(path):
        where = f"{path}, line {number}"
        if not isinstance(record, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
        prompt = record.pop(prompt_key, None)
        if not isinstance(prompt, str) or not prompt:
            raise DataError(
                f"{where}: needs a non-empty string {prompt_key!r} (the keys are "
                f"{sorted(record)}); name the prompt key with prompt_key"
            )
        clash = [name for name in RESERVED_FIELDS if name in record]
        if clash:
            raise DataError(
                f"{where}: field {clash[0]!r} would shadow the reward functions' own argument; "
                "rename it"
            )
        records.append(PromptRecord(prompt, record))
    if not records:
        raise DataError(f"{path} holds no prompt records")
    return records


class PromptSampler:
    """Draws batches of prompts for each rank: an epoch is a seeded permutation of all
    records, dealt out round-robin so that ranks never share a prompt within an epoch.

    Each call to :meth:`next_batch` returns this rank's next ``prompts_per_rank`` records; the
    tail of an epoch too short to give every rank a full batch is dropped, so every rank takes
    the same number of steps. :meth:`state_dict` and :meth:`load_state_dict` make the
    sequence resume exactly.
    """

    def __init__(
        self,
        records: Sequence[PromptRecord],
        *,
        prompts_per_rank: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if prompts_per_rank < 1:
            raise ConfigurationError(
                f"must be >= 1, got {prompts_per_rank}", path="prompts_per_rank"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        if len(records) < prompts_per_rank * world_size:
            raise DataError(
                f"{len(records)} prompts cannot fill one batch of {prompts_per_rank} prompts on "
                f"each of {world_size} ranks; add prompts or lower prompts_per_rank"
            )
        self.records = list(records)
        self.prompts_per_rank, self.seed = prompts_per_rank, seed
        self.rank, self.world_size = rank, world_size
        self.epoch, self.batch_in_epoch = 0, 0
        self.batches_per_epoch = len(self.records) // (prompts_per_rank * world_size)

    def batch_indices(self, epoch: int, index: int) -> list[int]:
        """Indices into ``records`` of this rank's batch ``index`` (0-based) of ``epoch``
        (0-based): a pure function of the seed and the position, so any batch can be served
        again."""
        generator = torch.Generator().manual_seed(self.seed + epoch)
        order = torch.randperm(len(self.records), generator=generator).tolist()
        global_batch = self.prompts_per_rank * self.world_size
        start = index * global_batch
        return order[start : start + global_batch][self.rank :: self.world_size]

    def next_batch(self) -> list[PromptRecord]:
        if self.batch_in_epoch == self.batches_per_epoch:
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0
        self.batch_in_epoch += 1
        return [self.records[i] for i in self.batch_indices(self.epoch, self.batch_in_epoch - 1)]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["seed"] != self.seed:
            raise ConfigurationError(
                f"the checkpoint's prompt order was drawn with seed {state['seed']}, this run's "
                f"with {self.seed}; resume with the same seed",
                path="seed",
            )
        self.epoch, self.batch_in_epoch = int(state["epoch"]), int(state["batch_in_epoch"])


class PromptDataLoader(DataLoaderBase):
    """The :class:`PromptSampler` order as the trainer's data loader (for GRPO).

    Each batch is ``{"records": [...], "input_ids": ...}``: this rank's ``prompts_per_rank``
    :class:`PromptRecord` and, for the trainer's bookkeeping, their indices in ``records`` as a
    ``(prompts_per_rank, 1)`` tensor (the prompts are tokenized by the train module, which owns
    the tokenizer). Epoch ``e`` (1-based) is the sampler's seeded permutation ``seed + e - 1``;
    ranks never share a prompt within an epoch and the tail that cannot give every rank a full
    batch is dropped.

    Sizes count **prompts**, not tokens: ``global_batch_size`` is ``prompts_per_rank`` times
    the data-parallel world size, and the trainer's token counter (and so a duration or
    schedule in tokens) counts prompts. Give GRPO runs their length in steps or epochs.

    The position is the batch index within the epoch; :meth:`state_dict` saves it with a
    fingerprint of the records, so a resume continues with exactly the next prompts.
    """

    def __init__(
        self,
        records: Sequence[PromptRecord],
        *,
        prompts_per_rank: int,
        seed: int = 0,
        dp_world_size: int | None = None,
        dp_rank: int | None = None,
    ) -> None:
        if prompts_per_rank < 1:
            raise ConfigurationError(
                f"must be >= 1, got {prompts_per_rank}", path="prompts_per_rank"
            )
        self.prompts_per_rank = prompts_per_rank
        self.seed = seed
        world = get_world_size() if dp_world_size is None else dp_world_size
        super().__init__(
            global_batch_size=prompts_per_rank * world, dp_world_size=world, dp_rank=dp_rank
        )
        self.sampler = PromptSampler(
            records,
            prompts_per_rank=prompts_per_rank,
            seed=seed,
            rank=self.dp_rank,
            world_size=self.dp_world_size,
        )
        self._fingerprint: str | None = None

    @property
    def records(self) -> list[PromptRecord]:
        return self.sampler.records

    def _check_global_batch_size(self, value: int) -> None:
        if value != self.prompts_per_rank * self.dp_world_size:
            raise ConfigurationError(
                f"a prompt loader's global batch is prompts_per_rank x world size "
                f"({self.prompts_per_rank} x {self.dp_world_size} prompts), got {value}; "
                "change prompts_per_rank instead",
                path="global_batch_size",
            )

    @property
    def total_batches(self) -> int:
        return self.sampler.batches_per_epoch

    @property
    def fingerprint(self) -> str:
        """A hash of the records, so a resumed run can tell it is reading the same prompts."""
        if self._fingerprint is None:
            digest = hashlib.sha256()
            for record in self.records:
                digest.update(json.dumps([record.prompt, record.fields], sort_keys=True,
                                         default=str).encode())  # fmt: skip
            self._fingerprint = digest.hexdigest()[:16]
        return self._fingerprint

    def _make_batch(self, indices: list[int]) -> dict[str, Any]:
        return {
            "records": [self.records[i] for i in indices],
            "input_ids": torch.tensor(indices, dtype=torch.long)[:, None],
        }

    def _iter_batches(self) -> Iterator[dict[str, Any]]:
        assert self.epoch is not None
        while self.next_batch_index < self.total_batches:
            yield self._make_batch(
                self.sampler.batch_indices(self.epoch - 1, self.next_batch_index)
            )

    def state_dict(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "seed": self.seed,
            "prompts_per_rank": self.prompts_per_rank,
            "epoch": self.epoch,
            "batches_processed": self.batches_processed,
            "tokens_processed": self.tokens_processed,
            "global_batch_size": self.global_batch_size,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue at the next batch after the saved position (same prompts, seed and size)."""
        check_same_data(state_dict["fingerprint"], self.fingerprint, "prompts")
        check_same_settings(state_dict, self, ("seed", "global_batch_size"))
        self.epoch = state_dict["epoch"]
        self.batches_processed = state_dict["batches_processed"]
        self.tokens_processed = state_dict["tokens_processed"]

    def get_mock_batch(self) -> dict[str, Any]:
        return self._make_batch(self.sampler.batch_indices(0, 0))
