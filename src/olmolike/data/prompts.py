"""Prompt data for on-policy training (GRPO): JSONL records of a prompt and the fields its
rewards need, and a seeded, resumable sampler that gives each rank its own prompts.

Each line of the file is a JSON object with a string ``prompt`` (or the key given as
``prompt_key``) and any other fields, e.g. ``{"prompt": "12+30=", "answer": "42"}``. The other
fields are handed to the reward functions by name, as lists aligned with the completions.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import io
from ..exceptions import ConfigurationError, DataError

__all__ = ["PromptRecord", "PromptSampler", "read_prompt_jsonl"]

log = logging.getLogger(__name__)

# Reward functions receive these as keyword arguments of their own.
RESERVED_FIELDS = ("prompts", "completions")


@dataclass
class PromptRecord:
    prompt: str
    fields: dict[str, Any] = field(default_factory=dict)
    """Every other key of the record, for the reward functions (e.g. ``answer``)."""


def read_prompt_jsonl(path: io.PathOrStr, *, prompt_key: str = "prompt") -> list[PromptRecord]:
    """Read prompt records from a JSONL file (local or remote); blank lines are skipped.

    Raises :class:`DataError` naming the line for a line that is not a JSON object, a missing
    or non-string prompt, or a field named like a reward function argument, and for a file
    without records.
    """
    records = []
    text = io.read_bytes(path).decode("utf-8")
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(
                f"{where}: not valid JSON ({e.msg}); write one JSON object per line"
            ) from None
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

    def _order(self) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.records), generator=generator).tolist()

    def next_batch(self) -> list[PromptRecord]:
        if self.batch_in_epoch == self.batches_per_epoch:
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0
        global_batch = self.prompts_per_rank * self.world_size
        start = self.batch_in_epoch * global_batch
        chosen = self._order()[start : start + global_batch][self.rank :: self.world_size]
        self.batch_in_epoch += 1
        return [self.records[i] for i in chosen]

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
