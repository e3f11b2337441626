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

Layouts: one process. Expert parallelism's rows (EP over 2 and 4 ranks, with the share of
the step spent in ``all_to_all``) are to be added to ``LAYOUTS`` when it exists.

    .venv/bin/python src/benchmarks/moe.py [--quick] [--rounds 5] [--steps 8] [--device cuda]

On a GPU the models train in bfloat16 autocast (where ``grouped_mm`` is the default); on a
CPU in float32. It always exits 0.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from olmolike.config import DType
from olmolike.data import TokenTensorDataLoader
from olmolike.nn import TransformerConfig
from olmolike.nn.moe import ExpertCompute, MoEConfig
from olmolike.optim import AdamWConfig
from olmolike.testing import random_token_instances
from olmolike.train import Callback, Duration, TrainerConfig
from olmolike.train.train_module import TransformerTrainModuleConfig

VOCAB = 384


@dataclass
class Timer(Callback):
    """Wall time of the steps after ``warmup``."""

    warmup: int = 2
    start: float = 0.0
    end: float = 0.0

    def post_step(self) -> None:
        if self.step == self.warmup:
            self.start = time.perf_counter()
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


def tokens_per_second(
    config: TransformerConfig, *, steps: int, rows: int, seq: int, device: torch.device
) -> float:
    module = TransformerTrainModuleConfig(
        rank_microbatch_size=rows * seq,
        optim=AdamWConfig(lr=1e-3),
        max_grad_norm=1.0,
        autocast_precision=DType.bfloat16 if device.type == "cuda" else None,
    ).build(config.build(init_device="meta"), device=device)
    loader = TokenTensorDataLoader(
        random_token_instances(rows * (steps + 1), seq, VOCAB, seed=0), global_batch_size=rows * seq
    )
    timer = Timer()
    TrainerConfig(
        save_folder=tempfile.mkdtemp(),
        device=str(device),
        max_duration=Duration.steps(steps),
        no_checkpoints=True,
        metrics_collect_interval=steps,
        callbacks={"timer": timer},
    ).build(module, loader).fit()
    return rows * seq * (steps - timer.warmup) / (timer.end - timer.start)


LAYOUTS: dict[str, Callable[..., float]] = {"1 process": tokens_per_second}
"""How each layout measures tokens/s (expert parallelism's rows go here)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke check: tiny sizes")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8, help="steps per run (2 warm up)")
    parser.add_argument("--rows", type=int, default=8, help="sequences of 256 tokens per step")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    rounds, steps, rows = (2, 4, 2) if args.quick else (args.rounds, args.steps, args.rows)
    device = torch.device(args.device)
    configs = models(args.quick)
    console = Console(width=140)
    table = Table(title=f"MoE / dense tokens/s on {device} ({rounds} rounds, median (min-max))")
    for column in ("layout", "model", "total params", "active", "tokens/s", "ratio to dense"):
        table.add_column(column)
    for layout, measure in LAYOUTS.items():
        speeds: dict[str, list[float]] = {name: [] for name in configs}
        for _ in range(rounds):
            for name, config in configs.items():
                speeds[name].append(measure(config, steps=steps, rows=rows, seq=256, device=device))
        dense = speeds["dense (tiny)"]
        for name, config in configs.items():
            ratios = [s / d for s, d in zip(speeds[name], dense, strict=True)]
            table.add_row(
                layout,
                name,
                f"{config.num_params():,}",
                f"{config.num_active_params():,}",
                f"{statistics.median(speeds[name]):,.0f}",
                f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})",
            )
    console.print(table)


if __name__ == "__main__":
    main()
