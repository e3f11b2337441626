"""Checkpoint speed and memory, olmolike against OLMo-core, on the same model and state.

Both frameworks' ``Checkpointer`` save and load the same state: a causal transformer
(``TinyCausalLM``, 64 M parameters at ``--size 64M``) with its AdamW state after one step,
773 MB per checkpoint. Each framework is driven the way its trainer drives it: olmolike's
``Checkpointer`` with a ``BasicTrainModule`` (and the async staging buffers that its
``CheckpointerCallback`` prepares in the background the step before each async save, freed
once that save is complete); OLMo-core's ``Checkpointer`` with a
train module giving the state dicts that its ``TransformerTrainModule`` gives (flattened
optimizer state, ``cpu_offload``). On several ranks each gets a checkpoint process group of its
own, as both trainers create one.

Every measurement runs in a fresh process, one framework at a time, alternating which goes
first from round to round, so that neither framework's leftovers (allocator caches, threads,
staging buffers) show in the other's figures. A process builds the state, then:

1. one training step (forward, backward, AdamW step) with no save in flight;
2. two synchronous saves (time the loop is blocked; peak RSS of the second);
3. two asynchronous saves: of each the time the loop is blocked and the time until the
   checkpoint is complete. The first runs alone (and its peak RSS is measured); during the
   second a training step runs as soon as the save returns, as in a trainer, and is timed;
4. the memory it still holds (RSS after the saves, less RSS before the first one);
5. a load of the second checkpoint, which is in the page cache (time, peak RSS).

The first save of each kind plans it, which both frameworks cache for later saves: it is
reported apart, and the other rows are the steady state of a run that saves many times.
Every time is also measured as CPU time (``time.process_time``: all threads of the process):
on a shared machine wall times swing with what else runs, CPU times much less, and a framework
with more threads gets a larger share of a busy machine's cores.

``--threads`` sets torch's intra-op threads (``torch.set_num_threads`` and
``OMP_NUM_THREADS``) of the measuring processes; each value is a case of its own. The
checkpoint writer and reader threads are each framework's defaults (olmolike: the CPUs, 2 to
8; OLMo-core: the CPUs + 4, at most 16).

Peak RSS is the kernel's high-water mark (``VmHWM``), reset before each operation, and shown
above the base: the process's RSS once model and optimizer exist, before the first save
(importing OLMo-core alone costs ~70 MB more than olmolike, which says nothing about
checkpoints). The
2-rank case shards the model with FSDP2 (``fully_shard``) over gloo on CPU; its times are the
slowest rank's and its memory figures those of the rank that used more.

It prints each figure per framework (median and min-max over rounds) and the ratio
olmolike / OLMo-core per round (median and min-max), and the load average of the machine.
``--baseline SRC`` adds another copy of olmolike (the ``src`` folder of an older checkout,
e.g. ``git worktree add /tmp/old <rev>``), measured in the same interleaved rounds: on a
shared machine only figures from the same rounds can be compared. Needs ``ai2-olmo-core``
(``pip install -e '.[bench]'``); without it, it says so and exits 0. It always exits 0
unless a measurement fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from memory import CLEAR_REFS, peak_above, rss
from torch.distributed.checkpoint import state_dict as dcp_sd

FRAMEWORKS = ("olmolike", "olmo_core")
BASELINE = "baseline"
"""The side that measures another copy of olmolike (``--baseline SRC``)."""
NAMES = {"olmolike": "olmolike", "olmo_core": "OLMo-core", BASELINE: "baseline"}
SIZES = {
    "64M": {"vocab_size": 32000, "d_model": 512, "n_layers": 10},
    "small": {"vocab_size": 1024, "d_model": 128, "n_layers": 2},
}
SEQ_LEN = 64
INSTALL_HINT = (
    "ai2-olmo-core is not installed: `pip install -e '.[bench]'` (or "
    "`pip install ai2-olmo-core==3.0.0`) to compare checkpoints against OLMo-core"
)
# (key, label, unit): unit "s" for seconds, "GB" for memory.
ROWS = (
    ("sync_block", "sync save (loop blocked)", "s"),
    ("first_sync_block", "first sync save (plans it)", "s"),
    ("first_async_block", "first async save: loop blocked", "s"),
    ("first_async_total", "first async save: until complete", "s"),
    ("async_block", "second async save: loop blocked", "s"),
    ("async_step", "second async save: step beside it", "s"),
    ("async_total", "second async save: until complete", "s"),
    ("step", "step, no save in flight", "s"),
    ("load", "load (warm page cache)", "s"),
    ("held", "extra memory held between saves", "GB"),
    ("peak_sync", "peak RSS above base: sync save", "GB"),
    ("peak_async", "peak RSS above base: async save", "GB"),
    ("peak_load", "peak RSS above base: load", "GB"),
    ("base_rss", "base: RSS before saving", "GB"),
)
CPU = "_cpu"
"""Suffix of the CPU-time figure of each time."""


# -- memory ----------------------------------------------------------------------------------


# -- the state both frameworks save ----------------------------------------------------------


def build_state(
    size: str, sharded: bool
) -> tuple[torch.nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    """The same model and AdamW state in every process: seeded, one step on seeded tokens;
    and that training step, to run again."""
    from torch.distributed.fsdp import fully_shard

    from olmolike.testing import TinyCausalLM

    torch.manual_seed(0)
    model = TinyCausalLM(**SIZES[size], n_heads=8, max_seq_len=SEQ_LEN)
    if sharded:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, SIZES[size]["vocab_size"], (2, SEQ_LEN + 1))

    def step() -> None:
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)

    step()
    return model, optim, step


def train_state() -> dict[str, Any]:
    return {"global_step": 1, "rng": torch.get_rng_state()}


# -- the two frameworks ----------------------------------------------------------------------


class Olmolike:
    """olmolike's Checkpointer, as its trainer and CheckpointerCallback use it."""

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer, work: Path) -> None:
        from olmolike.train import BasicTrainModule, CheckpointerConfig

        self.module = BasicTrainModule(model, optim, rank_microbatch_size=2 * SEQ_LEN)
        group = dist.new_group() if dist.is_initialized() else None
        self.checkpointer = CheckpointerConfig().build(
            work, save_overwrite=False, process_group=group
        )

    def prepare(self) -> None:
        # CheckpointerCallback(save_async=True) has the staging buffers of each async save
        # allocated in the background during the step before it; by the save they exist.
        prepare = getattr(self.checkpointer, "prepare_async_staging", None)
        if prepare is not None:
            prepare(self.module)
            self.checkpointer.wait_for_pending_save()

    def save(self, dir: str) -> None:
        self.checkpointer.save(dir, self.module, train_state())

    def save_async(self, dir: str) -> Callable[[], None]:
        future = self.checkpointer.save_async(dir, self.module, train_state())
        return future.result

    def load(self, dir: str) -> None:
        self.checkpointer.load(dir, self.module)


