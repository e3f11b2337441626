"""Two-stage training: does a KL penalty to the stage-1 snapshot limit forgetting?

Usage::

    python src/examples/two_stage_kl/train.py [RUN_NAME] [--dry-run] [--dotted.key=value ...]
    torchrun --nproc-per-node=2 src/examples/two_stage_kl/train.py [RUN_NAME] [...]

Stage 1 trains a byte model on standard-library code; stage 2 switches to a different mixture
(the same kind of code, *reversed*). With ``beta = 0`` stage 2 is plain fine-tuning and the
stage-1 held-out loss degrades; with ``beta > 0`` the exact KL to the snapshot taken at the
boundary holds the model closer to what it knew. The example runs both (``beta = 0`` first,
unless ``--compare_with_beta_zero=false``) and prints their figures.

Everything comes from one :class:`TwoStageExperimentConfig`. Each stage has its own data and
duration (``data_loader.stages``, a :class:`~olmolike.data.StagedDataLoaderConfig`): stage 1's
length must equal ``train_module.stage1_steps`` and both stages together the trainer's
``max_duration``, e.g. for 100 + 100 steps::

    --data_loader.stages.stage1.steps=100 --data_loader.stages.stage2.steps=100 \\
    --train_module.stage1_steps=100 --trainer.max_duration.value=200

One LR schedule spans both stages: the seed trainer's warmup-stable-decay, warming up over the
first 1% of both stages' steps and decaying over the last 10%. The demo's data (64-byte
chunks) is written once to ``data/two-stage-kl``; point the stages' ``dataset.paths``
elsewhere for your own. Each run trains stage 1 to a checkpoint, then resumes from it for
stage 2, and starts afresh in ``runs/RUN_NAME/beta=B``.
"""

from __future__ import annotations

import logging
import random
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from olmolike.config import Config
from olmolike.data import (
    DataStageConfig,
    NumpyDataLoaderConfig,
    NumpyDatasetConfig,
    StagedDataLoaderConfig,
)
from olmolike.data.sources import stdlib_python_files
from olmolike.data.tokenizer import ByteTokenizer
from olmolike.distributed.utils import barrier, get_rank, get_world_size
from olmolike.nn import TransformerConfig
from olmolike.optim import WSD, AdamWConfig
from olmolike.train import (
    Callback,
    Duration,
    TrainerConfig,
    prepare_training_environment,
    teardown_training_environment,
)
from olmolike.train.train_module.two_stage_kl import TwoStageKLTrainModuleConfig

log = logging.getLogger("two_stage_kl")

SEQ, BATCH, STAGE_STEPS = 64, 16, 60
DATA_DIR = "data/two-stage-kl"
TOK = ByteTokenizer()


@dataclass
class TwoStageExperimentConfig(Config):
    """The comparison: the same two-stage run with ``beta = 0`` and with ``train_module.beta``."""

    run_name: str
    """Names the save folder (``runs/RUN_NAME``, one subfolder per beta)."""
    model: TransformerConfig
    """Every sequence (each stage's and the held-out) must fit its ``max_sequence_length``."""
    data_loader: StagedDataLoaderConfig
    """Each stage's data and length: stage 1's must be ``train_module.stage1_steps``."""
    held_out: NumpyDatasetConfig
    """Stage-1-like data no stage trains on: its loss after each stage measures forgetting."""
    train_module: TwoStageKLTrainModuleConfig
    """Where the snapshot is taken (``stage1_steps``) and the KL's weight (``beta``)."""
    trainer: TrainerConfig
    """``max_duration`` spans both stages, so one LR schedule does."""
    compare_with_beta_zero: bool = True
    """Also run with ``beta = 0`` first: the forgetting that the KL penalty should reduce."""
    data_dir: str = DATA_DIR
    """Where the demo's data is written (once) and where the default stages read it."""

    def validate(self) -> None:
        steps = self.data_loader.stage_steps
        if len(steps) != 2:
            raise self._invalid(
                "data_loader.stages", f"needs two stages (stage 1, then stage 2), got {len(steps)}"
            )
        if steps[0] != self.train_module.stage1_steps:
            raise self._invalid(
                "train_module.stage1_steps",
                f"is {self.train_module.stage1_steps} but data stage 1 lasts {steps[0]} steps; "
                f"set --train_module.stage1_steps={steps[0]} so the snapshot is taken where the "
                "data changes",
            )
        duration, (first, second) = self.trainer.max_duration, steps
        if first is not None and second is not None and duration != Duration.steps(first + second):
            raise self._invalid(
                "trainer.max_duration",
                f"is {duration.value} {duration.unit} but the stages last {first} + {second} "
                f"steps; set --trainer.max_duration.value={first + second}",
            )
        for name, stage in [*self.data_loader.stages.items(), ("held_out", None)]:
            seq = (stage.dataset if stage else self.held_out).sequence_length
            if seq > self.model.max_sequence_length:
                field = f"data_loader.stages.{name}.dataset" if stage else "held_out"
                raise self._invalid(
                    f"{field}.sequence_length",
                    f"{seq} is longer than the model's max_sequence_length "
                    f"({self.model.max_sequence_length}); raise --model.max_sequence_length",
                )


