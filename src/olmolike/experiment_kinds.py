"""What an experiment file trains: the train module's class picks pretraining, SFT, DPO or GRPO,
and each needs its own kind of ``dataset``.

=================================  ====================================================
``train_module._CLASS_``           ``dataset._CLASS_``
=================================  ====================================================
``transformer`` (or two_stage_kl)  ``numpy`` (``prepare-data``): pretraining;
                                   ``sft`` (``prepare-data --sft``): supervised fine-tuning
``dpo``                            ``preference_pairs`` (``prepare-data --dpo``)
``grpo``                           ``prompts`` (a prompt JSONL file)
=================================  ====================================================

The short names are aliases registered here; the full ``module.ClassName`` (what ``--dry-run``
prints) works as well. Registering them imports nothing new: every class is already imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.nn as nn

from .config import register_config_class
from .data.data_loader import DataLoaderBase
from .data.numpy_data_loader import NumpyDataLoaderConfig
from .data.numpy_dataset import NumpyDatasetConfig
from .data.post_training_data import PreferenceDatasetConfig, PromptDatasetConfig
from .data.sft_dataset import SFTDatasetConfig
from .data.tokenizer import TokenizerConfig
from .exceptions import ConfigurationError
from .nn import TransformerConfig
from .train.train_module import TransformerTrainModule, TransformerTrainModuleConfig
from .train.train_module.dpo import DPOTrainModuleConfig
from .train.train_module.grpo import GRPOTrainModuleConfig, RewardRegistry
from .train.train_module.grpo.entry_points import load_entry_point_rewards
from .train.train_module.two_stage_kl import TwoStageKLTrainModuleConfig

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = [
    "DatasetConfig",
    "build_data_loader",
    "build_train_module",
    "check_data",
    "kind_of",
    "load_rewards",
]

DatasetConfig = (
    NumpyDatasetConfig | SFTDatasetConfig | PreferenceDatasetConfig | PromptDatasetConfig
)
"""The ``dataset`` section: which one is named by its ``_CLASS_`` (``numpy`` if none)."""

_ALIASES: dict[type, str] = {
    TransformerTrainModuleConfig: "transformer",
    DPOTrainModuleConfig: "dpo",
    GRPOTrainModuleConfig: "grpo",
    TwoStageKLTrainModuleConfig: "two_stage_kl",
    NumpyDatasetConfig: "numpy",
    SFTDatasetConfig: "sft",
}
"""Short ``_CLASS_`` names (the data configs defined for experiments carry their own), and
the bare class names, as the optimizers have."""
for cls, alias in _ALIASES.items():
    register_config_class(cls, alias, cls.__name__)


@dataclass(frozen=True)
class _Kind:
    module: type[TransformerTrainModuleConfig]
    alias: str
    data: tuple[type, ...]
    trains_on: str
    data_aliases: str
    """The ``dataset._CLASS_`` names that fit, and where such data comes from."""


# Most specific first: DPO and GRPO configs are TransformerTrainModuleConfigs too.
_KINDS = (
    _Kind(
        GRPOTrainModuleConfig, "grpo", (PromptDatasetConfig,), "prompts", "prompts (a JSONL file)"
    ),
    _Kind(
        DPOTrainModuleConfig,
        "dpo",
        (PreferenceDatasetConfig,),
        "preference pairs",
        "preference_pairs (a prepare-data --dpo folder)",
    ),
    _Kind(
        TransformerTrainModuleConfig,
        "transformer",
        (NumpyDatasetConfig, SFTDatasetConfig),
        "tokens",
        "numpy (prepare-data) or sft (prepare-data --sft)",
    ),
)


def _kind(train_module: TransformerTrainModuleConfig) -> _Kind:
    return next(k for k in _KINDS if isinstance(train_module, k.module))


def kind_of(train_module: TransformerTrainModuleConfig, dataset: DatasetConfig) -> str:
    """``pretraining``, ``SFT``, ``DPO``, ``GRPO`` or a train module's own class name."""
    if isinstance(train_module, GRPOTrainModuleConfig):
        return "GRPO"
    if isinstance(train_module, DPOTrainModuleConfig):
        return "DPO"
    if type(train_module) is not TransformerTrainModuleConfig:
        return type(train_module).__name__
    return "SFT" if isinstance(dataset, SFTDatasetConfig) else "pretraining"


