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

__all__ = ["ExperimentConfig", "add_train_command", "check_layout", "load_experiment", "train"]

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
        if not isinstance(self.dataset, NumpyDatasetConfig):
            return  # the others' lengths are in their files, checked when the data is built
        seq_len = self.dataset.sequence_length
        if seq_len > self.model.max_sequence_length:
            raise self._invalid(
                "dataset.sequence_length",
                f"{seq_len} is longer than the model's max_sequence_length "
                f"({self.model.max_sequence_length}); raise --model.max_sequence_length",
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
    # Built on the meta device: the train module shards it (if asked), then materialises it.
    model = config.model.build(init_device="meta")
    train_module = build_train_module(config.train_module, model, config.tokenizer, registry)
    saver = ConfigSaverCallback(config=config.as_config_dict())  # for generate, evaluate
    trainer = config.trainer.with_callback("config_saver", saver).build(train_module, data_loader)
    kind = kind_of(config.train_module, config.dataset)
    log.info(
        "%s (%s): %s parameters, %s %s per step, %s steps",
        config.run_name,
        kind,
        f"{config.model.num_params():,d}",
        f"{trainer.global_batch_size:,d}",
        "prompts" if kind == "GRPO" else "tokens",
        trainer.max_steps,
    )
    trainer.fit()
    return trainer


def _train_command(args: argparse.Namespace) -> int:
    from .train import prepare_training_environment, teardown_training_environment
    from .utils import seed_all

    if args.nproc_per_node is not None:
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

    if args.nproc_per_node < 1:
        raise ConfigurationError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
    if launched_distributed():
        raise ConfigurationError(
            "--nproc-per-node starts the ranks itself: drop it under torchrun (or drop torchrun)"
        )
    # A mistake in the file, the overrides or the layout is one line here, before any rank
    # starts (each rank would say it, and tear the job's store down under the others).
    overrides = [o for o in args.overrides if o != "--dry-run"]
    check_layout(load_experiment(args.config, overrides), args.nproc_per_node, args.nproc_per_node)
    frozen_rank_timeout()  # the ranks' environment, this one's
    dry_run = ["--dry-run"] if args.dry_run else []
    return launch(args.nproc_per_node, ["train", args.config, *dry_run, *args.overrides])


def add_train_command(cmd: argparse.ArgumentParser) -> None:
    """The arguments of ``olmolike train`` (its parser and help come from :mod:`olmolike.cli`)."""
    cmd.description = (
        "Train from an experiment config file: model, train_module, dataset, "
        "data_loader, trainer (the train_lm example's --dry-run prints one). The train "
        "module's _CLASS_ picks pretraining or SFT (transformer), dpo or grpo, and the "
        "dataset's _CLASS_ its data (numpy, sft, preference_pairs, prompts). GRPO's reward "
        "functions come from installed packages' olmolike.rewards entry points. Any field can "
        "be overridden: --trainer.max_duration.value=100."
    )
    cmd.add_argument(
        "--nproc-per-node",
        type=int,
        metavar="N",
        help="start N ranks on this machine (gloo on CPU, NCCL on GPUs) instead of one process, "
        "without torchrun; give it before the config file",
    )
    cmd.add_argument("config", help="the experiment config file (.yaml, .yml or .json)")
    cmd.add_argument(
        "--dry-run", action="store_true", help="print the config with the overrides; train nothing"
    )
    cmd.add_argument("overrides", nargs=argparse.REMAINDER, help="--dotted.key=value ...")
    cmd.set_defaults(run=_train_command)