def default_config(run_name: str) -> TwoStageExperimentConfig:
    """60 + 60 steps of 16 chunks of 64 bytes: ~2 CPU minutes a run."""

    def stage(name: str, seed: int) -> DataStageConfig:
        return DataStageConfig(
            dataset=NumpyDatasetConfig(
                paths=[f"{DATA_DIR}/{name}.npy"], sequence_length=SEQ, vocab_size=TOK.vocab_size
            ),
            data_loader=NumpyDataLoaderConfig(global_batch_size=BATCH * SEQ, seed=seed),
            steps=STAGE_STEPS,
        )

    return TwoStageExperimentConfig(
        run_name=run_name,
        model=TransformerConfig(
            vocab_size=TOK.vocab_size, d_model=64, n_layers=2, n_heads=4, max_sequence_length=SEQ
        ),
        data_loader=StagedDataLoaderConfig(
            stages={"stage1": stage("stage1", 1), "stage2": stage("stage2", 2)}
        ),
        held_out=NumpyDatasetConfig(
            paths=[f"{DATA_DIR}/held_out.npy"], sequence_length=SEQ, vocab_size=TOK.vocab_size
        ),
        train_module=TwoStageKLTrainModuleConfig(
            rank_microbatch_size=BATCH // get_world_size() * SEQ,
            optim=AdamWConfig(lr=3e-3),
            scheduler=WSD(warmup=None, warmup_fraction=0.01, decay_fraction=0.1),
            max_grad_norm=1.0,
            stage1_steps=STAGE_STEPS,
            beta=1.0,
        ),
        trainer=TrainerConfig(
            save_folder=f"runs/{run_name}",
            max_duration=Duration.steps(2 * STAGE_STEPS),
            device="cpu",
            metrics_collect_interval=10,
            save_overwrite=True,
        ),
    )


# -- the data ----------------------------------------------------------------------------------


def chunks(count: int, seed: int, reverse: bool) -> np.ndarray:
    """``count`` random 64-byte ASCII pieces of stdlib files (reversed for stage 2), as one
    flat token array: a dataset of ``sequence_length`` 64 reads them back one per instance."""
    rng = random.Random(seed)
    files = stdlib_python_files()
    rows: list[list[int]] = []
    while len(rows) < count:
        text = files[rng.randrange(len(files))].read_text(errors="replace")
        if len(text) <= SEQ or not text.isascii():
            continue
        start = rng.randrange(len(text) - SEQ)
        piece = text[start : start + SEQ]
        rows.append(TOK.encode(piece[::-1] if reverse else piece))
    return np.asarray(rows, dtype=np.uint16).reshape(-1)


def prepare(data_dir: str) -> None:
    """Write the demo's three token files (rank 0; the others wait); skipped when present."""
    folder = Path(data_dir)
    if get_rank() == 0 and not (folder / "held_out.npy").exists():
        folder.mkdir(parents=True, exist_ok=True)
        for name, count, seed, reverse in (
            ("stage1", STAGE_STEPS * BATCH, 1, False),
            ("stage2", STAGE_STEPS * BATCH, 2, True),
            ("held_out", 64, 3, False),
        ):
            np.save(folder / f"{name}.npy", chunks(count, seed, reverse))
        log.info("Wrote the demo's stage 1, stage 2 and held-out data to %s", folder)
    barrier()


# -- the runs ----------------------------------------------------------------------------------


@dataclass
class KLLog(Callback):
    """The last logged ``train/KL to snapshot`` (stage 2's drift from the snapshot)."""

    last: float = float("nan")

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.last = metrics.get("train/KL to snapshot", self.last)


def run(config: TwoStageExperimentConfig, beta: float) -> dict[str, float]:
    torch.manual_seed(0)
    held_out_data = config.held_out.build()
    held_out = torch.from_numpy(
        np.stack([held_out_data.instance_tokens(i) for i in range(len(held_out_data))])
    ).long()
    loader = config.data_loader.build()
    module = config.train_module.replace(beta=beta).build(config.model.build(seed=0))

    def held_out_loss() -> float:
        labels = torch.nn.functional.pad(held_out[:, 1:], (0, 1), value=-100)
        return float(module.eval_batch({"input_ids": held_out}, labels))

    folder = f"{config.trainer.save_folder}/beta={beta:g}"
    if get_rank() == 0:
        shutil.rmtree(folder, ignore_errors=True)  # each comparison run starts afresh
    barrier()
    stage1 = config.train_module.stage1_steps
    kl = KLLog()
    figures: dict[str, float] = {}
    # Stage 1 stops at the boundary (a checkpoint); stage 2 resumes from it.
    for stage, hard_stop in (("stage 1", Duration.steps(stage1)), ("stage 2", None)):
        trainer_config = config.trainer.replace(save_folder=folder, hard_stop=hard_stop)
        trainer_config.with_callbacks({"kl": kl}).build(module, loader).fit()
        figures[f"held-out stage-1 loss after {stage}"] = held_out_loss()
    figures["KL to snapshot, last logged step"] = kl.last
    return figures


def main(argv: list[str]) -> None:
    prepare_training_environment(seed=0)
    try:
        named = bool(argv) and not argv[0].startswith("-")
        run_name = argv[0] if named else "two-stage-kl-demo"
        overrides = [a for a in argv[int(named) :] if a != "--dry-run"]
        config = default_config(run_name).merge(overrides)
        if "--dry-run" in argv:
            if get_rank() == 0:
                print(config.to_yaml(), end="")
            return
        prepare(config.data_dir)
        betas = [0.0] if config.compare_with_beta_zero else []
        results = {b: run(config, b) for b in [*betas, config.train_module.beta]}
        if get_rank() == 0:
            for b, figures in results.items():
                after1, after2, kl = figures.values()
                print(f"beta={b:g}: held-out stage-1 loss {after1:.4f} after stage 1, "
                      f"{after2:.4f} after stage 2 ({after2 - after1:+.4f}); "
                      f"KL to snapshot at the last logged step {kl:.4f}")  # fmt: skip
    finally:
        teardown_training_environment()


if __name__ == "__main__":
    main(sys.argv[1:])
