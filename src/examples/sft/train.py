"""Supervised fine-tuning of the ``make run`` base model: docstring -> function.

Usage::

    python src/examples/sft/train.py RUN_NAME [--dry-run] [--dotted.key=value ...]
    torchrun --nproc-per-node=2 src/examples/sft/train.py RUN_NAME [...]

The SFT data is made here from the Python standard library: for each short function with a
docstring, the user asks for the function by its signature and the docstring's first line,
and the assistant answers with the function's code (``data/sft-stdlib/functions.jsonl``).
``olmolike prepare-data --sft`` then renders it with the byte tokenizer's chat template, masks
everything but the answers, packs the examples and holds out 10% of them.

The run starts from the newest checkpoint of ``base`` (``runs/stdlib-demo``, which ``make
run`` trains), with a fresh optimizer, and prints the masked loss on the held-out answers
before (the base model) and after fine-tuning. Started again with the same run name, it
resumes from its newest checkpoint.
"""

from __future__ import annotations

import ast
import json
import logging
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import torch

from olmolike.config import Config
from olmolike.data import NumpyDataLoaderConfig, SFTDatasetConfig, prepare_sft_data
from olmolike.data.prepare import stdlib_python_files
from olmolike.distributed.utils import barrier, get_rank
from olmolike.exceptions import CheckpointError
from olmolike.inference import load_checkpoint_model
from olmolike.optim import AdamWConfig, CosWithWarmup
from olmolike.train import (
    Callback,
    Duration,
    TrainerConfig,
    prepare_training_environment,
    teardown_training_environment,
)
from olmolike.train.callbacks import (
    CheckpointerCallback,
    ConfigSaverCallback,
    ConsoleLoggerCallback,
    LMEvaluator,
    SFTEvaluatorCallbackConfig,
)
from olmolike.train.train_module import TransformerTrainModule, TransformerTrainModuleConfig

log = logging.getLogger("sft")

DATA_DIR = "data/sft-stdlib"
SEQUENCE_LENGTH = 256
MAX_EXAMPLE_CHARS = 170
"""Prompt plus code: with the template's ~40 bytes, an example fits a 256-byte sequence."""


@dataclass
class SFTExperimentConfig(Config):
    """The whole run; saved as ``config.json`` beside the checkpoints."""

    run_name: str
    data_loader: NumpyDataLoaderConfig
    train_module: TransformerTrainModuleConfig
    trainer: TrainerConfig
    base: str = "runs/stdlib-demo"
    """The base model: a save folder (its newest checkpoint) or a step folder."""
    data_dir: str = DATA_DIR
    """Where the JSONL and the prepared sequences (``prepared/``) go."""
    packing: str = "packed"
    """``packed`` (several examples per sequence) or ``padded`` (one each)."""
    val_fraction: float = 0.1
    seed: int = 6198


def default_config(run_name: str) -> SFTExperimentConfig:
    """150 steps of 16 sequences: a few CPU minutes."""
    return SFTExperimentConfig(
        run_name=run_name,
        data_loader=NumpyDataLoaderConfig(global_batch_size=16 * SEQUENCE_LENGTH, seed=0),
        train_module=TransformerTrainModuleConfig(
            rank_microbatch_size=8 * SEQUENCE_LENGTH,
            optim=AdamWConfig(lr=1e-3, weight_decay=0.0, betas=(0.9, 0.95)),
            scheduler=CosWithWarmup(warmup=10, alpha_f=0.1),
            max_grad_norm=1.0,
        ),
        trainer=TrainerConfig(
            save_folder=f"runs/{run_name}",
            max_duration=Duration.steps(150),
            metrics_collect_interval=10,
            callbacks={
                "checkpointer": CheckpointerCallback(
                    save_interval=50, ephemeral_save_interval=None
                ),
                "console_logger": ConsoleLoggerCallback(log_interval=25),
                # Its eval_dataset is set to the val split of data_dir/prepared by train().
                "sft_evaluator": SFTEvaluatorCallbackConfig(
                    eval_dataset=SFTDatasetConfig(f"{DATA_DIR}/prepared", split="val"),
                    eval_interval=50,
                    eval_batch_size=16,
                ),
            },
        ),
    )


# -- the data ----------------------------------------------------------------------------------


