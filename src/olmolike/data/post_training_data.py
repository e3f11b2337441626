"""Config forms of the post-training data, so an experiment file can name them.

SFT data has its own (:class:`~olmolike.data.sft_dataset.SFTDatasetConfig`): it is token data
and batches like pretraining data. Preference pairs and GRPO prompts are batched by their own
loaders; these configs say where the data is and build those loaders.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..config import Config
from ..distributed.utils import get_world_size
from ..exceptions import ConfigurationError
from .preference import PreferenceDataLoader
from .preference_prepare import load_preference_rows
from .prepared_io import PreparedSplitConfig
from .prompts import PromptDataLoader, read_prompt_jsonl

__all__ = ["PreferenceDatasetConfig", "PromptDatasetConfig"]


@dataclass
class PreferenceDatasetConfig(PreparedSplitConfig):
    """One split of a ``prepare-data --dpo`` folder: the pair rows DPO trains on."""

    registered_name: ClassVar[str] = "preference_pairs"

    def build_loader(
        self,
        *,
        global_batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        dp_rank: int | None = None,
        dp_world_size: int | None = None,
    ) -> PreferenceDataLoader:
        """``global_batch_size`` counts the stored rows' tokens: pairs x 4 x sequence length
        (chosen and rejected, each ids and labels), as :class:`PreferenceDataLoader` does.
        ``dp_rank``/``dp_world_size`` default to the global rank and world size."""
        rows = load_preference_rows(self.path, self.split)
        row = rows.shape[1]
        if global_batch_size % row:
            raise ConfigurationError(
                f"{global_batch_size} tokens is not a whole number of preference pairs: a pair "
                f"is 4 x sequence_length = {row} tokens (chosen and rejected, ids and labels); "
                f"use a multiple of {row}, e.g. {16 * row} for 16 pairs",
                path="global_batch_size",
            )
        return PreferenceDataLoader(
            rows.long(),
            global_batch_size=global_batch_size,
            seed=seed,
            shuffle=shuffle,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
        )


@dataclass
class PromptDatasetConfig(Config):
    """A prompt JSONL file (``{"prompt": ..., "answer": ...}`` per line) for GRPO."""

    registered_name: ClassVar[str] = "prompts"

    path: str
    """The JSONL file, local or remote."""
    prompt_key: str = "prompt"
    """The key holding the prompt; every other key is passed to the reward functions."""

    def build_loader(
        self,
        *,
        global_batch_size: int,
        seed: int = 0,
        dp_rank: int | None = None,
        dp_world_size: int | None = None,
    ) -> PromptDataLoader:
        """``global_batch_size`` counts prompts over all data-parallel ranks (each gets an
        equal share); ``dp_rank``/``dp_world_size`` default to the global ones."""
        world = get_world_size() if dp_world_size is None else dp_world_size
        if global_batch_size % world:
            raise ConfigurationError(
                f"{global_batch_size} prompts cannot be split equally over {world} ranks; use "
                f"a multiple of {world}",
                path="global_batch_size",
            )
        records = read_prompt_jsonl(self.path, prompt_key=self.prompt_key)
        return PromptDataLoader(
            records,
            prompts_per_rank=global_batch_size // world,
            seed=seed,
            dp_world_size=world,
            dp_rank=dp_rank,
        )
