"""Train a small mixture of experts on prepared token data and print how its experts are loaded.

Usage::

    python src/examples/moe/train.py RUN_NAME [--dry-run] [--dotted.key=value ...]
    torchrun --nproc-per-node=2 src/examples/moe/train.py RUN_NAME [...]

The model is ``moe_tiny``: OLMoE's blocks (pre-norm, QK-norm) at the size of the dense
``tiny`` preset, each MLP 8 experts of which every token takes 2 (top-2), with the same
active parameters per token as ``tiny``. It trains on ``data/stdlib`` (``make moe`` prepares
the standard library's Python files, as ``make run`` does) for a few CPU minutes, then prints
each layer's expert load over the last steps: the share of routed tokens each expert
received and the max/mean imbalance (1 is perfectly balanced). ``--model.moe.
load_balancing_loss_coefficient=0`` trains without the load-balancing loss, to see what it
does. The run's config is an ``olmolike train`` experiment file: ``--dry-run`` prints it.
Started again with the same run name, it resumes from the newest checkpoint.
"""

from __future__ import annotations

import logging
import sys

from olmolike.data.numpy_data_loader import NumpyDataLoaderConfig
from olmolike.data.numpy_dataset import NumpyDatasetConfig
from olmolike.data.tokenizer import TokenizerConfig
from olmolike.distributed.utils import get_rank
from olmolike.experiment import ExperimentConfig, train
from olmolike.nn import TransformerConfig
from olmolike.optim import AdamWConfig, CosWithWarmup
from olmolike.train import (
    Duration,
    Trainer,
    TrainerConfig,
    prepare_training_environment,
    teardown_training_environment,
)
from olmolike.train.callbacks import (
    CheckpointerCallback,
    ConsoleLoggerCallback,
    LMEvaluatorCallbackConfig,
    MetricSaverCallback,
    ProgressCallback,
    SpeedMonitorCallback,
)
from olmolike.train.callbacks.moe_load import MoELoadCallback
from olmolike.train.train_module import TransformerTrainModuleConfig
from olmolike.utils import seed_all

log = logging.getLogger("moe")

DATA_DIR = "data/stdlib"
SEQUENCE_LENGTH = 256
LOAD_STEPS = 20
"""The expert loads printed at the end are summed over this many last steps."""


def default_config(run_name: str) -> ExperimentConfig:
    tokenizer = TokenizerConfig()
    return ExperimentConfig(
        run_name=run_name,
        tokenizer=tokenizer,
        model=TransformerConfig.moe_tiny(
            tokenizer.padded_vocab_size(), max_sequence_length=SEQUENCE_LENGTH
        ),
        dataset=NumpyDatasetConfig(
            paths=[f"{DATA_DIR}/train"], sequence_length=SEQUENCE_LENGTH, seed=0
        ),
        data_loader=NumpyDataLoaderConfig(global_batch_size=8 * SEQUENCE_LENGTH, seed=0),
        train_module=TransformerTrainModuleConfig(
            rank_microbatch_size=8 * SEQUENCE_LENGTH,
            optim=AdamWConfig(lr=4e-3, weight_decay=0.1, betas=(0.9, 0.95)),
            scheduler=CosWithWarmup(warmup=20, alpha_f=0.1),
            max_grad_norm=1.0,
        ),
        trainer=TrainerConfig(
            save_folder=f"runs/{run_name}",
            max_duration=Duration.steps(200),
            metrics_collect_interval=LOAD_STEPS,
            callbacks={
                "checkpointer": CheckpointerCallback(save_interval=100, ephemeral_save_interval=25),
                "console_logger": ConsoleLoggerCallback(
                    log_interval=20, metrics=["train/*", "throughput/TPS"]
                ),
                "speed_monitor": SpeedMonitorCallback(),
                "progress": ProgressCallback(),
                "metric_saver": MetricSaverCallback(),  # runs/<name>/metrics.jsonl
                "moe_load": MoELoadCallback(),
                "lm_evaluator": LMEvaluatorCallbackConfig(
                    eval_dataset=NumpyDatasetConfig(
                        paths=[f"{DATA_DIR}/val"], sequence_length=SEQUENCE_LENGTH
                    ),
                    eval_interval=100,
                    eval_batch_size=16,
                    max_batches=4,
                ),
            },
        ),
    )


def load_table(loads: dict[int, list[float]]) -> str:
    """Each layer's share of routed tokens per expert (percent) and its max/mean imbalance."""
    if not loads:
        return "no expert loads were collected (train at least metrics_collect_interval steps)"
    experts = len(next(iter(loads.values())))
    head = "layer  " + " ".join(f"{f'e{e}':>5}" for e in range(experts)) + "  max/mean"
    lines = [head]
    for layer, counts in sorted(loads.items()):
        total = sum(counts) or 1.0
        shares = " ".join(f"{100 * c / total:5.1f}" for c in counts)
        lines.append(f"{layer:>5}  {shares}  {max(counts) / (total / len(counts)):8.3f}")
    return "\n".join(lines)


def report(trainer: Trainer) -> None:
    callback = next(c for c in trainer.callbacks.values() if isinstance(c, MoELoadCallback))
    if get_rank() == 0:
        print(
            f"expert load per layer over the last {trainer.metrics_collect_interval} steps "
            f"(% of routed tokens per expert):\n{load_table(callback.last_loads)}"
        )


def main(argv: list[str]) -> None:
    if not argv or argv[0].startswith("-"):
        raise SystemExit(__doc__)
    prepare_training_environment()
    try:
        overrides = [o for o in argv[1:] if o != "--dry-run"]
        config = default_config(argv[0]).merge(overrides)
        if len(overrides) < len(argv) - 1:
            if get_rank() == 0:
                print(config.to_yaml(), end="")
            return
        seed_all(config.init_seed)
        report(train(config))
    finally:
        teardown_training_environment()


if __name__ == "__main__":
    main(sys.argv[1:])
