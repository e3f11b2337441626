"""Is the data loader ever what a training step waits for?

A corpus is prepared from the first few MB of the Python standard library
(``stdlib_python_files()``, byte tokenizer) and read as 512-token instances in global batches
of 16 x 512 tokens, the example's shape. Measured side by side in one process:

* **loader tokens/s**: batches drawn from a ``NumpyDataLoader`` as fast as it yields them,
  with 0 and 2 worker processes (worker start-up included, as a trainer pays it each epoch);
* **step tokens/s**: forward + backward + AdamW of a small transformer
  (``TransformerConfig.small``; with ``--quick`` a 2-layer, d_model 32 ``tiny``) on one batch;
* **load / step**: inside a real training loop, the time spent waiting for the next batch
  divided by the time of the step itself. Target: below 1%.

With workers, the waiting is what remains after prefetching; the workers' reading still uses
CPU time that the step would otherwise have, which on a 2-core machine shows up as a slower
step rather than as waiting.

Run it with ``python src/benchmarks/data_loader.py`` (``make bench``); ``--quick`` is a smoke
check. It always exits 0: it measures, it does not test.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from olmolike.data import (
    NumpyDataLoader,
    NumpyDataLoaderConfig,
    NumpyFSLDataset,
    prepare_data,
    stdlib_python_files,
)

SEQUENCE_LENGTH = 512
BATCH_INSTANCES = 16
TARGET_RATIO = 0.01

log = logging.getLogger(__name__)


@dataclass
class Row:
    workers: int
    loader_tokens_per_s: float
    step_tokens_per_s: float
    wait_s: float
    step_s: float

    @property
    def ratio(self) -> float:
        return self.wait_s / self.step_s


def prepare_corpus(out: Path, megabytes: float) -> NumpyFSLDataset:
    """Tokenize the first ``megabytes`` of standard-library source (in its fixed order)."""
    files, total = [], 0
    for path in stdlib_python_files():
        if total >= megabytes * 1e6:
            break
        files.append(path)
        total += path.stat().st_size
    start = time.perf_counter()
    prepared = prepare_data(files, out)
    log.info(
        "prepared %s tokens from %d files in %.2fs",
        f"{prepared.num_tokens():,d}",
        len(files),
        time.perf_counter() - start,
    )
    return prepared.dataset_config(SEQUENCE_LENGTH).build()


def build_loader(dataset: NumpyFSLDataset, workers: int) -> NumpyDataLoader:
    config = NumpyDataLoaderConfig(
        global_batch_size=BATCH_INSTANCES * SEQUENCE_LENGTH, num_workers=workers
    )
    loader = config.build(dataset, dp_rank=0, dp_world_size=1)
    loader.reshuffle(1)
    return loader


def loader_throughput(dataset: NumpyFSLDataset, workers: int, batches: int) -> float:
    loader = build_loader(dataset, workers)
    start = time.perf_counter()
    count = 0
    for _ in loader:
        count += 1
        if count == batches:
            break
    return count * loader.global_batch_size / (time.perf_counter() - start)


def build_step(vocab_size: int, quick: bool) -> Callable[[torch.Tensor], None]:
    """Forward + backward + AdamW on one batch of a small transformer."""
    try:
        from olmolike.nn import TransformerConfig

        if quick:  # the smoke check's step: every code path, a fraction of tiny's arithmetic
            config = TransformerConfig.tiny(
                vocab_size, max_sequence_length=SEQUENCE_LENGTH, d_model=32, n_layers=2, n_heads=2
            )
        else:
            config = TransformerConfig.small(vocab_size, max_sequence_length=SEQUENCE_LENGTH)
        model: torch.nn.Module = config.build()
    except ImportError:  # the nn package is not there yet
        from olmolike.testing import TinyCausalLM

        model = TinyCausalLM(vocab_size=vocab_size, max_seq_len=SEQUENCE_LENGTH)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(input_ids: torch.Tensor) -> None:
        logits = model(input_ids[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), input_ids[:, 1:].flatten())
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)

    return step


def measure(dataset: NumpyFSLDataset, workers: int, steps: int, quick: bool) -> Row:
    step = build_step(dataset.vocab_size or 256, quick)
    loader = build_loader(dataset, workers)
    batches = iter(loader)
    step(next(batches)["input_ids"])  # warm-up: allocator, kernels, worker start-up
    waits, step_times = [], []
    for _ in range(steps):
        start = time.perf_counter()
        batch = next(batches)
        loaded = time.perf_counter()
        step(batch["input_ids"])
        waits.append(loaded - start)
        step_times.append(time.perf_counter() - loaded)
    step_s = statistics.median(step_times)
    return Row(
        workers=workers,
        loader_tokens_per_s=loader_throughput(dataset, workers, batches=4 * steps + 8),
        step_tokens_per_s=loader.global_batch_size / step_s,
        wait_s=statistics.mean(waits),
        step_s=step_s,
    )


def report(rows: list[Row]) -> None:
    table = Table(
        title=f"data loading vs a training step ({BATCH_INSTANCES} x {SEQUENCE_LENGTH} tokens)"
    )
    for column in ("workers", "loader tok/s", "step tok/s", "wait ms", "step ms", "load / step"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            str(row.workers),
            f"{row.loader_tokens_per_s:,.0f}",
            f"{row.step_tokens_per_s:,.0f}",
            f"{row.wait_s * 1e3:.3f}",
            f"{row.step_s * 1e3:.1f}",
            f"{row.ratio:.3%}",
        )
    console = Console()
    console.print(table)
    met = all(row.ratio < TARGET_RATIO for row in rows)
    console.print(f"target load / step < {TARGET_RATIO:.0%}: {'met' if met else 'NOT met'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny run, as a smoke check")
    parser.add_argument("--steps", type=int, help="timed training steps per worker setting")
    parser.add_argument("--megabytes", type=float, help="standard-library source to prepare")
    parser.add_argument("--threads", type=int, default=2, help="torch threads for the step")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    steps = args.steps or (1 if args.quick else 10)
    megabytes = args.megabytes or (1.0 if args.quick else 8.0)
    with tempfile.TemporaryDirectory() as tmp:
        dataset = prepare_corpus(Path(tmp) / "corpus", megabytes)
        rows = [measure(dataset, workers, steps, args.quick) for workers in (0, 2)]
    report(rows)


if __name__ == "__main__":
    main()
