"""How long does a checkpoint save block training, synchronous versus asynchronous?

One run, one process, a model of at least 50 M parameters trained by the real ``Trainer``.
A probe callback times every step and, at fixed steps, saves a checkpoint:

* a synchronous save (``Trainer.save_checkpoint``): the loop is blocked for the whole write;
* an asynchronous save (``Trainer.save_checkpoint_async``): the loop is blocked only while
  the state is copied to CPU memory; the files are written by a background thread.

It reports both blocking times and their ratio (target: async blocks for at most 10% of the
synchronous time), and the median step time with no save in flight versus while the async
write is in flight (on a small CPU machine the writer competes with training for cores).

Run it with ``python src/benchmarks/checkpoint_stall.py``; ``--quick`` uses a small model as a
smoke check. It always exits 0: it measures, it does not test.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from rich.console import Console
from rich.table import Table

from olmolike.data import TokenTensorDataLoader
from olmolike.testing import TinyCausalLM, random_token_instances
from olmolike.train import (
    BasicTrainModule,
    Callback,
    Duration,
    TrainerConfig,
    prepare_training_environment,
)
from olmolike.train.callbacks import CheckpointerCallback, ConsoleLoggerCallback

SEQ_LEN = 64
SYNC_STEP, ASYNC_STEP = 4, 8


@dataclass
class StallProbe(Callback):
    """Times steps and the part of each save that blocks the loop."""

    step_times: dict[int, float] = field(default_factory=dict)
    in_flight_steps: set[int] = field(default_factory=set)
    sync_block: float = 0.0
    async_block: float = 0.0
    async_total: float = 0.0
    _last: float = 0.0
    _future: Future[None] | None = None
    _async_start: float = 0.0

    def pre_step(self, batch: dict[str, torch.Tensor]) -> None:
        self._last = time.perf_counter()
        if self._future is not None and not self._future.done():
            self.in_flight_steps.add(self.trainer.global_step)

    def post_step(self) -> None:
        step = self.trainer.global_step
        self.step_times[step] = time.perf_counter() - self._last
        if self._future is not None and self._future.done() and not self.async_total:
            self.async_total = time.perf_counter() - self._async_start
        if step == ASYNC_STEP - 1:  # what CheckpointerCallback(save_async=True) does
            self.trainer.checkpointer.prepare_async_staging(self.trainer.train_module)
        if step == SYNC_STEP:
            start = time.perf_counter()
            self.trainer.save_checkpoint()
            self.sync_block = time.perf_counter() - start
        elif step == ASYNC_STEP:
            self._async_start = time.perf_counter()
            _, self._future = self.trainer.save_checkpoint_async()
            self.async_block = time.perf_counter() - self._async_start

    def post_train(self) -> None:
        if self._future is not None:
            self._future.result()
            self.async_total = self.async_total or time.perf_counter() - self._async_start


def run(d_model: int, n_layers: int, vocab: int, steps: int) -> tuple[int, StallProbe]:
    torch.manual_seed(0)
    model = TinyCausalLM(
        vocab_size=vocab, d_model=d_model, n_layers=n_layers, n_heads=8, max_seq_len=SEQ_LEN
    )
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    module = BasicTrainModule(model, optim, rank_microbatch_size=2 * SEQ_LEN)
    loader = TokenTensorDataLoader(
        random_token_instances(2 * (steps + 1), SEQ_LEN, vocab), global_batch_size=2 * SEQ_LEN
    )
    probe = StallProbe()
    config = TrainerConfig(
        save_folder=tempfile.mkdtemp(prefix="checkpoint-stall-"),
        max_duration=Duration.steps(steps),
        callbacks={
            "probe": probe,
            "checkpointer": CheckpointerCallback(enabled=False),
            "console_logger": ConsoleLoggerCallback(log_interval=10**9),
        },
    )
    config.build(module, loader).fit()
    return sum(p.numel() for p in model.parameters()), probe


def report(params: int, probe: StallProbe) -> None:
    quiet = [
        t
        for s, t in probe.step_times.items()
        if s > 2 and s not in probe.in_flight_steps and s not in (SYNC_STEP, ASYNC_STEP)
    ]
    busy = [probe.step_times[s] for s in sorted(probe.in_flight_steps)]
    table = Table(title=f"Checkpoint stall, {params / 1e6:.1f} M parameters (fp32 + AdamW state)")
    table.add_column("measure")
    table.add_column("seconds", justify="right")
    table.add_row("synchronous save: loop blocked", f"{probe.sync_block:.3f}")
    table.add_row("asynchronous save: loop blocked", f"{probe.async_block:.3f}")
    table.add_row("asynchronous save: until complete", f"{probe.async_total:.3f}")
    table.add_row(
        "step, no save in flight (median)", f"{statistics.median(quiet):.3f}" if quiet else "-"
    )
    table.add_row(
        f"step, async save in flight (median of {len(busy)})",
        f"{statistics.median(busy):.3f}" if busy else "-",
    )
    console = Console()
    console.print(table)
    ratio = probe.async_block / probe.sync_block
    verdict = "met" if ratio <= 0.10 else "NOT met"
    console.print(f"async blocking / sync blocking = {ratio:.3f} (target <= 0.10: {verdict})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model, as a smoke check")
    args = parser.parse_args()
    prepare_training_environment(seed=0)
    torch.set_num_threads(2)
    if args.quick:
        params, probe = run(d_model=128, n_layers=2, vocab=1024, steps=12)
    else:
        params, probe = run(d_model=512, n_layers=12, vocab=32000, steps=16)
    report(params, probe)


if __name__ == "__main__":
    main()
