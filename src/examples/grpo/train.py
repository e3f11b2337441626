"""GRPO on small sums, against the same compute spent on more supervised training.

The task is generated here: the 400 sums ``a+b`` of ``a, b`` in 0..19, as prompts ``"07+15="``
whose answer is ``"22"``. 300 of them are training prompts (``OUT/train.jsonl``, prompt JSONL
``{"prompt": "07+15=", "answer": "22"}``); the other 100 (``OUT/heldout.jsonl``) are never
trained on after the warm-up, and greedy exact-answer accuracy on them is the figure reported.

1. **Warm-up**: language modelling on documents of one to three sums joined by ``";"``
   (``"07+15=22;03+11=14<eos>"``), drawn from all 400 sums. The model learns the sums and the
   format, but after an answer it goes on with ``";"`` as often as it stops. So what is left
   to learn is to *stop*, not arithmetic: this demonstration measures how well each method
   teaches a behaviour the model can already produce.
2. From the same warm-up, two arms on the same 300 prompts, with the same number of tokens
   per step (generated plus trained; ``GRPO's`` reference-model forward is not counted):

   * **GRPO**: ``group_size`` samples per prompt, reward 1 for exactly the right sum ended by
     EOS (a completion that goes on earns nothing);
   * **SFT**: language modelling on the prompts with their right answers and EOS
     (``"07+15=22<eos>"``), rows of the same width as GRPO's.

Both accuracies go to ``OUT/accuracy.json`` (with the time of each phase and GRPO's first and
last rewards), GRPO's metrics to ``OUT/grpo/metrics.jsonl`` (for ``olmolike plot``), and the
run ends by printing the results as ``docs/grpo.md`` shows them (:mod:`grpo_results`). Every
setting is a dotted override, as for ``olmolike train``::

    python src/examples/grpo/train.py [OUT] [--trainer.max_duration.value=50] [--warm_up.steps=300]
        [--compare_with_sft=false] [--dry-run]
    torchrun --nproc-per-node=2 src/examples/grpo/train.py [OUT] [...]
"""

from __future__ import annotations

import contextlib
import copy
import json
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from grpo_results import render  # this folder's: the block docs/grpo.md shows

from olmolike.config import Config
from olmolike.data import TokenTensorDataLoader
from olmolike.data.prompts import PromptDataLoader, PromptRecord, read_prompt_jsonl
from olmolike.data.tokenizer import ByteTokenizer
from olmolike.distributed.utils import barrier, get_rank, get_world_size
from olmolike.nn import Transformer, TransformerConfig
from olmolike.nn.generation import sample
from olmolike.optim import AdamWConfig, ConstantWithWarmup
from olmolike.train import (
    Duration,
    DurationUnit,
    TrainerConfig,
    prepare_training_environment,
    teardown_training_environment,
)
from olmolike.train.callbacks import MetricSaverCallback
from olmolike.train.train_module import TransformerTrainModuleConfig
from olmolike.train.train_module.grpo import (
    GRPOLossConfig,
    GRPOTrainModuleConfig,
    RewardConfig,
    RewardRegistry,
    SamplingConfig,
)

TOK = ByteTokenizer()
SEQ = 32  # a warm-up document of three sums and its EOS fits
HELD_OUT = 100
PROMPT_TOKENS = 6  # "07+15="

rewards = RewardRegistry()


@rewards.reward("exact_answer")
def exact_answer(completions: list[str], answer: list[str], **_: Any) -> list[float]:
    """1 for exactly the right sum, ended by EOS (the completion holds nothing else), else 0."""
    return [float(c == a) for c, a in zip(completions, answer)]


@dataclass
class WarmUpConfig(Config):
    """The language-modelling warm-up both arms start from."""

    steps: int = 300
    lr: float = 3e-3
    batch: int = 64
    """Documents per step, over all ranks."""


