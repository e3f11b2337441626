"""Tokens/s of a mixture of experts against a dense model with the same active parameters.

The dense model is the ``tiny`` preset's shape (d_model 128, 4 layers, SwiGLU MLPs 512 wide);
the MoE is ``moe_tiny``: the same attention, and in each layer 8 experts 256 wide of which
every token takes 2, so a token's MLP has the dense model's parameters (plus an 8 x 128
router) while the layer holds 4x as many. Both train with the real ``Trainer`` and
``TransformerTrainModule`` (AdamW, clipping, the MoE's auxiliary losses and routing metrics)
on the same random tokens, alternating in rounds so that a busy machine slows both alike; the
MoE runs once with each expert computation (``loop``: a matmul per expert, the CPU default;
``grouped_mm``: ``torch._grouped_mm``, the CUDA default, which CPUs also have). It prints the
median tokens/s of each and its ratio to the dense model's, with the min-max over rounds.

Layouts: one process; then FSDP over 2 gloo ranks (every rank holds half of every
expert and gathers them all each step) and EP2 over the same 2 ranks (each rank holds 4
whole experts and exchanges the routed tokens), each rank with one thread and ``--rows``
sequences per step (the global batch twice one process's). The dense model has no experts to
split: it trains FSDP in the EP row too. For the 2-rank rows the table adds, for rank 0,
the bytes it sent to the other rank per step in ``all_to_all`` (the counts, the routed
copies and the results forward, both again backward), the share of its step spent in
those calls (waiting for the other rank included), and the bytes FSDP's all-gathers and
reduce-scatters sent (EP gathers only a rank's own experts); the EP row's tokens/s is also
given over the FSDP row's, round by round (each round runs every layout and model in turn,
so that a change in the machine's load hits them alike).

    .venv/bin/python src/benchmarks/moe.py [--quick] [--rounds 5] [--steps 8] [--device cuda]

On a GPU the models train in bfloat16 autocast (where ``grouped_mm`` is the default); on a
CPU in float32. It always exits 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from olmolike.config import DType
from olmolike.data import TokenTensorDataLoader
from olmolike.distributed.expert_parallel import ExpertParallelConfig
from olmolike.distributed.parallel import DataParallelConfig, DataParallelType
from olmolike.distributed.utils import broadcast_object, get_rank
from olmolike.nn import TransformerConfig
from olmolike.nn.moe import ExpertCompute, MoEConfig
from olmolike.optim import AdamWConfig
from olmolike.testing import random_token_instances, run_distributed_test
from olmolike.train import Callback, Duration, TrainerConfig
from olmolike.train.train_module import TransformerTrainModuleConfig

VOCAB = 384


@dataclass
class Traffic:
    """Bytes this rank sends to other ranks: in ``all_to_all_single`` (with the seconds
    spent in it) and in FSDP's all-gathers and reduce-scatters (``n - 1`` of every ``n``
    bytes gathered or reduced leave the rank)."""

    exchanged: int = 0
    seconds: float = 0.0
    fsdp: int = 0

    def install(self) -> None:
        all_to_all, gather = dist.all_to_all_single, dist.all_gather_single
        scatter = dist.reduce_scatter_single

        def counted(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            ranks, me = dist.get_world_size(group), dist.get_rank(group)
            splits = kwargs.get("input_split_sizes", args[1] if len(args) > 1 else None)
            rows = list(splits) if splits else [input.shape[0] // ranks] * ranks
            row_bytes = input[:1].numel() * input.element_size() if input.shape[0] else 0
            self.exchanged += (sum(rows) - rows[me]) * row_bytes
            start = time.perf_counter()
            try:
                return all_to_all(output, input, *args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        def gathered(output: torch.Tensor, input: torch.Tensor, **kwargs: Any) -> Any:
            self.fsdp += (output.numel() - input.numel()) * output.element_size()
            return gather(output, input, **kwargs)

        def scattered(output: torch.Tensor, input: torch.Tensor, **kwargs: Any) -> Any:
            self.fsdp += (input.numel() - output.numel()) * input.element_size()
            return scatter(output, input, **kwargs)

        dist.all_to_all_single = counted  # type: ignore[assignment]
        dist.all_gather_single = gathered  # type: ignore[assignment]
        dist.reduce_scatter_single = scattered  # type: ignore[assignment]

    def snapshot(self) -> tuple[int, float, int]:
        return self.exchanged, self.seconds, self.fsdp


@dataclass
class Timer(Callback):
    """Wall time of the steps after ``warmup``, and the all-to-all traffic in them."""

    warmup: int = 2
    start: float = 0.0
    end: float = 0.0
    exchange: Traffic | None = None
    at_start: tuple[int, float, int] = (0, 0.0, 0)

    def post_step(self) -> None:
        if self.step == self.warmup:
            self.start = time.perf_counter()
            if self.exchange is not None:
                self.at_start = self.exchange.snapshot()
        self.end = time.perf_counter()


def models(quick: bool) -> dict[str, TransformerConfig]:
    shape = dict(max_sequence_length=256)
    if quick:
        shape |= dict(d_model=32, n_layers=2, n_heads=2)
    dense = TransformerConfig.tiny(VOCAB, **shape, mlp_hidden_size=128 if quick else 512)
    out = {"dense (tiny)": dense}
    for compute in (ExpertCompute.loop, ExpertCompute.grouped_mm):
        moe = MoEConfig(num_experts=8, top_k=2, hidden_size=64 if quick else 256)
        moe.expert_compute = compute
        out[f"MoE 8 experts top-2 ({compute})"] = TransformerConfig.moe_tiny(
            VOCAB, **shape, moe=moe
        )
    return out


@dataclass
class Measured:
    """One run: global tokens/s; on several ranks rank 0's bytes sent per step (all-to-all,
    FSDP) and share of the step in all-to-all."""

    tokens_per_second: float
    exchanged_per_step: float | None = None
    all_to_all_share: float | None = None
    fsdp_per_step: float | None = None


def _train(
    config: TransformerConfig, *, steps: int, rows: int, seq: int, device: torch.device, ep: int
) -> Measured:
    """Train ``config`` on this process (one rank of a group when distributed)."""
    ranks = dist.get_world_size() if dist.is_initialized() else 1
    module = TransformerTrainModuleConfig(
        rank_microbatch_size=rows * seq,
        optim=AdamWConfig(lr=1e-3),
        max_grad_norm=1.0,
        autocast_precision=DType.bfloat16 if device.type == "cuda" else None,
        dp_config=DataParallelConfig(name=DataParallelType.fsdp) if ranks > 1 else None,
        ep_config=ExpertParallelConfig(degree=ep) if ep > 1 and config.moe else None,
    ).build(config.build(init_device="meta"), device=device)
    loader = TokenTensorDataLoader(
        random_token_instances(ranks * rows * (steps + 1), seq, VOCAB, seed=0),
        global_batch_size=ranks * rows * seq,
        dp_world_size=ranks,
        dp_rank=get_rank(),
    )
    exchange = Traffic() if ranks > 1 else None
    if exchange is not None:
        exchange.install()
    timer = Timer(exchange=exchange)
    TrainerConfig(
        save_folder=broadcast_object(tempfile.mkdtemp()) if ranks > 1 else tempfile.mkdtemp(),
        device=str(device),
        max_duration=Duration.steps(steps),
        no_checkpoints=True,
        metrics_collect_interval=steps,
        callbacks={"timer": timer},
    ).build(module, loader).fit()
    timed, seconds = steps - timer.warmup, timer.end - timer.start
    measured = Measured(ranks * rows * seq * timed / seconds)
    if exchange is not None:
        exchanged, in_all_to_all, fsdp = exchange.snapshot()
        measured.exchanged_per_step = (exchanged - timer.at_start[0]) / timed
        measured.all_to_all_share = (in_all_to_all - timer.at_start[1]) / seconds
        measured.fsdp_per_step = (fsdp - timer.at_start[2]) / timed
    return measured


def tokens_per_second(
    config: TransformerConfig, *, steps: int, rows: int, seq: int, device: torch.device
) -> Measured:
    return _train(config, steps=steps, rows=rows, seq=seq, device=device, ep=1)


def _rank(out: str, config: TransformerConfig, kwargs: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    measured = _train(config, **kwargs)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(measured.__dict__))


def two_ranks(ep: int) -> Callable[..., Measured]:
    """Measure on 2 gloo ranks, FSDP, the MoE's experts over ``ep`` of them."""

    def measure(config: TransformerConfig, **kwargs: Any) -> Measured:
        out = Path(tempfile.mkdtemp()) / "measured.json"
        kwargs = {**kwargs, "ep": ep, "device": torch.device("cpu")}
        run_distributed_test(_rank, 2, func_args=(str(out), config, kwargs), timeout=1800)
        return Measured(**json.loads(out.read_text()))

    return measure


