"""Checkpoint speed and memory of the trainer's ``Checkpointer``, round after round.

A 64 M-parameter ``TinyCausalLM`` (d_model 512, 10 layers, vocabulary 32000) with AdamW state
(0.77 GB per checkpoint) is saved and loaded by ``olmolike.train.Checkpointer`` as the trainer
does it (``prepare_async_staging`` before the async save, as the checkpointer callback calls
it a step ahead), into a folder on the current directory's disk. Each round runs in a fresh
process and measures:

* sync save: how long ``Checkpointer.save`` blocks;
* async save: how long ``save_async`` blocks (the copy to CPU memory), and until its future
  completes;
* load: ``Checkpointer.load`` of the checkpoint just written (warm page cache);
* memory held between saves: resident memory once the async save is complete, over the
  resident memory before the first save (e.g. staging buffers kept for the whole run);
* peak extra memory during each save and load, over the same base: the kernel's high-water
  mark (``VmHWM``), reset before each one (see ``memory.py``, shared with ``vs_olmo_core.py``).

``--baseline SRC`` alternates rounds between another copy of olmolike (the ``src`` folder of
an older checkout, e.g. ``git archive HEAD~3 src | tar -x -C /tmp/old``) and this one, and
prints min / median / max of both (the machine may be shared: read the spread, not one run).

    .venv/bin/python src/benchmarks/checkpoint_io.py [--rounds 3] [--baseline /tmp/old/src]
    .venv/bin/python src/benchmarks/checkpoint_io.py --quick     # small model, smoke check

Measured on a shared 2-core CPU box (local disk), 5 rounds each, alternating: before (commit
017b376: one writing thread, sequential reads, staging buffers kept all run) against this
version with defaults (2 threads on that box) and with ``keep_staging_buffers=True``;
min / median / max, seconds or GB:

=================================  ==================  ==================  ==================
measure                            before              after               after, kept
=================================  ==================  ==================  ==================
sync save: loop blocked            1.23 / 2.05 / 3.01  0.59 / 0.96 / 3.05  0.79 / 2.23 / 2.49
async save: loop blocked           0.12 / 0.15 / 0.20  0.13 / 0.16 / 0.30  0.14 / 0.18 / 0.26
async save: until complete         1.23 / 2.29 / 3.47  1.10 / 1.82 / 3.12  1.29 / 2.46 / 2.83
load (warm page cache)             0.68 / 0.87 / 1.13  0.53 / 0.82 / 1.24  0.64 / 0.74 / 0.87
memory held between saves          0.78 / 0.78 / 0.78  0.00 / 0.00 / 0.00  0.78 / 0.78 / 0.78
peak extra memory, sync save       0.00 / 0.00 / 0.00  0.00 / 0.00 / 0.00  0.00 / 0.00 / 0.00
peak extra memory, async save      0.78 / 0.78 / 0.78  0.78 / 0.78 / 0.78  0.78 / 0.78 / 0.78
peak extra memory, load            0.91 / 0.91 / 0.92  0.26 / 0.26 / 0.27  1.03 / 1.03 / 1.04
=================================  ==================  ==================  ==================

An earlier 3-round run while the box was busier (load average ~15): sync save 2.25-3.29 s
before, 0.83-2.04 s after; load 1.16-1.87 s before, 0.72-0.83 s after.

It always exits 0: it measures, it does not test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from memory import CLEAR_REFS, GB, peak_above, rss

MEASURES = {
    "sync_blocked": ("sync save: loop blocked", "s"),
    "async_blocked": ("async save: loop blocked", "s"),
    "async_total": ("async save: until complete", "s"),
    "load": ("load (warm page cache)", "s"),
    "held_between_saves": ("memory held between saves", "GB"),
    "peak_sync_save": ("peak extra memory, sync save", "GB"),
    "peak_async_save": ("peak extra memory, async save", "GB"),
    "peak_load": ("peak extra memory, load", "GB"),
}


def one_round(quick: bool, checkpointer_options: dict[str, Any]) -> dict[str, float]:
    """Build the model, take one AdamW step, and time the checkpointer (this process)."""
    import torch

    from olmolike.testing import TinyCausalLM
    from olmolike.train import BasicTrainModule, Checkpointer

    torch.manual_seed(0)
    torch.set_num_threads(2)
    size = dict(d_model=128, n_layers=2, vocab_size=1024) if quick else {}
    model = TinyCausalLM(
        **{"vocab_size": 32000, "d_model": 512, "n_layers": 10, **size}, n_heads=8, max_seq_len=64
    )
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optim.step()
    module = BasicTrainModule(model, optim, rank_microbatch_size=128)
    result: dict[str, float] = {"params_m": sum(p.numel() for p in model.parameters()) / 1e6}
    with tempfile.TemporaryDirectory(prefix="checkpoint-io-", dir=Path.cwd()) as tmp:
        checkpointer = Checkpointer(
            work_dir=Path(tmp) / "work", save_overwrite=True, **checkpointer_options
        )
        base = rss()
        with peak_above(base, result, "peak_sync_save", unit=GB):
            start = time.perf_counter()
            checkpointer.save(f"{tmp}/step1", module, {"step": 1})
            result["sync_blocked"] = time.perf_counter() - start
        checkpointer.prepare_async_staging(module)  # as the callback does before a save
        checkpointer.wait_for_pending_save()
        with peak_above(base, result, "peak_async_save", unit=GB):
            start = time.perf_counter()
            future = checkpointer.save_async(f"{tmp}/step2", module, {"step": 2})
            result["async_blocked"] = time.perf_counter() - start
            future.result()
            result["async_total"] = time.perf_counter() - start
        result["held_between_saves"] = (rss() - base) / GB
        with peak_above(base, result, "peak_load", unit=GB):
            start = time.perf_counter()
            checkpointer.load(f"{tmp}/step2", module)
            result["load"] = time.perf_counter() - start
        result["checkpoint_gb"] = (
            sum(f.stat().st_size for f in Path(tmp, "step2").rglob("*") if f.is_file()) / 1e9
        )
    return result


def run_round(src: str, quick: bool, options: dict[str, Any]) -> dict[str, float]:
    """One round in a fresh process importing olmolike from ``src``."""
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "2"}
    command = [sys.executable, __file__, "--one-round", json.dumps(options)]
    command += ["--quick"] if quick else []
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def spread(values: list[float]) -> str:
    return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model, as a smoke check")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per side")
    parser.add_argument("--baseline", help="the src folder of another olmolike to compare with")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="also this olmolike with Checkpointer options, e.g. "
        "keep='{\"keep_staging_buffers\": true}'",
    )
    parser.add_argument("--one-round", metavar="OPTIONS", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not CLEAR_REFS.exists():
        print("checkpoint_io.py measures memory through /proc (Linux only): nothing to do")
        return
    if args.one_round is not None:
        print(json.dumps(one_round(args.quick, json.loads(args.one_round))))
        return
    here = str(Path(__file__).resolve().parents[1])
    sides: dict[str, tuple[str, dict[str, Any]]] = {}
    if args.baseline:
        sides["baseline"] = (args.baseline, {})
    sides["this"] = (here, {})
    for variant in args.variant:
        name, _, options = variant.partition("=")
        sides[name] = (here, json.loads(options))
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    for _ in range(1 if args.quick else args.rounds):
        for name, (src, options) in sides.items():
            runs[name].append(run_round(src, args.quick, options))
    first = runs["this"][0]
    print(
        f"Checkpointer, {first['params_m']:.1f} M parameters + AdamW, "
        f"{first['checkpoint_gb']:.2f} GB per checkpoint; min / median / max of "
        f"{len(runs['this'])} rounds"
    )
    print(f"{'measure':<36}" + "".join(f"{name:>24}" for name in sides))
    for key, (label, unit) in MEASURES.items():
        cells = "".join(f"{spread([r[key] for r in runs[name]]):>24}" for name in sides)
        print(f"{label + f' ({unit})':<36}{cells}")


if __name__ == "__main__":
    main()
