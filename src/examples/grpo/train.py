"""GRPO on small sums with an exact-answer reward, after a short warm-up on a stream of sums.

The task is generated here: the 400 sums ``a+b`` of ``a, b`` in 0..19, as prompts ``"07+15="``
whose answer is ``"22"``. The warm-up is language modelling on documents of one to three sums
(``"07+15=22;03+11=14<eos>"``): the model learns the sums and the format, but after an answer
it as often goes on with ``";"`` and another sum as it stops. GRPO then samples ``group_size``
answers per prompt and rewards exactly the right sum, ended (a completion that goes on earns
nothing). It trains on 300 of the prompts (``OUT/train.jsonl``, prompt JSONL ``{"prompt":
"07+15=", "answer": "22"}``); the other 100 (``OUT/heldout.jsonl``) are never GRPO prompts,
and greedy accuracy on them is printed before and after GRPO. The metrics go to
``OUT/grpo/metrics.jsonl`` for ``olmolike plot``.

    python src/examples/grpo/train.py [OUT] [GRPO_STEPS] [SFT_STEPS]
    torchrun --nproc-per-node=2 src/examples/grpo/train.py [OUT] [...]
"""

from __future__ import annotations

import json
import random
import sys
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
SEQ = 32  # a warm-up document of three sums and its EOS fits
HELD_OUT = 100
PROMPTS_PER_STEP = 16  # over all ranks
GROUP = 8

rewards = RewardRegistry()


@rewards.reward("exact_answer")
def exact_answer(completions: list[str], answer: list[str], **_: Any) -> list[float]:
    """1 for exactly the right sum, ended by EOS (the completion holds nothing else), else 0."""
    return [float(c == a) for c, a in zip(completions, answer)]


def write_task(out: Path) -> None:
    """Every sum, shuffled: the first HELD_OUT to heldout.jsonl, the rest to train.jsonl."""
    pairs = [(a, b) for a in range(20) for b in range(20)]
    random.Random(0).shuffle(pairs)
    records = [PromptRecord(f"{a:02d}+{b:02d}=", {"answer": str(a + b)}) for a, b in pairs]
    for name, part in (("heldout", records[:HELD_OUT]), ("train", records[HELD_OUT:])):
        lines = (json.dumps({"prompt": r.prompt, **r.fields}) for r in part)
        (out / f"{name}.jsonl").write_text("\n".join(lines) + "\n")


def model_config() -> TransformerConfig:
    return TransformerConfig(
        vocab_size=TOK.vocab_size, d_model=64, n_layers=2, n_heads=4, max_sequence_length=SEQ
    )


def warm_up_documents(records: list[PromptRecord], count: int) -> torch.Tensor:
    """``count`` documents of one to three random sums joined by ``";"``, each ended by EOS
    and padded with EOS: after an answer, a document ends as often as it goes on."""
    rng = random.Random(1)
    rows = torch.full((count, SEQ), TOK.eos_token_id, dtype=torch.long)
    for i in range(count):
        sums = rng.choices(records, k=rng.randint(1, 3))
        ids = TOK.encode(";".join(r.prompt + r.fields["answer"] for r in sums))
        rows[i, : len(ids)] = torch.tensor(ids)
    return rows


def warm_up(model: Transformer, records: list[PromptRecord], out: Path, steps: int) -> None:
    batch = 64
    config = TransformerTrainModuleConfig(
        rank_microbatch_size=batch // get_world_size() * SEQ, optim=AdamWConfig(lr=3e-3)
    )
    rows = warm_up_documents(records, 20_000)
    loader = TokenTensorDataLoader(rows, global_batch_size=batch * SEQ, seed=0)
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
        optim=AdamWConfig(lr=5e-4, weight_decay=0.0),
        scheduler=ConstantWithWarmup(warmup=min(10, steps)),
        max_grad_norm=1.0,
        loss=GRPOLossConfig(group_size=GROUP, kl_coef=0.02),
        sampling=SamplingConfig(max_new_tokens=4),
        rewards=[RewardConfig("exact_answer")],
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


def main(out: str = "runs/grpo-demo", grpo_steps: int = 300, sft_steps: int = 300) -> None:
    prepare_training_environment(seed=0)
    folder = Path(out)
    if get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        write_task(folder)
    barrier()
    train, held_out = (read_prompt_jsonl(folder / f"{n}.jsonl") for n in ("train", "heldout"))
    model = model_config().build(seed=0)
    warm_up(model, [*train, *held_out], folder, sft_steps)  # the warm-up sees every sum
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
