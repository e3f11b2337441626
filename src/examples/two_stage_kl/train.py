"""Two-stage training: does a KL penalty to the stage-1 snapshot limit forgetting?

Stage 1 trains a byte model on standard-library code; stage 2 switches to a different mixture
(the same kind of code, *reversed*). With ``beta = 0`` stage 2 is plain fine-tuning and the
stage-1 held-out loss degrades; with ``beta > 0`` the exact KL to the snapshot taken at the
boundary holds the model closer to what it knew. Both runs print their figures.

Each stage has its own data and duration: a ``StagedDataLoader`` serves stage 1's (shuffled)
loader for ``stage_steps`` steps, then stage 2's, and resumes exactly on either side of the
boundary; one LR schedule spans both stages: the seed trainer's warmup-stable-decay, warming up
over the first 1% of both stages' steps and decaying over the last 10%.

    python src/examples/two_stage_kl/train.py   # or: torchrun --nproc_per_node=2 ...
"""

from __future__ import annotations

import random
import sys
import tempfile
from dataclasses import dataclass

import torch

from olmolike.data import StagedDataLoader, TokenTensorDataLoader
from olmolike.data.sources import stdlib_python_files
from olmolike.data.tokenizer import ByteTokenizer
from olmolike.distributed.utils import broadcast_object, get_rank, get_world_size
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

SEQ, BATCH = 64, 16
TOK = ByteTokenizer()


def chunks(count: int, seed: int, reverse: bool) -> torch.Tensor:
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
    return torch.tensor(rows)


def run(beta: float, stage_steps: int) -> dict[str, float]:
    torch.manual_seed(0)
    stage1 = chunks(stage_steps * BATCH, seed=1, reverse=False)
    stage2 = chunks(stage_steps * BATCH, seed=2, reverse=True)
    held_out = chunks(64, seed=3, reverse=False)
    loader = StagedDataLoader([
        (TokenTensorDataLoader(stage1, global_batch_size=BATCH * SEQ, seed=1), stage_steps),
        (TokenTensorDataLoader(stage2, global_batch_size=BATCH * SEQ, seed=2), stage_steps),
    ])  # fmt: skip
    config = TwoStageKLTrainModuleConfig(
        rank_microbatch_size=BATCH // get_world_size() * SEQ, optim=AdamWConfig(lr=3e-3),
        scheduler=WSD(warmup=None, warmup_fraction=0.01, decay_fraction=0.1), max_grad_norm=1.0,
        stage1_steps=stage_steps, beta=beta,
    )  # fmt: skip
    model = TransformerConfig(
        vocab_size=TOK.vocab_size, d_model=64, n_layers=2, n_heads=4, max_sequence_length=SEQ
    ).build(seed=0)
    module = config.build(model)
    figures: dict[str, float] = {}

    def held_out_loss() -> float:
        labels = torch.nn.functional.pad(held_out[:, 1:], (0, 1), value=-100)
        return float(module.eval_batch({"input_ids": held_out}, labels))

    folder = broadcast_object(tempfile.mkdtemp())
    kl = KLLog()
    for stage, steps in (("stage 1", stage_steps), ("stage 2", 2 * stage_steps)):
        trainer = TrainerConfig(
            save_folder=folder, max_duration=Duration.steps(2 * stage_steps),
            hard_stop=Duration.steps(steps), device="cpu", metrics_collect_interval=10,
            save_overwrite=True, callbacks={"kl": kl},
        ).build(module, loader)  # fmt: skip
        trainer.fit()
        figures[f"held-out stage-1 loss after {stage}"] = held_out_loss()
    figures["KL to snapshot, last logged step"] = kl.last
    return figures


@dataclass
class KLLog(Callback):
    """The last logged ``train/KL to snapshot`` (stage 2's drift from the snapshot)."""

    last: float = float("nan")

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.last = metrics.get("train/KL to snapshot", self.last)


def main(stage_steps: int = 60, beta: float = 1.0) -> None:
    prepare_training_environment(seed=0)
    results = {b: run(b, stage_steps) for b in (0.0, beta)}
    if get_rank() == 0:
        for b, figures in results.items():
            after1, after2, kl = figures.values()
            print(f"beta={b:g}: held-out stage-1 loss {after1:.4f} after stage 1, "
                  f"{after2:.4f} after stage 2 ({after2 - after1:+.4f}); "
                  f"KL to snapshot at the last logged step {kl:.4f}")  # fmt: skip
    teardown_training_environment()


if __name__ == "__main__":
    main(*(float(a) if "." in a else int(a) for a in sys.argv[1:]))  # type: ignore[arg-type]
