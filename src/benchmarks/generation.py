"""How much faster is sampling with the KV cache than recomputing the whole context?

The ``small`` transformer (``TransformerConfig.small``, about 5 M parameters; ``tiny`` with
``--quick``) samples ``--new-tokens`` tokens (256) after a 16-token prompt, greedily and with no
stop token, so every run does the same number of steps. Side by side in one process, alternating
for ``--rounds`` rounds:

* **cached**: ``sample(..., use_cache=True)``: the prompt once, then one forward call over the
  newest token alone per step, keys and values read from the cache;
* **recompute**: ``sample(..., use_cache=False)``: every step runs over the whole context.

It prints new tokens/s for each, their median ratio with its spread, checks that both produced
the same tokens, and says whether the target (cached >= 5x recompute at batch 1) is met. Run it
with ``python src/benchmarks/generation.py`` (``make bench``); ``--quick`` is a smoke check. It
always exits 0: it measures, it does not test.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from olmolike.nn import Transformer, TransformerConfig
from olmolike.nn.generation import sample

PROMPT_LENGTH = 16
VOCAB_SIZE = 384  # the byte tokenizer's vocabulary, padded to a multiple of 128
TARGET_RATIO = 5.0

log = logging.getLogger(__name__)


def time_sampling(
    model: Transformer, prompts: torch.Tensor, new_tokens: int, cache: bool
) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    out = sample(model, prompts, max_new_tokens=new_tokens, temperature=0, use_cache=cache)
    elapsed = time.perf_counter() - start
    return prompts.shape[0] * new_tokens / elapsed, out.completion_ids


def measure(model: Transformer, batch: int, new_tokens: int, rounds: int) -> dict[str, object]:
    prompts = torch.randint(
        0, VOCAB_SIZE, (batch, PROMPT_LENGTH), generator=torch.Generator().manual_seed(batch)
    )
    time_sampling(model, prompts, 8, cache=True)  # warm-up: allocator, kernels
    cached, recompute, ratios, same = [], [], [], True
    for _ in range(rounds):
        fast, fast_ids = time_sampling(model, prompts, new_tokens, cache=True)
        slow, slow_ids = time_sampling(model, prompts, new_tokens, cache=False)
        cached.append(fast)
        recompute.append(slow)
        ratios.append(fast / slow)
        same = same and torch.equal(fast_ids, slow_ids)
    return {
        "batch": batch,
        "cached": statistics.median(cached),
        "recompute": statistics.median(recompute),
        "ratio": statistics.median(ratios),
        "spread": (min(ratios), max(ratios)),
        "same": same,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 32 tokens, 1 round")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--batches",
        type=int,
        nargs="+",
        default=[1],
        help="batch sizes to measure (default: 1; recomputing batch 8 takes minutes)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for both sides (default: 1: the decode steps of a 5 M model are "
        "too small to split across threads, and extra threads only contend on a busy machine)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    preset = TransformerConfig.tiny if args.quick else TransformerConfig.small
    new_tokens = 32 if args.quick else args.new_tokens
    rounds = 1 if args.quick else args.rounds
    config = preset(VOCAB_SIZE, max_sequence_length=PROMPT_LENGTH + new_tokens)
    model = config.build(seed=0).eval()
    rows = [measure(model, batch, new_tokens, rounds) for batch in args.batches]

    table = Table(
        title=f"greedy sampling, {config.num_params():,} parameters, {PROMPT_LENGTH}-token prompt, {new_tokens} new tokens, {torch.get_num_threads()} threads, median of {rounds}"
    )
    for column in (
        "batch",
        "cached tokens/s",
        "recompute tokens/s",
        "ratio",
        "ratio range",
        "same tokens",
    ):
        table.add_column(column, justify="right")
    for row in rows:
        low, high = row["spread"]  # type: ignore[misc]
        table.add_row(
            str(row["batch"]),
            f"{row['cached']:,.0f}",
            f"{row['recompute']:,.0f}",
            f"{row['ratio']:.1f}x",
            f"{low:.1f}-{high:.1f}x",
            "yes" if row["same"] else "NO",
        )
    console = Console(width=140)
    console.print(table)
    first = rows[0]
    verdict = "met" if first["ratio"] >= TARGET_RATIO else "NOT met"  # type: ignore[operator]
    console.print(
        f"target: cached >= {TARGET_RATIO:.0f}x recompute at batch {first['batch']}: {verdict}"
    )


if __name__ == "__main__":
    main()
