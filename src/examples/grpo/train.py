"""GRPO on two-digit addition with an exact-answer reward, after a short SFT warm-up.

The task is generated here: prompts ``"07+45="`` whose answer is ``"052"`` (fixed widths: two
digits per operand, three for the sum), written as prompt JSONL (``{"prompt": "07+45=",
"answer": "052"}``) to ``OUT/train.jsonl`` and ``OUT/heldout.jsonl`` (300 sums that no training
stage sees). A small byte-level transformer is first trained briefly on the answers of whole
lines ``"07+45=052<eos>"`` (the SFT warm-up: it learns the answer format and some of the sums),
then GRPO samples ``group_size`` answers per prompt and rewards the exact answer, with partial
credit for the digits in the right place. Greedy accuracy on the held-out prompts is printed before and after GRPO;
the metrics go to ``OUT/grpo/metrics.jsonl`` for ``olmolike plot``.

    python src/examples/grpo/train.py [OUT] [GRPO_STEPS] [SFT_STEPS]
    torchrun --nproc-per-node=2 src/examples/grpo/train.py [OUT] [...]
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from olmolike.data import TokenTensorDataLoader
from olmolike.data.prompts import PromptDataLoader, PromptRecord, read_prompt_jsonl
from olmolike.data.tokenizer import ByteTokenizer
from olmolike.distributed.utils import barrier, get_rank, get_world_size
from olmolike.nn import Transformer, TransformerConfig
from olmolike.nn.generation import sample
from olmolike.optim import AdamWConfig, ConstantWithWarmup
from olmolike.train import (
    Duration,
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
SEQ = 12  # "99+99=198" + EOS fits
HELD_OUT = 300
PROMPTS_PER_STEP = 32  # over all ranks
GROUP = 8
EQUALS = TOK.encode("=")[0]

rewards = RewardRegistry()


@rewards.reward("exact_answer")
def exact_answer(completions: list[str], answer: list[str], **_: Any) -> list[float]:
    """1 for exactly the right sum (surrounding spaces ignored), else 0."""
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


@rewards.reward("digit_match")
def digit_match(completions: list[str], answer: list[str], **_: Any) -> list[float]:
    """Partial credit: the share of the answer's digits in the right place (a longer
    completion is penalised by the length it is divided by). Denser than the exact answer."""
    return [
        sum(x == y for x, y in zip(c.strip(), a)) / max(len(c.strip()), len(a))
        for c, a in zip(completions, answer)
    ]


def write_task(out: Path) -> None:
    """All pairs 0..99 + 0..99, shuffled: the first HELD_OUT held out, the rest for training."""
    pairs = [(a, b) for a in range(100) for b in range(100)]
    random.Random(0).shuffle(pairs)
    for name, part in (("heldout", pairs[:HELD_OUT]), ("train", pairs[HELD_OUT:])):
        lines = (
            json.dumps({"prompt": f"{a:02d}+{b:02d}=", "answer": f"{a + b:03d}"}) for a, b in part
        )
        (out / f"{name}.jsonl").write_text("\n".join(lines) + "\n")


def model_config() -> TransformerConfig:
    return TransformerConfig(
        vocab_size=TOK.vocab_size, d_model=96, n_layers=3, n_heads=4, max_sequence_length=SEQ
    )


def sft_rows(records: list[PromptRecord]) -> torch.Tensor:
    """Whole lines ``prompt + answer + EOS``, padded with EOS (the model learns to stop)."""
    rows = torch.full((len(records), SEQ), TOK.eos_token_id, dtype=torch.long)
    for i, r in enumerate(records):
        ids = TOK.encode(r.prompt + r.fields["answer"])
        rows[i, : len(ids)] = torch.tensor(ids)
    return rows


class AnswerLabels(TokenTensorDataLoader):
    """Whole lines whose labels are only the answer and its EOS: the warm-up learns to answer,
    not to predict the (random) operands."""

    def _iter_batches(self) -> Iterator[dict[str, Any]]:
        for batch in super()._iter_batches():
            ids = batch["input_ids"]
            # Position p is trained when it predicts an answer token or the first EOS: p is
            # at or after "=" and is not itself an EOS.
            trained = ((ids == EQUALS).cumsum(1) > 0) & (ids != TOK.eos_token_id)
            labels = torch.where(trained[:, :-1], ids[:, 1:], -100)
            yield {**batch, "labels": torch.nn.functional.pad(labels, (0, 1), value=-100)}


def warm_up(model: Transformer, records: list[PromptRecord], out: Path, steps: int) -> None:
    batch = 128
    config = TransformerTrainModuleConfig(
        rank_microbatch_size=batch // get_world_size() * SEQ, optim=AdamWConfig(lr=3e-3)
    )
    loader = AnswerLabels(sft_rows(records), global_batch_size=batch * SEQ, seed=0)
    TrainerConfig(
        save_folder=str(out / "sft"), max_duration=Duration.steps(steps), no_checkpoints=True,
        device="cpu", metrics_collect_interval=50,
    ).build(config.build(model), loader).fit()  # fmt: skip


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


def grpo(model: Transformer, out: Path, steps: int) -> None:
    config = GRPOTrainModuleConfig(
        rank_microbatch_size=PROMPTS_PER_STEP * GROUP * SEQ,
        optim=AdamWConfig(lr=1e-3, weight_decay=0.0),
        scheduler=ConstantWithWarmup(warmup=min(10, steps)),
        max_grad_norm=1.0,
        loss=GRPOLossConfig(group_size=GROUP, kl_coef=0.02),
        sampling=SamplingConfig(max_new_tokens=4),
        rewards=[RewardConfig("exact_answer"), RewardConfig("digit_match", weight=0.5)],
        num_iterations=2,
    )
    module = config.build(model, tokenizer=TOK, registry=rewards)
    loader = PromptDataLoader(
        read_prompt_jsonl(out / "train.jsonl"),
        prompts_per_rank=PROMPTS_PER_STEP // get_world_size(),
        seed=0,
    )
    TrainerConfig(
        save_folder=str(out / "grpo"), max_duration=Duration.steps(steps), no_checkpoints=True,
        device="cpu", metrics_collect_interval=10, callbacks={"metric_saver": MetricSaverCallback()},
    ).build(module, loader).fit()  # fmt: skip


def main(out: str = "runs/grpo-demo", grpo_steps: int = 300, sft_steps: int = 600) -> None:
    prepare_training_environment(seed=0)
    folder = Path(out)
    if get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        write_task(folder)
    barrier()
    train, held_out = (read_prompt_jsonl(folder / f"{n}.jsonl") for n in ("train", "heldout"))
    model = model_config().build(seed=0)
    warm_up(model, train, folder, sft_steps)
    before = accuracy(model, held_out)
    grpo(model, folder, grpo_steps)
    after = accuracy(model, held_out)
    if get_rank() == 0:
        result = {
            "sft_steps": sft_steps,
            "grpo_steps": grpo_steps,
            "before": before,
            "after": after,
        }
        (folder / "accuracy.json").write_text(json.dumps(result) + "\n")
        print(f"held-out greedy accuracy ({HELD_OUT} sums): after the SFT warm-up {before:.3f}  "
              f"after {grpo_steps} GRPO steps {after:.3f}")  # fmt: skip
    teardown_training_environment()


if __name__ == "__main__":
    args = sys.argv[1:]
    main(*(args[:1]), *(int(a) for a in args[1:]))
