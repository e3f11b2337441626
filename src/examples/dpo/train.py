"""DPO on preference pairs built from the standard library: true continuation vs corrupted.

Usage::

    python src/examples/dpo/train.py [RUN_NAME] [--dry-run] [--dotted.key=value ...]
    torchrun --nproc-per-node=2 src/examples/dpo/train.py [RUN_NAME] [...]

Each pair's prompt is 48 bytes of a stdlib ``.py`` file; the chosen response is the true next
24 bytes, the rejected one the same bytes shuffled. The pairs are written as preference JSONL
(``runs/RUN_NAME/pairs.jsonl``: ``{"prompt", "chosen", "rejected"}`` per line) and prepared the
way any dataset is, as ``olmolike prepare-data --dpo pairs.jsonl -o runs/RUN_NAME/pairs
--sequence-length 80 --val-fraction 0.2`` would: the training rows and a held-out split (about
``held_out_pairs`` of them: the split is a hash of each line). Starting from a briefly
pretrained policy
(which is also the frozen reference), DPO raises held-out preference accuracy (the fraction of
pairs whose implicit reward margin is positive; ties count half) from ~0.5. The reference
scores the training pairs once, before the first step (``precompute_reference_logps``), so each
step runs the policy's forward only.

Everything comes from one :class:`DPOExperimentConfig`, e.g. ``--trainer.max_duration.value=
200 --train_module.beta=0.2 --train_module.loss_type=ipo``, or
``--train_module.reference=PATH`` for a reference other than the pretrained policy (an olmolike
checkpoint or a Hugging Face folder of the same architecture).
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from olmolike.config import Config
from olmolike.data import TokenTensorDataLoader
from olmolike.data.preference import PreferenceDataLoader, PreferencePair
from olmolike.data.preference_prepare import load_preference_rows, prepare_preference_data
from olmolike.data.sources import stdlib_python_files
from olmolike.data.tokenizer import ByteTokenizer
from olmolike.distributed.utils import barrier, get_rank, get_world_size
from olmolike.nn import TransformerConfig
from olmolike.optim import AdamWConfig
from olmolike.train import (
    Duration,
    TrainerConfig,
    prepare_training_environment,
    teardown_training_environment,
)
from olmolike.train.train_module import TransformerTrainModuleConfig
from olmolike.train.train_module.dpo import DPOTrainModuleConfig

PROMPT, RESPONSE, SEQ = 48, 24, 80
TOK = ByteTokenizer()


@dataclass
class DPOExperimentConfig(Config):
    """The whole run: the pairs, a short LM warm-up (the base model), then DPO."""

    run_name: str
    """Names the save folder (``runs/RUN_NAME``) and the run in logs."""
    model: TransformerConfig
    """The policy (and so the reference): a pair's side must fit its ``max_sequence_length``."""
    train_module: DPOTrainModuleConfig
    """The DPO loss, its reference and the optimizer: what the example is about."""
    trainer: TrainerConfig
    """``max_duration`` is the number of DPO steps (the warm-up has its own)."""
    pairs_per_batch: int = 16
    """Preference pairs per optimizer step, over all ranks (each pair is two sequences)."""
    train_pairs: int = 1024
    """Distinct pairs DPO trains on, about (and the reference scores once, when precomputing)."""
    held_out_pairs: int = 256
    """Pairs the policy never trains on, about: their preference accuracy is the example's
    figure. The prepared validation split holds each pair with probability
    ``held_out_pairs / (train_pairs + held_out_pairs)``."""
    pretrain_steps: int = 60
    """LM steps on the prompts + true continuations before DPO, so the policy starts as a
    model of the data rather than at random; 0 skips it (e.g. with
    ``train_module.init_weights``, which replaces the weights when DPO starts)."""
    pretrain_lr: float = 3e-3
    """The warm-up's learning rate: higher than DPO's, as it starts from random weights."""

    def validate(self) -> None:
        if self.model.max_sequence_length < SEQ:
            raise self._invalid(
                "model.max_sequence_length",
                f"is {self.model.max_sequence_length} but a pair's side is {SEQ} tokens; "
                f"raise it to at least {SEQ}",
            )
        for name in ("pairs_per_batch", "train_pairs", "held_out_pairs"):
            if getattr(self, name) <= 0:
                raise self._invalid(name, f"must be positive, got {getattr(self, name)}")
        if self.pretrain_steps < 0:
            raise self._invalid("pretrain_steps", f"must be >= 0, got {self.pretrain_steps}")
        if self.pretrain_steps and self.train_module.init_weights is not None:
            raise self._invalid(
                "pretrain_steps",
                "is wasted: train_module.init_weights replaces the pretrained weights when DPO "
                "starts; set --pretrain_steps=0",
            )