LAYOUTS: dict[str, Callable[..., Measured]] = {
    "1 process": tokens_per_second,
    "FSDP 2 ranks": two_ranks(ep=1),
    "EP2 (FSDP 2 ranks)": two_ranks(ep=2),
}
"""How each layout measures tokens/s."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke check: tiny sizes")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8, help="steps per run (2 warm up)")
    parser.add_argument("--rows", type=int, default=8, help="sequences of 256 tokens per step")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    # --quick: one round of every layout and model, one timed step after the 2 warm-up steps.
    rounds, steps, rows = (1, 3, 2) if args.quick else (args.rounds, args.steps, args.rows)
    device = torch.device(args.device)
    configs = models(args.quick)
    console = Console(width=190)
    table = Table(title=f"MoE / dense tokens/s on {device} ({rounds} rounds, median (min-max))")
    columns = ("layout", "model", "total params", "active", "tokens/s", "ratio to dense")
    extra = ("vs FSDP 2 ranks", "all-to-all MiB/step", "all-to-all share", "FSDP MiB/step")
    for column in (*columns, *extra):
        table.add_column(column)
    # The ranks are gloo processes on the CPU; there the loop is the experts' computation.
    layouts = {k: v for k, v in LAYOUTS.items() if args.device == "cpu" or k == "1 process"}
    runs: dict[tuple[str, str], list[Measured]] = {}
    for _ in range(rounds):  # every layout and model in each round: load changes hit all alike
        for layout, measure in layouts.items():
            for name, config in configs.items():
                if layout != "1 process" and ExpertCompute.grouped_mm.value in name:
                    continue
                measured = measure(config, steps=steps, rows=rows, seq=256, device=device)
                runs.setdefault((layout, name), []).append(measured)
    for layout in layouts:
        dense = [m.tokens_per_second for m in runs[layout, "dense (tiny)"]]
        for name, config in configs.items():
            if (layout, name) not in runs:
                continue
            speeds = [m.tokens_per_second for m in runs[layout, name]]
            ratios = [s / d for s, d in zip(speeds, dense, strict=True)]
            measured = runs[layout, name]
            sent = [m.exchanged_per_step for m in measured if m.exchanged_per_step is not None]
            share = [m.all_to_all_share for m in measured if m.all_to_all_share is not None]
            fsdp = [m.fsdp_per_step for m in measured if m.fsdp_per_step is not None]
            baseline = runs.get(("FSDP 2 ranks", name), []) if layout.startswith("EP") else []
            versus = [s / b.tokens_per_second for s, b in zip(speeds, baseline, strict=False)]
            table.add_row(
                layout,
                name,
                f"{config.num_params():,}",
                f"{config.num_active_params():,}",
                f"{statistics.median(speeds):,.0f}",
                f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})",
                f"{statistics.median(versus):.3f} ({min(versus):.3f}-{max(versus):.3f})"
                if versus
                else "-",
                f"{statistics.median(sent) / 2**20:.2f}" if sent else "-",
                f"{statistics.median(share):.1%}" if share else "-",
                f"{statistics.median(fsdp) / 2**20:.2f}" if fsdp else "-",
            )
    console.print(table)


if __name__ == "__main__":
    main()
