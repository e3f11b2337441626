"""Train a transformer language model on prepared token data.

Usage::

    python src/examples/train_lm/train.py RUN_NAME [--dry-run] [--dotted.key=value ...]
    torchrun --nproc-per-node=2 src/examples/train_lm/train.py RUN_NAME [...]

Everything comes from one :class:`ExperimentConfig`; any field can be overridden, e.g.
``--trainer.max_duration.value=500 --train_module.optim.lr=1e-3 --model.n_layers=6``.
The data defaults to ``data/stdlib`` (``make run`` prepares it from the Python standard
library with ``olmolike prepare-data --stdlib``); point ``--dataset.paths`` elsewhere for your
own. Started again with the same run name, it resumes from the newest checkpoint.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field

import numpy as np

from olmolike.config import Config
from olmolike.data.numpy_data_loader import NumpyDataLoaderConfig
from olmolike.data.numpy_dataset import NumpyDatasetConfig, NumpyFSLDataset
from olmolike.data.tokenizer import TokenizerConfig
from olmolike.distributed.utils import get_rank
from olmolike.nn import TransformerConfig
from olmolike.optim import AdamWConfig, CosWithWarmup
from olmolike.train import (
    Duration,
    TrainerConfig,
    prepare_training_environment,
    teardown_training_environment,
)
from olmolike.train.callbacks import (
    Callback,
    CheckpointerCallback,
    ConfigSaverCallback,
    ConsoleLoggerCallback,
    LMEvaluatorCallbackConfig,
    MetricSaverCallback,
    ProgressCallback,
    SpeedMonitorCallback,
)
from olmolike.train.train_module import TransformerTrainModuleConfig
from olmolike.utils import seed_all

log = logging.getLogger("train_lm")

DATA_DIR = "data/stdlib"
SEQUENCE_LENGTH = 256


@dataclass
class ExperimentConfig(Config):
    """The whole run; saved as ``config.json`` in the save folder."""

    run_name: str
    tokenizer: TokenizerConfig
    model: TransformerConfig
    dataset: NumpyDatasetConfig
    data_loader: NumpyDataLoaderConfig
    train_module: TransformerTrainModuleConfig
    trainer: TrainerConfig
    init_seed: int = 12536

    def validate(self) -> None:
        seq_len = self.dataset.sequence_length
        if seq_len > self.model.max_sequence_length:
            raise self._invalid(
                "dataset.sequence_length",
                f"{seq_len} is longer than the model's max_sequence_length "
                f"({self.model.max_sequence_length}); raise --model.max_sequence_length",
            )
        eval_dataset = _eval_dataset(self)
        if eval_dataset is not None and eval_dataset.sequence_length != seq_len:
            raise self._invalid(
                "trainer.callbacks.lm_evaluator.eval_dataset.sequence_length",
                f"is {eval_dataset.sequence_length} but the training data uses {seq_len}; "
                "set both to the same length",
            )


def default_config(run_name: str) -> ExperimentConfig:
    """A small model that learns Python's byte statistics in a few CPU minutes."""
    tokenizer = TokenizerConfig()
    return ExperimentConfig(
        run_name=run_name,
        tokenizer=tokenizer,
        model=TransformerConfig.tiny(
            tokenizer.padded_vocab_size(), max_sequence_length=SEQUENCE_LENGTH
        ),
        dataset=NumpyDatasetConfig(
            paths=[f"{DATA_DIR}/train"], sequence_length=SEQUENCE_LENGTH, seed=0
        ),
        data_loader=NumpyDataLoaderConfig(global_batch_size=16 * SEQUENCE_LENGTH, seed=0),
        train_module=TransformerTrainModuleConfig(
            rank_microbatch_size=16 * SEQUENCE_LENGTH,
            optim=AdamWConfig(lr=4e-3, weight_decay=0.1, betas=(0.9, 0.95)),
            scheduler=CosWithWarmup(warmup=40, alpha_f=0.1),
            max_grad_norm=1.0,
        ),
        trainer=TrainerConfig(
            save_folder=f"runs/{run_name}",
            max_duration=Duration.steps(400),
            metrics_collect_interval=10,
            callbacks={
                "checkpointer": CheckpointerCallback(save_interval=100, ephemeral_save_interval=25),
                "console_logger": ConsoleLoggerCallback(log_interval=50),
                "speed_monitor": SpeedMonitorCallback(),  # tokens/s in the log lines
                "progress": ProgressCallback(),  # a live bar, when stdout is a terminal
                "metric_saver": MetricSaverCallback(),  # runs/<name>/metrics.jsonl, to plot
                "lm_evaluator": LMEvaluatorCallbackConfig(
                    eval_dataset=NumpyDatasetConfig(
                        paths=[f"{DATA_DIR}/val"], sequence_length=SEQUENCE_LENGTH
                    ),
                    eval_interval=50,
                    eval_batch_size=16,
                    max_batches=8,
                ),
            },
        ),
    )


