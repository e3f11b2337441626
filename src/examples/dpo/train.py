"""DPO on preference pairs built from the standard library: true continuation vs corrupted.

Each pair's prompt is 48 bytes of a stdlib ``.py`` file; the chosen response is the true next
24 bytes, the rejected one the same bytes shuffled. Starting from a briefly pretrained policy
(which is also the frozen reference), DPO raises held-out preference accuracy (the fraction of
pairs whose implicit reward margin is positive; ties count half) from ~0.5. The reference
scores the training pairs once, before the first step (``precompute_reference_logps``), so each
step runs the policy's forward only.

    python src/examples/dpo/train.py            # or: torchrun --nproc_per_node=2 ...
"""

from __future__ import annotations

import random
import sys
import tempfile

import torch

from olmolike.data import TokenTensorDataLoader
from olmolike.data.preference import PreferenceDataLoader, PreferencePair, encode_preference_pairs
from olmolike.data.sources import stdlib_python_files
from olmolike.data.tokenizer import ByteTokenizer
from olmolike.distributed.utils import broadcast_object, get_rank, get_world_size
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


def model_config() -> TransformerConfig:
    return TransformerConfig(
        vocab_size=TOK.vocab_size, d_model=64, n_layers=2, n_heads=4, max_sequence_length=SEQ
    )


def pretrain(model: torch.nn.Module, rows: torch.Tensor, steps: int) -> None:
    """A short LM warm-up on the prompts + true continuations (the 'base model')."""
    config = TransformerTrainModuleConfig(
        rank_microbatch_size=16 // get_world_size() * SEQ, optim=AdamWConfig(lr=3e-3)
    )
    loader = TokenTensorDataLoader(rows, global_batch_size=16 * SEQ, seed=0)
    folder = broadcast_object(tempfile.mkdtemp())
    TrainerConfig(
        save_folder=folder, max_duration=Duration.steps(steps), no_checkpoints=True, device="cpu"
    ).build(config.build(model), loader).fit()


def accuracy(module: object, rows: torch.Tensor) -> float:
    c_ids, c_labels, r_ids, r_labels = rows.chunk(4, dim=1)
    batch = {"input_ids": torch.cat([c_ids, r_ids]), "labels": torch.cat([c_labels, r_labels])}
    return float(module.preference_accuracy(batch))  # type: ignore[attr-defined]


def main(steps: int = 120, pretrain_steps: int = 60) -> None:
    prepare_training_environment(seed=0)
    torch.manual_seed(0)
    train_rows = encode_preference_pairs(make_pairs(1024, seed=1), TOK, SEQ)
    held_out = encode_preference_pairs(make_pairs(256, seed=2), TOK, SEQ)
    model = model_config().build(seed=0)
    pretrain(model, train_rows[:, :SEQ].contiguous(), pretrain_steps)
    config = DPOTrainModuleConfig(
        rank_microbatch_size=16 // get_world_size() * SEQ, optim=AdamWConfig(lr=1e-3),
        max_grad_norm=1.0, beta=0.1, precompute_reference_logps=True,
    )  # fmt: skip
    module = config.build(model, reference_source="pretrained policy (step 0)")
    before = accuracy(module, held_out)
    loader = PreferenceDataLoader(train_rows, global_batch_size=16 * 4 * SEQ, seed=0)
    folder = broadcast_object(tempfile.mkdtemp())
    TrainerConfig(
        save_folder=folder, max_duration=Duration.steps(steps), no_checkpoints=True,
        device="cpu", metrics_collect_interval=20,
    ).build(module, loader).fit()  # fmt: skip
    after = accuracy(module, held_out)
    if get_rank() == 0:
        print(f"held-out preference accuracy (implicit reward margin > 0): "
              f"before DPO {before:.3f}  after {steps} DPO steps {after:.3f}")  # fmt: skip
    teardown_training_environment()


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