class OlmoCoreModule:
    """The state dicts OLMo-core's TransformerTrainModule gives its Checkpointer (the calls
    that Checkpointer makes), for a model that is not an OLMo-core Transformer."""

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim

    def _state(self, options: dcp_sd.StateDictOptions) -> dict[str, Any]:
        return {
            "model": dcp_sd.get_model_state_dict(self.model, options=options),
            "optim": dcp_sd.get_optimizer_state_dict(self.model, self.optim, options=options),
        }

    def state_dict_to_save(self) -> dict[str, Any]:
        return self._state(
            dcp_sd.StateDictOptions(flatten_optimizer_state_dict=True, cpu_offload=True)
        )

    def state_dict_to_load(self, metadata: Any, *, optim: bool | None = None) -> dict[str, Any]:
        return self._state(dcp_sd.StateDictOptions(flatten_optimizer_state_dict=True, strict=True))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        options = dcp_sd.StateDictOptions(flatten_optimizer_state_dict=True, strict=True)
        dcp_sd.set_model_state_dict(self.model, state["model"], options=options)
        dcp_sd.set_optimizer_state_dict(self.model, self.optim, state["optim"], options=options)


class OlmoCore:
    """OLMo-core's Checkpointer, as its trainer and CheckpointerCallback use it."""

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer, work: Path) -> None:
        from olmo_core.train.checkpoint import CheckpointerConfig

        self.module = OlmoCoreModule(model, optim)
        group = dist.new_group() if dist.is_initialized() else None
        self.checkpointer = CheckpointerConfig(work_dir=str(work)).build(process_group=group)

    def prepare(self) -> None:
        pass  # OLMo-core allocates its staging memory in each async save

    def save(self, dir: str) -> None:
        self.checkpointer.save(dir, self.module, train_state())  # type: ignore[arg-type]

    def save_async(self, dir: str) -> Callable[[], None]:
        future = self.checkpointer.save_async(dir, self.module, train_state())  # type: ignore[arg-type]
        # Its metadata file is written by a done-callback; callbacks run in order.
        complete = threading.Event()
        future.add_done_callback(lambda _: complete.set())

        def wait() -> None:
            future.result()
            complete.wait()

        return wait

    def load(self, dir: str) -> None:
        self.checkpointer.load(dir, self.module)  # type: ignore[arg-type]