@dataclass
class ValidationSummary(Callback):
    """Keeps the validation losses, to print their trajectory next to a baseline at the end."""

    eval_dataset: NumpyDatasetConfig | None = None
    metric: str = "eval/lm/CE loss"
    losses: dict[int, float] = field(default_factory=dict)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if self.metric in metrics:
            self.losses[step] = metrics[self.metric]

    def post_train(self) -> None:
        if get_rank() != 0 or not self.losses or self.eval_dataset is None:
            return
        train_dataset = self.trainer.data_loader.dataset  # type: ignore[attr-defined]
        vocab = self.trainer.train_module.model.config.vocab_size  # type: ignore[attr-defined]
        baseline = unigram_cross_entropy(train_dataset, self.eval_dataset.build(), vocab)
        lines = [f"  step {step:>6d}: {loss:.4f}" for step, loss in sorted(self.losses.items())]
        print("validation loss (nats/token):\n" + "\n".join(lines))
        final = self.losses[max(self.losses)]
        print(f"unigram baseline of the data: {baseline:.4f} nats/token")
        print(f"final validation loss / unigram baseline: {final / baseline:.3f}")


def token_counts(dataset: NumpyFSLDataset, vocab: int) -> np.ndarray:
    counts = np.zeros(vocab, dtype=np.float64)
    for index in range(len(dataset)):
        counts += np.bincount(dataset.instance_tokens(index), minlength=vocab)
    return counts


def unigram_cross_entropy(train: NumpyFSLDataset, val: NumpyFSLDataset, vocab: int) -> float:
    """Cross-entropy of the validation tokens under the training data's token frequencies.

    What a model that ignores context entirely would score: the bar a language model must beat.
    """
    train_counts = token_counts(train, vocab) + 1  # add-one smoothing: unseen tokens stay finite
    log_probs = np.log(train_counts / train_counts.sum())
    val_counts = token_counts(val, vocab)
    return float(-(val_counts * log_probs).sum() / val_counts.sum())


def build_config(argv: list[str]) -> tuple[ExperimentConfig, bool]:
    if not argv or argv[0].startswith("-"):
        raise SystemExit(__doc__)
    run_name, overrides = argv[0], argv[1:]
    dry_run = "--dry-run" in overrides
    overrides = [o for o in overrides if o != "--dry-run"]
    config = default_config(run_name).merge(overrides)
    return config, dry_run


def main(argv: list[str]) -> None:
    # First: a mistake in the overrides is then one line on the console (once per job).
    prepare_training_environment()
    try:
        config, dry_run = build_config(argv)
        if dry_run:
            if get_rank() == 0:
                print(config.to_yaml(), end="")
            return
        seed_all(config.init_seed)
        train(config)
    finally:
        teardown_training_environment()


def train(config: ExperimentConfig) -> None:
    # Built on the meta device: the train module shards it (if asked) and then materialises it.
    model = config.model.build(init_device="meta")
    train_module = config.train_module.build(model)
    dataset = config.dataset.build()
    data_loader = config.data_loader.build(dataset)
    trainer_config = config.trainer.with_callbacks(
        {
            "config_saver": ConfigSaverCallback(config=config.as_config_dict()),
            "validation_summary": ValidationSummary(eval_dataset=_eval_dataset(config)),
        }
    )
    trainer = trainer_config.build(train_module, data_loader)
    log.info(
        "%s: %s parameters (%s without embeddings), %s tokens per step, %s steps",
        config.run_name,
        f"{config.model.num_params():,d}",
        f"{config.model.num_non_embedding_params():,d}",
        f"{trainer.global_batch_size:,d}",
        trainer.max_steps,
    )
    trainer.fit()


def _eval_dataset(config: ExperimentConfig) -> NumpyDatasetConfig | None:
    evaluator = config.trainer.callbacks.get("lm_evaluator")
    return evaluator.eval_dataset if isinstance(evaluator, LMEvaluatorCallbackConfig) else None


if __name__ == "__main__":
    main(sys.argv[1:])
