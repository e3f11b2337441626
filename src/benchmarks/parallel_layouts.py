"""Speed, memory per rank and exactness of every parallel layout on CPU gloo ranks, against
FSDP and against one process.

The same model (8 blocks, QK-norm), data, seed and global batch are trained by the real
``Trainer`` for ``--steps`` steps under each layout on the same ranks (4 by default,
``--ranks 8`` allowed): FSDP over all ranks (the baseline), DDP, tensor parallelism over all
ranks and TP 2 x FSDP, pipeline parallelism over all ranks with each schedule (GPipe, 1F1B,
interleaved 1F1B with two stages per rank, on the most pipeline ranks the blocks allow, FSDP
over the rest), PP 2 x FSDP, TP 2 x PP over the rest, and on 8 ranks TP 2 x PP 2 x FSDP 2.
Per layout it prints:

- steps/s after a warm-up, and as a ratio to FSDP's;
- the bytes the busiest rank holds in parameters, gradients and optimizer state (its local
  shards' sizes; pipeline ranks of different stages hold different bytes), as a ratio to
  FSDP's, and whether ``olmolike plan``'s figure
  (:func:`~olmolike.plan.memory.state_bytes`) equals what each rank holds;
- the largest difference from a one-process run of the same model, data and steps of its
  per-step losses, its last step's gradients and its final weights, and ``pass`` when the
  losses are within 1e-5 (relative) and the gradients and weights within 1e-5 (``rtol`` and
  ``atol``), all fp32; else ``FAIL``.

It trains with SGD with momentum, not AdamW: AdamW divides each gradient by its own running
magnitude, so an element whose gradient is near zero moves by up to ``lr`` on a rounding
difference of it. Tensor parallelism sums every matmul in another order, so under AdamW (lr
1e-3) its weights differ from one process's by ~2e-4 after a single step whose gradients agree
to 1e-7, and the difference grows from there; SGD's step is linear in the gradient, so after
several steps a correct layout still agrees to ~1e-7 and a wrong one does not.

A layout the train module refuses (its configuration error) is listed as refused. On CPU,
gloo's collectives dominate a small model's step, so the speed ratios say how much
communication each layout adds, not how it runs on GPUs (``gpu_throughput.py --tp N``); the
byte ratios hold anywhere. Run it with ``python src/benchmarks/parallel_layouts.py``;
``--quick`` is a smoke check (2 ranks, a tiny model). It always exits 0: it measures, and
prints a failed equality as ``FAIL`` in red.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch.distributed.tensor import DTensor

from olmolike.data import TokenTensorDataLoader
from olmolike.distributed.parallel import DataParallelConfig, DataParallelType
from olmolike.distributed.pipeline import PipelineParallelConfig, PipelineScheduleType
from olmolike.distributed.tensor_parallel import TensorParallelConfig
from olmolike.distributed.utils import broadcast_object, gather_objects, get_rank
from olmolike.exceptions import ConfigurationError
from olmolike.nn import TransformerConfig
from olmolike.optim import SGDConfig
from olmolike.plan.memory import Layout, state_bytes
from olmolike.testing import random_token_instances, run_distributed_test
from olmolike.train import Callback, Duration, TrainerConfig
from olmolike.train.train_module import TransformerTrainModuleConfig

SEQ, VOCAB, GLOBAL_ROWS, MICROBATCH_ROWS = 128, 512, 16, 2
TOLERANCE = 1e-5


@dataclass
class Measure(Callback):
    """Wall time of the steps after ``warmup``, each step's CE loss, and the gradients (their
    local bytes, and whole) at step ``last``."""

    last: int
    warmup: int = 2
    start: float = 0.0
    end: float = 0.0
    grad_bytes: int = 0
    losses: dict[int, float] = field(default_factory=dict)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)

    def pre_optim_step(self) -> None:
        if self.trainer.global_step != self.last:
            return
        model = self.trainer.train_module.model  # type: ignore[attr-defined]
        params = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
        self.grad_bytes = sum(_local_bytes(p.grad) for _, p in params)
        self.grads = {n: _full(p.grad) for n, p in params}

    def post_step(self) -> None:
        if self.step == self.warmup:
            self.start = time.perf_counter()
        self.end = time.perf_counter()

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.losses[step] = metrics["train/CE loss"]


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


@dataclass(frozen=True)
class Spec:
    """A layout: its name, data parallelism, and TP/PP degrees and schedule."""

    name: str
    dp: str = "fsdp"
    tp: int = 1
    pp: int = 1
    schedule: str = "1f1b"


def _model(quick: bool) -> TransformerConfig:
    return TransformerConfig(
        vocab_size=VOCAB, d_model=64 if quick else 128, n_layers=4 if quick else 8, n_heads=8,
        max_sequence_length=SEQ, qk_norm=True, block_type="reordered_norm",
    )  # fmt: skip


def _specs(ranks: int, n_layers: int) -> list[Spec]:
    """Every layout of ``ranks`` ranks, FSDP first."""
    pp_interleaved = max(p for p in (1, 2, 4, 8) if ranks % p == 0 and 2 * p <= n_layers)
    rest = ranks // pp_interleaved
    specs = [
        Spec("FSDP"),
        Spec("DDP", dp="ddp"),
        Spec(f"TP={ranks}", tp=ranks),
        Spec(f"TP=2 x FSDP={ranks // 2}", tp=2),
        Spec(f"PP={ranks} GPipe", pp=ranks, schedule="gpipe"),
        Spec(f"PP={ranks} 1F1B", pp=ranks),
        Spec(
            f"PP={pp_interleaved} interleaved 1F1B" + (f" x FSDP={rest}" if rest > 1 else ""),
            pp=pp_interleaved,
            schedule="interleaved_1f1b",
        ),
        Spec(f"PP=2 x FSDP={ranks // 2}", pp=2),
        Spec(f"TP=2 x PP={ranks // 2}", tp=2, pp=ranks // 2),
    ]
    if ranks >= 8:
        specs.append(Spec(f"TP=2 x PP=2 x FSDP={ranks // 4}", tp=2, pp=2))
    unique = {(s.dp, s.tp, s.pp, s.schedule): s for s in reversed(specs) if s.tp * s.pp <= ranks}
    return sorted(unique.values(), key=specs.index)  # on 2 ranks some coincide


def _module(spec: Spec) -> TransformerTrainModuleConfig:
    schedule = PipelineScheduleType(spec.schedule)
    return TransformerTrainModuleConfig(
        rank_microbatch_size=MICROBATCH_ROWS * SEQ,
        optim=SGDConfig(lr=1e-2, momentum=0.9),
        max_grad_norm=1.0,
        dp_config=DataParallelConfig(name=DataParallelType(spec.dp)),
        tp_config=TensorParallelConfig(degree=spec.tp) if spec.tp > 1 else None,
        pp_config=PipelineParallelConfig(degree=spec.pp, schedule=schedule)
        if spec.pp > 1
        else None,
    )


def _full(tensor: torch.Tensor) -> torch.Tensor:
    whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return whole.detach().clone()


def _train(spec: Spec, steps: int, quick: bool, save: str) -> dict[str, Any]:
    """Train under ``spec`` on the ranks that run this; every rank returns what it holds."""
    model = _model(quick)
    try:
        module = _module(spec).build(model.build(init_device="meta"))
    except ConfigurationError as e:  # every rank refuses the same configuration
        return {"refused": str(e)}
    group = getattr(module, "dp_process_group", None)
    loader = TokenTensorDataLoader(
        random_token_instances(GLOBAL_ROWS * (steps + 1), SEQ, VOCAB),
        global_batch_size=GLOBAL_ROWS * SEQ,
        dp_rank=get_rank(group),
        dp_world_size=module.dp_world_size,
    )
    measure = Measure(last=steps)
    TrainerConfig(
        save_folder=save,
        max_duration=Duration.steps(steps),
        no_checkpoints=True,
        metrics_collect_interval=1,
        callbacks={"measure": measure},
    ).build(module, loader, dp_process_group=group).fit()
    optim_bytes = sum(
        _local_bytes(v)
        for state in module.optim.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )
    return {
        "steps/s": (steps - measure.warmup) / (measure.end - measure.start),
        "held": sum(_local_bytes(p) for p in module.model.parameters())
        + measure.grad_bytes
        + optim_bytes,
        "losses": measure.losses,
        "grads": measure.grads,
        "weights": {n: _full(p) for n, p in module.model.state_dict().items()},
        "layout": Layout(**module.layout.degrees.as_dict()),
    }


def _differences(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float, atol: float
) -> tuple[float, bool]:
    """The largest absolute difference of same-named tensors, and whether all are close."""
    if got.keys() != want.keys():
        return float("inf"), False
    largest = max((got[n] - want[n]).abs().max().item() for n in want)
    return largest, all(torch.allclose(got[n], want[n], rtol=rtol, atol=atol) for n in want)


def _compare(spec: Spec, ranks: list[dict[str, Any]], reference: dict[str, Any]) -> dict[str, Any]:
    """The busiest rank's bytes, whether the planner's figure equals every rank's, and the
    differences from one process (every pipeline stage's tensors gathered by name)."""
    if "refused" in ranks[0]:
        return {"refused": ranks[0]["refused"]}
    layout = Layout(
        **ranks[0]["layout"].as_dict(), stages_per_rank=2 if "interleaved" in spec.schedule else 1
    )
    optim = _module(spec).optim
    planned = [state_bytes(reference["model"], layout, optim, r) for r in range(len(ranks))]
    losses, want = ranks[0]["losses"], reference["losses"]
    loss_diff = max(abs(losses[s] - want[s]) for s in want)
    losses_close = all(abs(losses[s] - want[s]) <= TOLERANCE * abs(want[s]) for s in want)
    gathered = {
        key: {n: t for r in ranks for n, t in r[key].items()} for key in ("grads", "weights")
    }
    grad_diff, grads_close = _differences(
        gathered["grads"], reference["grads"], TOLERANCE, TOLERANCE
    )
    weight_diff, weights_close = _differences(
        gathered["weights"], reference["weights"], TOLERANCE, TOLERANCE
    )
    return {
        "steps/s": min(r["steps/s"] for r in ranks),
        "held": max(r["held"] for r in ranks),
        "as planned": all(
            p.params + p.grads + p.optim == r["held"] for p, r in zip(planned, ranks)
        ),
        "loss diff": loss_diff,
        "grad diff": grad_diff,
        "weight diff": weight_diff,
        "pass": losses_close and grads_close and weights_close,
    }


def _all_layouts(ranks: int, steps: int, quick: bool, out: str, reference_file: str) -> None:
    save = broadcast_object(tempfile.mkdtemp(prefix="parallel-layouts-"))
    reference = torch.load(reference_file, weights_only=False)
    results = {}
    for spec in _specs(ranks, _model(quick).n_layers):
        held = gather_objects(_train(spec, steps, quick, save))
        if get_rank() == 0:
            results[spec.name] = _compare(spec, held, reference)
    if get_rank() == 0:
        torch.save(results, out)


def _one_process(steps: int, quick: bool, out: str) -> None:
    """The reference: the same training in one process (the rank batch in micro-batches)."""
    result = _train(Spec("one process", dp="ddp"), steps, quick, tempfile.mkdtemp())
    torch.save({**result, "model": _model(quick)}, out)


def report(ranks: int, results: dict[str, dict[str, Any]]) -> None:
    base = results["FSDP"]
    table = Table(
        title=f"Parallel layouts on {ranks} CPU gloo ranks (ratios against FSDP; differences "
        f"from one process, tolerance {TOLERANCE:g})"
    )
    columns = ("layout", "steps/s", "ratio", "params+grads+optim, busiest rank", "ratio")
    for column in (*columns, "= plan", "loss diff", "grad diff", "weight diff", "equal"):
        table.add_column(column, justify="right")
    for name, r in results.items():
        if "refused" in r:
            table.add_row(name, "refused:", f"[yellow]{r['refused']}[/]", *[""] * 7)
            continue
        table.add_row(
            name,
            f"{r['steps/s']:.2f}",
            f"{r['steps/s'] / base['steps/s']:.2f}",
            f"{r['held'] / 2**20:.2f} MiB",
            f"{r['held'] / base['held']:.2f}",
            "yes" if r["as planned"] else "[red]no[/]",
            f"{r['loss diff']:.1e}",
            f"{r['grad diff']:.1e}",
            f"{r['weight diff']:.1e}",
            "pass" if r["pass"] else "[bold red]FAIL[/]",
        )
    Console(width=200).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--ranks", type=int, default=4, choices=(2, 4, 8))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="2 ranks, a tiny model, 3 steps")
    args = parser.parse_args()
    # --quick: every layout of 2 ranks, one timed step after the 2 warm-up steps.
    ranks, steps = (2, 3) if args.quick else (args.ranks, args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        reference, out = str(Path(tmp) / "reference.pt"), str(Path(tmp) / "results.pt")
        run_distributed_test(_one_process, 1, func_args=(steps, args.quick, reference))
        run_distributed_test(
            _all_layouts, ranks, func_args=(ranks, steps, args.quick, out, reference), timeout=3600
        )
        report(ranks, torch.load(out, weights_only=False))


if __name__ == "__main__":
    main()
