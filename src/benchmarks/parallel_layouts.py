"""Speed and memory per rank of the parallel layouts on CPU gloo ranks, against FSDP.

The same model and global batch are trained by the real ``Trainer`` under each layout on the
same ranks (4 by default, ``--ranks 8`` allowed): FSDP over all ranks (the baseline), DDP, and
tensor parallelism of degree 2, 4, ... with FSDP over the ranks it leaves. Per layout it prints
steps/s after a warm-up and the bytes one rank holds in parameters, gradients and optimizer
state (the local shards' sizes, summed on rank 0; every rank of these layouts holds the same),
each also as a ratio to FSDP's.

On CPU, gloo's collectives dominate a small model's step, so the speed ratios say how much
communication each layout adds, not how it runs on GPUs (``gpu_throughput.py --tp N``); the
byte ratios hold anywhere. Run it with ``python src/benchmarks/parallel_layouts.py``;
``--quick`` is a smoke check. It always exits 0: it measures.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from torch.distributed.tensor import DTensor

from olmolike.data import TokenTensorDataLoader
from olmolike.distributed.parallel import DataParallelConfig, DataParallelType
from olmolike.distributed.tensor_parallel import TensorParallelConfig
from olmolike.distributed.utils import broadcast_object, get_rank
from olmolike.nn import TransformerConfig
from olmolike.optim import AdamWConfig
from olmolike.testing import random_token_instances, run_distributed_test
from olmolike.train import Callback, Duration, TrainerConfig
from olmolike.train.train_module import TransformerTrainModuleConfig


@dataclass
class Measure(Callback):
    """Wall time of the steps after ``warmup``, and the gradients' bytes at the last step."""

    warmup: int = 2
    start: float = 0.0
    end: float = 0.0
    grad_bytes: int = 0
    _last: int = field(default=0, repr=False)

    def pre_optim_step(self) -> None:
        params = self.trainer.train_module.model.parameters()  # type: ignore[attr-defined]
        self.grad_bytes = sum(_local_bytes(p.grad) for p in params if p.grad is not None)

    def post_step(self) -> None:
        if self.step == self.warmup:
            self.start = time.perf_counter()
        self.end = time.perf_counter()


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _layouts(ranks: int) -> list[tuple[str, str, int]]:
    """(name, data parallelism, tensor-parallel degree), FSDP first."""
    layouts = [("FSDP", "fsdp", 1), ("DDP", "ddp", 1)]
    tp = 2
    while tp <= ranks:
        rest = ranks // tp
        layouts.append((f"TP={tp} x FSDP={rest}" if rest > 1 else f"TP={tp}", "fsdp", tp))
        tp *= 2
    return layouts


def _run(dp: str, tp: int, steps: int, quick: bool, save: str) -> dict[str, float]:
    model = TransformerConfig(
        vocab_size=512, d_model=64 if quick else 256, n_layers=2 if quick else 4, n_heads=8,
        max_sequence_length=128, qk_norm=True, block_type="reordered_norm",
    )  # fmt: skip
    module = TransformerTrainModuleConfig(
        rank_microbatch_size=2 * 128,
        optim=AdamWConfig(lr=1e-3),
        max_grad_norm=1.0,
        dp_config=DataParallelConfig(name=DataParallelType(dp)),
        tp_config=TensorParallelConfig(degree=tp) if tp > 1 else None,
    ).build(model.build(init_device="meta"))
    degrees = module.layout.degrees
    global_rows = 16
    loader = TokenTensorDataLoader(
        random_token_instances(global_rows * (steps + 1), 128, 512),
        global_batch_size=global_rows * 128,
        dp_rank=degrees.dp_rank(get_rank()),
        dp_world_size=degrees.dp,
    )
    measure = Measure()
    TrainerConfig(
        save_folder=save,
        max_duration=Duration.steps(steps),
        no_checkpoints=True,
        metrics_collect_interval=steps,
        callbacks={"measure": measure},
    ).build(module, loader).fit()
    optim_bytes = sum(
        _local_bytes(v)
        for state in module.optim.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    return {
        "steps/s": (steps - measure.warmup) / (measure.end - measure.start),
        "params": sum(_local_bytes(p) for p in module.model.parameters()),
        "grads": measure.grad_bytes,
        "optim": optim_bytes,
    }


def _all_layouts(ranks: int, steps: int, quick: bool, out: str) -> None:
    save = broadcast_object(tempfile.mkdtemp(prefix="parallel-layouts-"))
    results = {name: _run(dp, tp, steps, quick, save) for name, dp, tp in _layouts(ranks)}
    if get_rank() == 0:
        Path(out).write_text(json.dumps(results))


def report(ranks: int, results: dict[str, dict[str, float]]) -> None:
    base = results["FSDP"]
    table = Table(title=f"Parallel layouts on {ranks} CPU gloo ranks (ratios against FSDP)")
    columns = ("layout", "steps/s", "ratio", "params+grads+optim per rank", "ratio")
    for column in columns:
        table.add_column(column, justify="right")
    for name, r in results.items():
        held = r["params"] + r["grads"] + r["optim"]
        base_held = base["params"] + base["grads"] + base["optim"]
        table.add_row(
            name,
            f"{r['steps/s']:.2f}",
            f"{r['steps/s'] / base['steps/s']:.2f}",
            f"{held / 2**20:.2f} MiB",
            f"{held / base_held:.2f}",
        )
    Console(width=120).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--ranks", type=int, default=4, choices=(2, 4, 8))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--quick", action="store_true", help="2 ranks, a tiny model, 4 steps")
    args = parser.parse_args()
    ranks, steps = (2, 4) if args.quick else (args.ranks, args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "results.json")
        run_distributed_test(_all_layouts, ranks, func_args=(ranks, steps, args.quick, out))
        report(ranks, json.loads(Path(out).read_text()))


if __name__ == "__main__":
    main()