@dataclass
class GRPODemoConfig(Config):
    """Everything the demonstration is built from; any field is a dotted override."""

    out: str
    """Where the task files, GRPO's metrics and ``accuracy.json`` go."""
    model: TransformerConfig = field(
        default_factory=lambda: TransformerConfig(
            vocab_size=TOK.vocab_size, d_model=64, n_layers=2, n_heads=4, max_sequence_length=SEQ
        )
    )
    warm_up: WarmUpConfig = field(default_factory=WarmUpConfig)
    prompts_per_step: int = 16
    """GRPO prompts per step, over all ranks."""
    train_module: GRPOTrainModuleConfig = field(
        default_factory=lambda: GRPOTrainModuleConfig(
            rank_microbatch_size=16 * 8 * SEQ,
            optim=AdamWConfig(lr=5e-4, weight_decay=0.0),
            scheduler=ConstantWithWarmup(warmup=10),
            max_grad_norm=1.0,
            loss=GRPOLossConfig(group_size=8, kl_coef=0.02),
            sampling=SamplingConfig(max_new_tokens=4),
            rewards=[RewardConfig("exact_answer")],
            num_iterations=2,
        )
    )
    trainer: TrainerConfig = field(
        default_factory=lambda: TrainerConfig(
            save_folder="grpo",
            max_duration=Duration.steps(300),
            no_checkpoints=True,
            metrics_collect_interval=10,
            callbacks={"metric_saver": MetricSaverCallback()},
        )
    )
    """GRPO's trainer; ``save_folder`` is under ``out``."""
    compare_with_sft: bool = True
    """Also train the supervised arm from the same warm-up with the same tokens per step."""

    def validate(self) -> None:
        if self.prompts_per_step % get_world_size():
            raise self._invalid("prompts_per_step", "must be a multiple of the number of ranks")
        if self.trainer.max_duration.unit != DurationUnit.steps:
            raise self._invalid(
                "trainer.max_duration.unit", "must be steps: the SFT arm trains as many steps"
            )

    def tokens_per_grpo_step(self) -> int:
        """Generated tokens plus tokens through a training forward and backward, per step."""
        rollouts = self.prompts_per_step * self.train_module.loss.group_size
        new = self.train_module.sampling.max_new_tokens
        return rollouts * new + rollouts * (PROMPT_TOKENS + new) * self.train_module.num_iterations


def write_task(out: Path) -> None:
    """Every sum, shuffled: the first HELD_OUT to heldout.jsonl, the rest to train.jsonl."""
    pairs = [(a, b) for a in range(20) for b in range(20)]
    random.Random(0).shuffle(pairs)
    records = [PromptRecord(f"{a:02d}+{b:02d}=", {"answer": str(a + b)}) for a, b in pairs]
    for name, part in (("heldout", records[:HELD_OUT]), ("train", records[HELD_OUT:])):
        lines = (json.dumps({"prompt": r.prompt, **r.fields}) for r in part)
        (out / f"{name}.jsonl").write_text("\n".join(lines) + "\n")


def rows_of(texts: list[str], width: int) -> torch.Tensor:
    """Each text and its EOS, padded with EOS to ``width`` tokens."""
    rows = torch.full((len(texts), width), TOK.eos_token_id, dtype=torch.long)
    for i, text in enumerate(texts):
        ids = TOK.encode(text)
        rows[i, : len(ids)] = torch.tensor(ids)
    return rows


def language_model(model: Transformer, rows: torch.Tensor, batch: int, lr: float, steps: int,
                   folder: Path) -> None:  # fmt: skip
    """Train ``model`` on ``rows`` (``batch`` of them per step, over all ranks)."""
    width = rows.shape[1]
    config = TransformerTrainModuleConfig(
        rank_microbatch_size=batch // get_world_size() * width, optim=AdamWConfig(lr=lr)
    )
    loader = TokenTensorDataLoader(rows, global_batch_size=batch * width, seed=0)
    TrainerConfig(
        save_folder=str(folder), max_duration=Duration.steps(steps), no_checkpoints=True,
        metrics_collect_interval=50,
    ).build(config.build(model), loader).fit()  # fmt: skip


def warm_up(model: Transformer, records: list[PromptRecord], config: GRPODemoConfig) -> None:
    """Documents of one to three sums joined by ";": a document ends after an answer as
    often as it goes on."""
    rng = random.Random(1)
    documents = [
        ";".join(r.prompt + r.fields["answer"] for r in rng.choices(records, k=rng.randint(1, 3)))
        for _ in range(20_000)
    ]
    steps, lr, batch = config.warm_up.steps, config.warm_up.lr, config.warm_up.batch
    language_model(model, rows_of(documents, SEQ), batch, lr, steps, Path(config.out) / "sft")