# -- one process: build, save, save async, load ----------------------------------------------


class _Clock:
    """Wall and CPU seconds (all threads of this process) since it was started."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def put(self, figures: dict[str, float], key: str) -> None:
        figures[key] = time.perf_counter() - self.wall
        figures[key + CPU] = time.process_time() - self.cpu


def _timed(figures: dict[str, float], key: str, action: Callable[[], Any]) -> None:
    clock = _Clock()
    action()
    clock.put(figures, key)


def _save_async(
    side: Olmolike | OlmoCore,
    dir: str,
    figures: dict[str, float],
    prefix: str,
    beside: Callable[[], None] | None = None,
) -> None:
    """Time how long the caller is blocked, ``beside`` (run while the save is in flight),
    and the time until the checkpoint is complete."""
    side.prepare()  # what the trainer's checkpointer callback does the step before
    clock = _Clock()
    wait = side.save_async(dir)
    clock.put(figures, f"{prefix}async_block")
    if beside is not None:
        _timed(figures, f"{prefix}async_step", beside)
    wait()
    clock.put(figures, f"{prefix}async_total")


def measure(framework: str, size: str, folder: Path) -> dict[str, float]:
    sharded = dist.is_initialized()
    model, optim, step = build_state(size, sharded)
    side = (Olmolike if framework == "olmolike" else OlmoCore)(model, optim, folder / "work")
    figures: dict[str, float] = {}
    _timed(figures, "step", step)
    figures["base_rss"] = rss()
    dirs = [str(folder / f"step{n}") for n in range(1, 5)]
    # The first save of each kind plans it (and caches the plan): a one-off, reported apart.
    _timed(figures, "first_sync_block", lambda: side.save(dirs[0]))
    with peak_above(figures["base_rss"], figures, "peak_sync"):
        _timed(figures, "sync_block", lambda: side.save(dirs[1]))

    with peak_above(figures["base_rss"], figures, "peak_async"):
        _save_async(side, dirs[2], figures, "first_")
    _save_async(side, dirs[3], figures, "", beside=step)
    if sharded:
        dist.barrier()  # every rank's async save is done before anyone measures or loads
    figures["held"] = rss() - figures["base_rss"]

    with peak_above(figures["base_rss"], figures, "peak_load"):
        _timed(figures, "load", lambda: side.load(dirs[1]))
    figures["checkpoint_bytes"] = sum(
        p.stat().st_size for p in Path(dirs[1]).rglob("*") if p.is_file()
    )
    figures["params"] = sum(p.numel() for p in model.parameters())  # DTensors: global sizes
    return figures


def _rank_main(framework: str, size: str, folder: str, out: str) -> None:
    figures = measure(framework, size, Path(folder))
    Path(f"{out}.rank{dist.get_rank()}").write_text(json.dumps(figures))


def worker(framework: str, size: str, ranks: int, threads: int, out: str) -> None:
    """Run in a fresh process: measure one framework and write its figures to ``out``."""
    torch.set_num_threads(threads)
    folder = Path(tempfile.mkdtemp(prefix=f"vs-olmo-core-{framework}-"))
    try:
        if ranks == 1:
            figures = measure(framework, size, folder)
        else:
            from olmolike.testing import run_distributed_test

            run_distributed_test(
                _rank_main,
                world_size=ranks,
                func_args=(framework, size, str(folder), out),
                timeout=1200,
            )
            per_rank = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(ranks)]
            figures = {key: max(rank[key] for rank in per_rank) for key in per_rank[0]}
        Path(out).write_text(json.dumps(figures))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# -- the parent: alternate fresh processes, print the table ----------------------------------


def run_one(side: str, size: str, ranks: int, threads: int, baseline: str) -> dict[str, float]:
    """Measure ``side`` (a framework, or "baseline": olmolike from ``baseline``)."""
    with tempfile.TemporaryDirectory(prefix="vs-olmo-core-out-") as tmp:
        out = os.path.join(tmp, "figures.json")
        framework = "olmolike" if side == BASELINE else side
        command = [sys.executable, __file__, "--worker", framework, "--size", size]
        command += ["--ranks", str(ranks), "--threads", str(threads), "--out", out]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        if side == BASELINE:
            env["PYTHONPATH"] = os.pathsep.join([baseline, env.get("PYTHONPATH", "")])
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:  # its log is noise unless it failed
            sys.stderr.write(done.stdout + done.stderr)
            raise SystemExit(f"measuring {NAMES[side]} on {ranks} rank(s) failed")
        figures: dict[str, float] = json.loads(Path(out).read_text())
        return figures


def _spread(values: list[float], fmt: str) -> str:
    middle = fmt.format(statistics.median(values))
    if len(values) == 1:
        return middle
    return f"{middle} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def _row(rounds: list[dict[str, dict[str, float]]], key: str, unit: str) -> list[str]:
    """Each side's median (min-max), and that of the per-round ratio of each olmolike to
    OLMo-core."""
    scale = 1.0 if unit == "s" else 1e-9
    cells = []
    for side in rounds[0]:
        values = [r[side][key] * scale for r in rounds]
        cells.append(_spread(values, "{:.2f}") + f" {unit}")
    # A ratio to almost nothing (< 50 MB of memory, 10 ms of time) would be noise: "-".
    floor = 50e6 if unit == "GB" else 0.01
    for side in rounds[0]:
        if side == "olmo_core":
            continue
        ratios = [r[side][key] / r["olmo_core"][key] for r in rounds if r["olmo_core"][key] > floor]
        cells.append(_spread(ratios, "{:.2f}") if len(ratios) == len(rounds) else "-")
    return cells


def report(ranks: int, threads: int, rounds: list[dict[str, dict[str, float]]]) -> None:
    from rich.console import Console
    from rich.table import Table

    first = rounds[0]["olmolike"]
    title = (
        f"Checkpoints, {ranks} rank{'s' if ranks > 1 else ''}"
        f"{' (FSDP2, gloo)' if ranks > 1 else ''}, {threads} torch thread"
        f"{'s' if threads > 1 else ''}: {first['params'] / 1e6:.1f} M parameters, "
        f"{first['checkpoint_bytes'] / 1e6:.0f} MB, {len(rounds)} round(s); "
        f"load average {os.getloadavg()[0]:.1f} at the end"
    )
    table = Table(title=title)
    sides = [NAMES[side] for side in rounds[0]]
    ratios = [f"{side} / OLMo-core" for side in sides if side != "OLMo-core"]
    for column in ("measure", *sides, *ratios):
        table.add_column(column, justify="left" if column == "measure" else "right", no_wrap=True)
    for key, label, unit in ROWS:
        table.add_row(label, *_row(rounds, key, unit))
    for key, label, unit in ROWS:
        if unit == "s":
            table.add_row(f"{label}, CPU", *_row(rounds, key + CPU, unit))
    width = 60 + 25 * (2 * len(sides) - 1)  # the rows unwrapped, even in a pipe
    Console(width=max(Console().width, width)).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="small model, 1 round, 1 thread: smoke check"
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds of alternating runs")
    parser.add_argument("--size", choices=sorted(SIZES), default="64M")
    parser.add_argument(
        "--ranks", type=int, nargs="+", default=[1, 2], help="cases to run: 1 and/or 2 ranks"
    )
    parser.add_argument(
        "--threads",
        type=int,
        nargs="+",
        help="cases to run: torch threads (default: 1 and 2; 1 with --quick)",
    )
    parser.add_argument(
        "--baseline",
        metavar="SRC",
        help="also measure the olmolike in this src folder (an older checkout), interleaved",
    )
    parser.add_argument("--worker", choices=FRAMEWORKS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    # --quick runs each code path once: both rank counts (one process, FSDP2), one thread.
    args.threads = args.threads or ([1] if args.quick else [1, 2])
    if min(args.rounds, *args.ranks, *args.threads) < 1:
        parser.error("--rounds, --ranks and --threads take numbers >= 1")
    if args.worker:
        worker(args.worker, args.size, args.ranks[0], args.threads[0], args.out)
        return
    if importlib.util.find_spec("olmo_core") is None:
        print(INSTALL_HINT)
        return
    if not CLEAR_REFS.exists():
        print("vs_olmo_core.py measures peak memory through /proc (Linux only): nothing to do")
        return
    size, rounds = ("small", 1) if args.quick else (args.size, args.rounds)
    sides = ["olmolike", *([BASELINE] if args.baseline else []), "olmo_core"]
    for ranks in args.ranks:
        for threads in args.threads:
            results: list[dict[str, dict[str, float]]] = []
            for index in range(rounds):
                order = sides if index % 2 == 0 else sides[::-1]
                figures = {s: run_one(s, size, ranks, threads, args.baseline) for s in order}
                results.append({side: figures[side] for side in sides})  # columns in order
            report(ranks, threads, results)


if __name__ == "__main__":
    main()