def default_config(run_name: str) -> DPOExperimentConfig:
    """60 LM steps, then 120 DPO steps of 16 pairs: under a CPU minute."""
    return DPOExperimentConfig(
        run_name=run_name,
        model=TransformerConfig(
            vocab_size=TOK.vocab_size, d_model=64, n_layers=2, n_heads=4, max_sequence_length=SEQ
        ),
        train_module=DPOTrainModuleConfig(
            rank_microbatch_size=16 // get_world_size() * SEQ,
            optim=AdamWConfig(lr=1e-3),
            max_grad_norm=1.0,
            beta=0.1,
            precompute_reference_logps=True,
        ),
        trainer=TrainerConfig(
            save_folder=f"runs/{run_name}",
            max_duration=Duration.steps(120),
            no_checkpoints=True,
            device="cpu",
            metrics_collect_interval=20,
        ),
    )


def make_pairs(count: int, seed: int) -> list[PreferencePair]:
    rng = random.Random(seed)
    files = stdlib_python_files()
    pairs: list[PreferencePair] = []
    while len(pairs) < count:
        text = files[rng.randrange(len(files))].read_text(errors="replace")
        if len(text) < PROMPT + RESPONSE + 1:
            continue
        start = rng.randrange(len(text) - PROMPT - RESPONSE)
        prompt, chosen = (
            text[start : start + PROMPT],
            text[start + PROMPT : start + PROMPT + RESPONSE],
        )
        rejected = "".join(rng.sample(chosen, len(chosen)))
        if rejected != chosen and (prompt + chosen).isascii():
            pairs.append(PreferencePair(prompt, chosen, rejected, f"pair {len(pairs)}"))
    return pairs


def pretrain(config: DPOExperimentConfig, model: torch.nn.Module, rows: torch.Tensor) -> None:
    """A short LM warm-up on the prompts + true continuations (the 'base model')."""
    module_config = TransformerTrainModuleConfig(
        rank_microbatch_size=config.pairs_per_batch // get_world_size() * SEQ,
        optim=AdamWConfig(lr=config.pretrain_lr),
    )
    loader = TokenTensorDataLoader(rows, global_batch_size=config.pairs_per_batch * SEQ, seed=0)
    TrainerConfig(
        save_folder=f"{config.trainer.save_folder}/pretrain",
        max_duration=Duration.steps(config.pretrain_steps),
        no_checkpoints=True,
        save_overwrite=True,
        device=config.trainer.device,
    ).build(module_config.build(model), loader).fit()


def accuracy(module: object, rows: torch.Tensor) -> float:
    c_ids, c_labels, r_ids, r_labels = rows.chunk(4, dim=1)
    batch = {"input_ids": torch.cat([c_ids, r_ids]), "labels": torch.cat([c_labels, r_labels])}
    return float(module.preference_accuracy(batch))  # type: ignore[attr-defined]


def prepare_pairs(config: DPOExperimentConfig) -> Path:
    """Write the pairs as preference JSONL and prepare them as ``prepare-data --dpo`` does."""
    folder = Path(config.trainer.save_folder)
    total = config.train_pairs + config.held_out_pairs
    if get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        records = (
            json.dumps({"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected})
            for p in make_pairs(total, seed=1)
        )
        (folder / "pairs.jsonl").write_text("\n".join(records) + "\n")
        prepare_preference_data(
            [folder / "pairs.jsonl"],
            folder / "pairs",
            sequence_length=SEQ,
            val_fraction=config.held_out_pairs / total,
            overwrite=True,
        )
    barrier()
    return folder / "pairs"


def train(config: DPOExperimentConfig) -> None:
    torch.manual_seed(0)
    pairs = prepare_pairs(config)
    train_rows = load_preference_rows(pairs, "train").long()
    held_out = load_preference_rows(pairs, "val").long()
    model = config.model.build(seed=0)
    if config.pretrain_steps:
        pretrain(config, model, train_rows[:, :SEQ].contiguous())
    module = config.train_module.build(model, reference_source="pretrained policy (step 0)")
    before = accuracy(module, held_out)
    loader = PreferenceDataLoader(
        train_rows, global_batch_size=config.pairs_per_batch * 4 * SEQ, seed=0
    )
    config.trainer.build(module, loader).fit()
    after = accuracy(module, held_out)
    steps = config.trainer.max_duration.value
    if get_rank() == 0:
        print(f"held-out preference accuracy (implicit reward margin > 0): "
              f"before DPO {before:.3f}  after {steps} DPO steps {after:.3f}")  # fmt: skip


def main(argv: list[str]) -> None:
    prepare_training_environment(seed=0)
    try:
        named = bool(argv) and not argv[0].startswith("-")
        run_name = argv[0] if named else "dpo-demo"
        overrides = [a for a in argv[int(named) :] if a != "--dry-run"]
        config = default_config(run_name).merge(overrides)
        if "--dry-run" in argv:
            if get_rank() == 0:
                print(config.to_yaml(), end="")
            return
        train(config)
    finally:
        teardown_training_environment()


if __name__ == "__main__":
    main(sys.argv[1:])
