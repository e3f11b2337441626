"""Training from a config file, without a script: ``olmolike train CONFIG.yaml [--overrides]``.

An :class:`ExperimentConfig` holds what the example scripts build: the model, the train
module, the dataset and its loader, and the trainer with its callbacks. The train module's
``_CLASS_`` picks what is trained (pretraining, SFT, DPO, GRPO: see
:mod:`olmolike.experiment_kinds`) and the dataset's ``_CLASS_`` the data it needs, checked
when the file is read. The file is an example's ``--dry-run`` output, a
:meth:`~olmolike.config.Config.to_yaml` of this class, or written by hand; dotted overrides
on the command line change any field. Under ``torchrun`` (``torchrun --nproc-per-node=N -m
olmolike train CONFIG.yaml``) every rank reads the same file and the model is sharded or
replicated as ``train_module.dp_config`` says.

Nothing in the file is imported: ``_CLASS_`` names only classes the program has imported, and
GRPO's reward functions come from installed packages (the ``olmolike.rewards`` entry points).
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field

import yaml

from . import io
from .config import Config
from .config_coerce import check_separated_value
from .data.numpy_data_loader import NumpyDataLoaderConfig
from .data.numpy_dataset import NumpyDatasetConfig
from .data.tokenizer import TokenizerConfig
from .distributed.mesh import ParallelDegrees
from .distributed.utils import get_rank, get_world_size
from .exceptions import ConfigurationError
from .experiment_kinds import (
    DatasetConfig,
    build_data_loader,
    build_train_module,
    check_data,
    kind_of,
    load_rewards,
)
from .nn import TransformerConfig
from .nn.parallel_plan import check_tensor_parallel_degree
from .train import Trainer, TrainerConfig
from .train.callbacks import ConfigSaverCallback
from .train.train_module import TransformerTrainModuleConfig
from .train.train_module.grpo import RewardRegistry
from .train.train_module.pipeline import check_pipeline

__all__ = ["ExperimentConfig", "check_layout", "load_experiment", "train", "train_command"]

log = logging.getLogger(__name__)


@dataclass
class ExperimentConfig(Config):
    """Everything one training run is built from: pretraining, SFT, DPO or GRPO."""

    run_name: str
    """A name for the run (logs and the saved config); where it is saved is
    ``trainer.save_folder``."""
    model: TransformerConfig
    dataset: DatasetConfig
    """The training data; its ``_CLASS_`` says which kind (``numpy`` when absent): ``numpy``
    (``prepare-data`` tokens), ``sft`` (``prepare-data --sft``), ``preference_pairs``
    (``prepare-data --dpo``) or ``prompts`` (a prompt JSONL file)."""
    data_loader: NumpyDataLoaderConfig
    """Batching. ``global_batch_size`` counts tokens, except for preference pairs (pairs x 4 x
    sequence length: chosen and rejected, ids and labels) and prompts (prompts)."""
    train_module: TransformerTrainModuleConfig
    """What is trained, picked by its ``_CLASS_``: ``transformer`` (pretraining and SFT, the
    default), ``dpo``, ``grpo`` or ``two_stage_kl``."""
    trainer: TrainerConfig
    """Where the run is saved, how long it trains, and its callbacks (evaluation included)."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """Saved with the run so that ``olmolike generate`` decodes what the model writes; GRPO
    also decodes its completions with it (and encodes the prompts)."""
    init_seed: int = 12536
    """Seeds Python, NumPy and torch before the model is built: the same seed, the same run."""

    def validate(self) -> None:
        check_data(self.train_module, self.dataset, self.data_loader)
        self._check_expert_parallel()
        if not isinstance(self.dataset, NumpyDatasetConfig):
            return  # the others' lengths are in their files, checked when the data is built
        seq_len = self.dataset.sequence_length
        if seq_len > self.model.max_sequence_length:
            raise self._invalid(
                "dataset.sequence_length",
                f"{seq_len} is longer than the model's max_sequence_length "
                f"({self.model.max_sequence_length}); raise --model.max_sequence_length",
            )

    def _check_expert_parallel(self) -> None:
        """An expert-parallel degree the model's experts cannot be split by, refused before
        any process group or model exists (training would refuse it when sharding)."""
        degree = self.train_module.ep_config.degree if self.train_module.ep_config else 1
        if degree == 1:
            return
        moe = self.model.moe
        if moe is None:
            raise self._invalid(
                "train_module.ep_config",
                "expert parallelism splits the experts of a mixture of experts and the model "
                "has no MoE layer: set ep_config=null",
            )
        if moe.num_experts % degree:
            raise self._invalid(
                "train_module.ep_config.degree",
                f"the expert-parallel degree ({degree}) must divide num_experts "
                f"({moe.num_experts}): every rank holds the same number of experts",
            )


def load_experiment(path: str, overrides: list[str]) -> ExperimentConfig:
    """Read a YAML or JSON experiment file and apply dotted overrides.

    The file's own top-level ``_CLASS_`` (``__main__.ExperimentConfig`` in the example's
    ``--dry-run`` output) is not needed: the file is read as an :class:`ExperimentConfig`.
    """
    try:
        text = io.read_bytes(path).decode()
    except FileNotFoundError:
        raise ConfigurationError(f"no config file at {path}") from None
    try:
        data = yaml.safe_load(text)  # JSON is YAML too
    except yaml.YAMLError as e:
        raise ConfigurationError(f"{path} is not valid YAML or JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigurationError(f"{path} must hold a mapping at the top level")
    data.pop(Config.CLASS_NAME_FIELD, None)
    for previous, item in zip([None, *overrides], overrides, strict=False):
        check_separated_value(previous, item)
    # Overrides first, then one check: they can mend a file that is wrong on its own (a
    # train module's class and its dataset's changed together).
    return ExperimentConfig.from_dict(data, overrides)


def check_layout(
    config: ExperimentConfig, world_size: int, local_world_size: int | None = None
) -> ParallelDegrees:
    """The run's parallel degrees on ``world_size`` ranks (``local_world_size`` per node),
    after every check of the layout that needs no process group: the degrees against the
    world size (HSDP's replica groups too), tensor parallelism against the model's
    dimensions, a pipeline's stages against its layers. ``olmolike train --nproc-per-node``
    runs it before it starts any rank, so a layout the ranks cannot run is one line and no
    process at all."""
    degrees = config.train_module.parallel_degrees(world_size, local_world_size=local_world_size)
    if degrees.tp > 1:
        check_tensor_parallel_degree(config.model, degrees.tp)
    if degrees.pp > 1:
        check_pipeline(config.train_module, config.model, degrees.tp)
    return degrees


def train(config: ExperimentConfig, rewards: RewardRegistry | None = None) -> Trainer:
    """Build the run's parts in the examples' order and train; returns the trainer.

    ``rewards``: a script's own reward functions for GRPO; without it the config's reward names
    are looked up in the installed ``olmolike.rewards`` entry points.
    """
    # First what is most likely wrong (a reward name, a missing folder), before the model.
    registry = load_rewards(config.train_module, rewards)
    degrees = check_layout(config, get_world_size())
    data_loader = build_data_loader(config.dataset, config.data_loader, config.model, degrees)
    _check_ids_within_tokenizer(data_loader, config.tokenizer)
    # Built on the meta device: the train module shards it (if asked), then materialises it.
    model = config.model.build(init_device="meta")
    train_module = build_train_module(config.train_module, model, config.tokenizer, registry)
    saver = ConfigSaverCallback(config=config.as_config_dict())  # for generate, evaluate
    trainer = config.trainer.with_callback("config_saver", saver).build(train_module, data_loader)
    kind = kind_of(config.train_module, config.dataset)
    active = config.model.num_active_params()
    log.info(
        "%s (%s): %s parameters%s, %s %s per step, %s steps",
        config.run_name,
        kind,
        f"{config.model.num_params():,d}",
        f" ({active:,d} active per token)" if config.model.moe is not None else "",
        f"{trainer.global_batch_size:,d}",
        "prompts" if kind == "GRPO" else "tokens",
        trainer.max_steps,
    )
    trainer.fit()
    return trainer


def _check_ids_within_tokenizer(data_loader: object, tokenizer: TokenizerConfig) -> None:
    """Token ids the experiment's tokenizer has no token for (data prepared with another
    one) are refused like ids beyond the model's vocabulary: at build where the data's
    metadata records its largest id, else as each instance is read, before any step."""
    check = getattr(getattr(data_loader, "dataset", None), "check_token_ids_below", None)
    if check is not None:
        vocab_size = tokenizer.resolve().vocab_size
        assert vocab_size is not None
        check(
            vocab_size,
            "the tokenizer's vocabulary size",
            f"the data was prepared with another tokenizer than this experiment's "
            f"({tokenizer.identifier!r}): set --tokenizer.identifier to the one that prepared it",
        )


def train_command(args: argparse.Namespace) -> int:
    """``olmolike train`` (its arguments: :mod:`olmolike.cli_args`)."""
    from .train import prepare_training_environment, teardown_training_environment
    from .utils import seed_all

    if args.nproc_per_node is not None or args.max_restarts is not None:
        return _launch(args)
    # First: a mistake in the file or the overrides is then one line, once per job.
    prepare_training_environment()
    try:
        overrides = [o for o in args.overrides if o != "--dry-run"]
        config = load_experiment(args.config, overrides)
        if args.dry_run or len(overrides) < len(args.overrides):
            if get_rank() == 0:
                print(config.to_yaml(), end="")
            return 0
        seed_all(config.init_seed)
        train(config)
    finally:
        teardown_training_environment()
    return 0


def _launch(args: argparse.Namespace) -> int:
    """``--nproc-per-node``: this process starts the ranks (see :mod:`olmolike.launch`)."""
    from .distributed.failure import frozen_rank_timeout
    from .distributed.utils import launched_distributed
    from .launch import launch

    nproc = 1 if args.nproc_per_node is None else args.nproc_per_node
    if nproc < 1:
        raise ConfigurationError(f"--nproc-per-node must be >= 1, got {nproc}")
    restarts = args.max_restarts or 0
    if restarts < 0:
        raise ConfigurationError(f"--max-restarts must be >= 0, got {restarts}")
    if launched_distributed():
        option = "--nproc-per-node" if args.nproc_per_node is not None else "--max-restarts"
        raise ConfigurationError(
            f"{option} is olmolike's launcher's: under torchrun drop it (torchrun has its own "
            "--max-restarts), or drop torchrun"
        )
    # A mistake in the file, the overrides or the layout is one line here, before any rank
    # starts (each rank would say it, and tear the job's store down under the others).
    overrides = [o for o in args.overrides if o != "--dry-run"]
    check_layout(load_experiment(args.config, overrides), nproc, nproc)
    frozen_rank_timeout()  # the ranks' environment, this one's
    dry_run = ["--dry-run"] if args.dry_run else []
    argv = ["train", args.config, *dry_run, *args.overrides]
    return launch(nproc, argv, max_restarts=0 if args.dry_run else restarts)