def supervised_arm(model: Transformer, records: list[PromptRecord], config: GRPODemoConfig) -> int:
    """The prompts with their right answers and EOS, as many tokens per step as GRPO's;
    returns the tokens per step."""
    width = PROMPT_TOKENS + config.train_module.sampling.max_new_tokens
    ranks = get_world_size()
    batch = max(ranks, config.tokens_per_grpo_step() // width // ranks * ranks)
    steps = config.trainer.max_duration.value
    rng = random.Random(2)
    texts = [r.prompt + r.fields["answer"] for r in records]
    epochs = [rng.sample(texts, len(texts)) for _ in range(-(-batch * steps // len(texts)))]
    rows = rows_of([t for epoch in epochs for t in epoch], width)
    lr = config.train_module.optim.lr
    language_model(model, rows, batch, lr, steps, Path(config.out) / "sft-arm")
    return batch * width


@torch.no_grad()
def accuracy(model: torch.nn.Module, records: list[PromptRecord]) -> float:
    """Greedy exact-answer accuracy (every rank computes it on its own replica)."""
    out = sample(
        model,
        [TOK.encode(r.prompt) for r in records],
        max_new_tokens=4,
        temperature=0,
        stop_token_ids=[TOK.eos_token_id],
        pad_token_id=TOK.pad_token_id,
        vocab_size=TOK.vocab_size,
    )
    answers = [TOK.decode(ids) for ids in out.completions()]
    return sum(exact_answer(answers, [r.fields["answer"] for r in records])) / len(records)


def grpo(model: Transformer, config: GRPODemoConfig) -> None:
    out = Path(config.out)
    module = config.train_module.build(model, tokenizer=TOK, registry=rewards)
    loader = PromptDataLoader(
        read_prompt_jsonl(out / "train.jsonl"),
        prompts_per_rank=config.prompts_per_step // get_world_size(),
        seed=0,
    )
    trainer = config.trainer.replace(save_folder=str(out / config.trainer.save_folder))
    trainer.build(module, loader).fit()


def run(config: GRPODemoConfig) -> None:
    folder = Path(config.out)
    if get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        write_task(folder)
    barrier()
    train, held_out = (read_prompt_jsonl(folder / f"{n}.jsonl") for n in ("train", "heldout"))
    model = config.model.build(seed=0)
    seconds: dict[str, float] = {}
    with timed(seconds, "warm-up"):
        warm_up(model, [*train, *held_out], config)
    before = accuracy(model, held_out)
    sft_model = copy.deepcopy(model) if config.compare_with_sft else None
    with timed(seconds, "GRPO"):
        grpo(model, config)
    result: dict[str, Any] = {
        "warm_up_steps": config.warm_up.steps,
        "steps": config.trainer.max_duration.value,
        "held_out": HELD_OUT,
        "threads": torch.get_num_threads(),
        "ranks": get_world_size(),
        "before": before,
        "grpo": accuracy(model, held_out),
        "grpo_tokens_per_step": config.tokens_per_grpo_step(),
    }
    if sft_model is not None:
        with timed(seconds, "SFT"):
            result["sft_tokens_per_step"] = supervised_arm(sft_model, train, config)
        result["sft"] = accuracy(sft_model, held_out)
    if get_rank() == 0:
        metrics = folder / config.trainer.save_folder / "metrics.jsonl"
        result.update(seconds=seconds, **first_and_last(metrics))
        (folder / "accuracy.json").write_text(json.dumps(result) + "\n")
        print(render(result))


@contextlib.contextmanager
def timed(seconds: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    seconds[name] = time.perf_counter() - start


def first_and_last(metrics: Path) -> dict[str, dict[str, float]]:
    """GRPO's mean reward and completion length at its first step and over its last 10."""
    records = [json.loads(line)["metrics"] for line in metrics.read_text().splitlines()]
    figures = {}
    for key, name in (("reward", "train/reward/mean"), ("completion_length",
                      "train/completion length/mean")):  # fmt: skip
        values = [r[name] for r in records if name in r]
        figures[key] = {"first": values[0], "last_10": sum(values[-10:]) / len(values[-10:])}
    return figures


def main(argv: list[str]) -> None:
    # First: a mistake in the overrides is then one line on the console (once per job).
    prepare_training_environment(seed=0)
    try:
        named = bool(argv) and not argv[0].startswith("-")
        out, overrides = (argv[0], argv[1:]) if named else ("runs/grpo-demo", argv)
        config = GRPODemoConfig(out=out).merge([o for o in overrides if o != "--dry-run"])
        if "--dry-run" in overrides:
            if get_rank() == 0:
                print(config.to_yaml(), end="")
            return
        run(config)
    finally:
        teardown_training_environment()


if __name__ == "__main__":
    main(sys.argv[1:])