def check_data(
    train_module: TransformerTrainModuleConfig,
    dataset: DatasetConfig,
    data_loader: NumpyDataLoaderConfig,
) -> None:
    """The dataset is one the train module trains on, and the loader's settings apply to it."""
    kind = _kind(train_module)
    if not isinstance(dataset, kind.data):
        fits = [k.alias for k in _KINDS if isinstance(dataset, k.data)]
        other = f", or train_module._CLASS_ to {fits[0]}" if fits else ""
        raise ConfigurationError(
            f"a {type(train_module).__name__} trains on {kind.trains_on}, not on a "
            f"{type(dataset).__name__}: set dataset._CLASS_ to {kind.data_aliases}{other}",
            path="dataset",
        )
    in_memory = isinstance(dataset, (PreferenceDatasetConfig, PromptDatasetConfig))
    if in_memory and data_loader.num_workers:
        raise ConfigurationError(
            f"{type(dataset).__name__} is batched in memory, without workers; set it to 0",
            path="data_loader.num_workers",
        )
    if isinstance(dataset, PromptDatasetConfig) and not data_loader.shuffle:
        raise ConfigurationError(
            "GRPO prompts are always drawn in a seeded random order; remove shuffle=false",
            path="data_loader.shuffle",
        )


def build_data_loader(
    dataset: DatasetConfig,
    loader: NumpyDataLoaderConfig,
    model: TransformerConfig,
    dp_process_group: dist.ProcessGroup | None = None,
) -> DataLoaderBase:
    """This rank's loader over the experiment's data; checks the data fits the model.
    ``dp_process_group``: the ranks that split the data (default: all); token data only."""
    try:
        if isinstance(dataset, PromptDatasetConfig):
            return dataset.build_loader(
                global_batch_size=loader.global_batch_size, seed=loader.seed
            )
        if isinstance(dataset, PreferenceDatasetConfig):
            built = dataset.build_loader(
                global_batch_size=loader.global_batch_size, seed=loader.seed, shuffle=loader.shuffle
            )
            _check_fits(model, built.instances.shape[1] // 4)
            return built
    except ConfigurationError as e:
        raise e.under("data_loader") from None
    if isinstance(dataset, SFTDatasetConfig):
        _check_fits(model, dataset.sequence_length)
    return loader.build(dataset.build(), dp_process_group=dp_process_group)


def _check_fits(model: TransformerConfig, sequence_length: int) -> None:
    if sequence_length > model.max_sequence_length:
        raise ConfigurationError(
            f"is {model.max_sequence_length} but the dataset's sequences are "
            f"{sequence_length} tokens; raise it to at least {sequence_length}",
            path="model.max_sequence_length",
        )


def load_rewards(
    module: TransformerTrainModuleConfig, rewards: RewardRegistry | None = None
) -> RewardRegistry | None:
    """For GRPO, a registry with every reward function ``module`` names: ``rewards`` (a
    script's) or else loaded now from the ``olmolike.rewards`` entry points. ``None`` for the
    other kinds, which have no rewards (and import none)."""
    if not isinstance(module, GRPOTrainModuleConfig):
        return None
    try:
        return load_entry_point_rewards(module.rewards, rewards)
    except ConfigurationError as e:
        raise e.under("train_module") from None


def build_train_module(
    module: TransformerTrainModuleConfig,
    model: nn.Module,
    tokenizer: TokenizerConfig,
    rewards: RewardRegistry | None = None,
) -> TransformerTrainModule:
    """The train module over ``model``; GRPO's reward functions are ``rewards``
    (:func:`load_rewards`), its completions decoded with ``tokenizer``."""
    if isinstance(module, GRPOTrainModuleConfig):
        if rewards is None:
            raise ValueError("a GRPO train module needs its reward functions: see load_rewards")
        return module.build(model, tokenizer=tokenizer.build(), registry=rewards)
    return module.build(model)