def function_examples(
    files: list[Path] | None = None, max_chars: int = MAX_EXAMPLE_CHARS
) -> list[dict[str, str]]:
    """Short standard-library functions with a docstring, as prompt/completion pairs: the
    prompt names the signature and the docstring's first line, the completion is the code
    (signature and body, the docstring left out)."""
    out = []
    for path in stdlib_python_files() if files is None else files:
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # a few test files are deliberately broken
        lines = text.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or len(node.body) < 2:
                continue
            doc = ast.get_docstring(node)
            signature = lines[node.lineno - 1]
            if not doc or not doc.strip() or not signature.rstrip().endswith(":"):
                continue  # no docstring, or a signature over several lines
            body = lines[node.body[1].lineno - 1 : node.end_lineno]
            code = textwrap.dedent("\n".join([signature, *body]))
            summary = doc.strip().splitlines()[0]
            prompt = f"Write {signature.strip()[4:-1]}: {summary}"
            if len(prompt) + len(code) <= max_chars:
                out.append({"prompt": prompt, "completion": code + "\n"})
    return out


def prepare(config: SFTExperimentConfig) -> Path:
    """Write the JSONL and prepare it (rank 0; the others wait). Both are skipped when done."""
    folder = Path(config.data_dir)
    if get_rank() == 0:
        source = folder / "functions.jsonl"
        if not source.exists():
            folder.mkdir(parents=True, exist_ok=True)
            examples = function_examples()
            tmp = source.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(e) + "\n" for e in examples))
            tmp.replace(source)
            log.info("Wrote %d docstring -> function examples to %s", len(examples), source)
        metadata = prepare_sft_data(
            [source],
            folder / "prepared",
            sequence_length=SEQUENCE_LENGTH,
            packing=config.packing,
            val_fraction=config.val_fraction,
            overlong="drop",
        )
        for split, stats in metadata["splits"].items():
            log.info(
                "%s: %d examples in %d sequences, padding %.1f%%",
                split, stats["examples"], stats["sequences"], 100 * stats["padding_fraction"],
            )  # fmt: skip
    barrier()
    return folder / "prepared"


# -- the run -----------------------------------------------------------------------------------


@dataclass
class HeldOutLoss(Callback):
    """Prints the masked held-out loss of the base model next to the fine-tuned one's."""

    before: float = float("nan")
    after: dict[int, float] = field(default_factory=dict)
    metric: str = "eval/sft/CE loss"

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if self.metric in metrics:
            self.after[step] = metrics[self.metric]

    def post_train(self) -> None:
        if get_rank() != 0 or not self.after:
            return
        print("masked loss on held-out completions (nats/byte):")
        print(f"  base model : {self.before:.4f}")
        for step, loss in sorted(self.after.items()):
            print(f"  step {step:>5d} : {loss:.4f}")
        final = self.after[max(self.after)]
        print(f"fine-tuned / base: {final / self.before:.3f}")


def load_base(config: SFTExperimentConfig) -> tuple[torch.nn.Module, dict[str, object]]:
    try:
        loaded = load_checkpoint_model(config.base)
    except CheckpointError as e:
        raise SystemExit(
            f"no base model at {config.base!r} ({e}).\nTrain it first with `make run` (a few "
            "CPU minutes), or pass --base=PATH to another olmolike run or checkpoint."
        ) from None
    return loaded.model.train(), loaded.config


def train(config: SFTExperimentConfig) -> None:
    data = prepare(config)
    model, base_config = load_base(config)
    train_module = config.train_module.build(model)
    dataset = SFTDatasetConfig(str(data)).build()
    data_loader = config.data_loader.build(dataset)
    summary = HeldOutLoss()
    saved = {**config.as_config_dict(), **{k: base_config[k] for k in ("model", "tokenizer")}}
    evaluator = config.trainer.callbacks.get("sft_evaluator")
    if isinstance(evaluator, SFTEvaluatorCallbackConfig):  # held out by prepare() above
        evaluator.eval_dataset = SFTDatasetConfig(str(data), split="val")
    trainer_config = config.trainer.with_callbacks(
        {"config_saver": ConfigSaverCallback(config=saved), "held_out_loss": summary}
    )
    trainer = trainer_config.build(train_module, data_loader)
    summary.before = base_loss(train_module, str(data), trainer.device)
    trainer.fit()


def base_loss(train_module: TransformerTrainModule, data: str, device: torch.device) -> float:
    """The masked held-out loss before any step (every rank joins: the model may be sharded)."""
    val = SFTDatasetConfig(data, split="val").build()
    evaluator = LMEvaluator("base", val, rank_batch_instances=16, device=device)
    return float(evaluator.evaluate(train_module)["CE loss"])


def main(argv: list[str]) -> None:
    if not argv or argv[0].startswith("-"):
        raise SystemExit(__doc__)
    overrides = [a for a in argv[1:] if a != "--dry-run"]
    config = default_config(argv[0]).merge(overrides)
    if "--dry-run" in argv:
        print(config.to_yaml(), end="")
        return
    prepare_training_environment(seed=config.seed)
    try:
        train(config)
    finally:
        teardown_training_environment()


if __name__ == "__main__":
    main(sys.argv[1:])
