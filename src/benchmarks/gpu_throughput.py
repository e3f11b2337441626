"""Training throughput and MFU of a transformer preset on the GPUs of this machine.

The default is the OLMo-2-1B shape (vocabulary 100,352), bf16 parameters under FSDP2, every
block compiled, sequence length 4096, trained by the real ``Trainer`` on random tokens (the
data does not change the speed). Steps after the warm-up (which absorbs compilation and the
allocator's growth) are timed between two device synchronisations; the figures are tokens/s
per GPU and model FLOPs utilisation (the model's FLOPs per token, attention included, times
tokens/s, over the device's dense bf16 peak).

Targets on one H200: >= 60,000 tokens/s per GPU and MFU >= 45%.

Run it with ``python src/benchmarks/gpu_throughput.py`` (one GPU) or under
``torchrun --nproc-per-node=N``. ``--tp T`` splits every layer over T adjacent ranks (tensor
parallelism) and ``--pp P`` cuts the model into P pipeline stages (``--pp-schedule``: gpipe,
1f1b or interleaved_1f1b), FSDP over the ranks they leave: ``torchrun --nproc-per-node=8 ...
--tp 2`` is TP=2 x FSDP=4, ``--tp 2 --pp 2`` TP=2 x PP=2 x FSDP=2. Tokens/s per device count
each step's tokens once over all the devices that trained them. Without a GPU it runs a small
CPU smoke size, so the script keeps working; those figures say nothing about GPUs. It always
exits 0: it measures.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass, field

import torch
from rich.console import Console
from rich.table import Table

from olmolike.config import DType
from olmolike.data import TokenTensorDataLoader
from olmolike.distributed.parallel import DataParallelConfig, DataParallelType
from olmolike.distributed.pipeline import PipelineParallelConfig
from olmolike.distributed.tensor_parallel import TensorParallelConfig
from olmolike.distributed.utils import broadcast_object, get_rank, get_world_size
from olmolike.hardware import peak_flops
from olmolike.nn import TransformerConfig
from olmolike.optim import AdamWConfig
from olmolike.train import (
    Callback,
    Duration,
    TrainerConfig,
    prepare_training_environment,
    teardown_training_environment,
)
from olmolike.train.callbacks import ConsoleLoggerCallback
from olmolike.train.train_module import (
    ActivationCheckpointingConfig,
    TransformerTrainModuleConfig,
)

TARGET_TOKENS_PER_S = 60_000
TARGET_MFU = 0.45


@dataclass
class StepTimer(Callback):
    """Times the steps after ``warmup``, synchronising the device only at the two ends."""

    warmup: int = 5
    start: float | None = None
    end: float | None = None
    timed_steps: int = 0
    _device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def _sync(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    def post_attach(self) -> None:
        self._device = self.trainer.device

    def post_step(self) -> None:
        if self.step == self.warmup:
            self._sync()
            self.start = time.perf_counter()
        elif self.step > self.warmup:
            self.timed_steps += 1
            if self.trainer.training_complete:
                self._sync()
                self.end = time.perf_counter()


@dataclass(frozen=True)
class Setup:
    preset: str
    vocab_size: int
    seq_len: int
    rank_batch: int
    """Instances per data-parallel rank per step (a tensor-parallel group shares them)."""
    micro_batch: int
    steps: int
    warmup: int
    compile: bool
    dtype: DType
    activation_checkpointing: bool
    tp: int = 1
    pp: int = 1
    pp_schedule: str = "1f1b"
    """Tensor-parallel degree."""


def parse_args() -> Setup:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--preset", default="olmo2_1B")
    parser.add_argument("--vocab-size", type=int, default=100_352)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--rank-batch", type=int, default=8, help="instances per rank per step")
    parser.add_argument("--micro-batch", type=int, default=4, help="instances per forward pass")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--ac", action="store_true", help="full activation checkpointing")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default: 1)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (default: 1)")
    parser.add_argument(
        "--pp-schedule",
        default="1f1b",
        choices=["gpipe", "1f1b", "interleaved_1f1b"],
        help="pipeline schedule with --pp (default: 1f1b)",
    )
    parser.add_argument(
        "--smoke", "--quick", action="store_true", help="the small CPU size, even on a GPU"
    )
    args = parser.parse_args()
    if args.smoke or not torch.cuda.is_available():
        return Setup(
            "tiny", 512, 128, 4, 2, 6, 2, False, DType.float32, args.ac, args.tp, args.pp,
            args.pp_schedule,
        )  # fmt: skip
    return Setup(
        args.preset,
        args.vocab_size,
        args.seq_len,
        args.rank_batch,
        args.micro_batch,
        args.steps,
        args.warmup,
        not args.no_compile,
        DType.bfloat16,
        args.ac,
        args.tp,
        args.pp,
        args.pp_schedule,
    )


def run(setup: Setup, save_folder: str) -> tuple[StepTimer, int, float, int]:
    model_config = TransformerConfig.from_preset(
        setup.preset, setup.vocab_size, max_sequence_length=setup.seq_len
    )
    bf16 = setup.dtype == DType.bfloat16
    module_config = TransformerTrainModuleConfig(
        rank_microbatch_size=setup.micro_batch * setup.seq_len,
        optim=AdamWConfig(lr=3e-4),
        max_grad_norm=1.0,
        compile_model=setup.compile,
        # FSDP over the data ranks: bf16 gathers, and tensor parallelism composes with it only.
        dp_config=DataParallelConfig(
            name=DataParallelType.fsdp, param_dtype=DType.bfloat16 if bf16 else None
        )
        if bf16 or setup.tp > 1 or setup.pp > 1
        else None,
        tp_config=TensorParallelConfig(degree=setup.tp) if setup.tp > 1 else None,
        pp_config=PipelineParallelConfig(degree=setup.pp, schedule=setup.pp_schedule)
        if setup.pp > 1
        else None,
        ac_config=ActivationCheckpointingConfig() if setup.activation_checkpointing else None,
    )
    train_module = module_config.build(model_config.build(init_device="meta"))
    degrees = train_module.layout.degrees
    instances = torch.randint(
        0,
        setup.vocab_size,
        (setup.rank_batch * degrees.dp * setup.steps, setup.seq_len),
        generator=torch.Generator().manual_seed(0),
    )
    loader = TokenTensorDataLoader(
        instances,
        global_batch_size=setup.rank_batch * degrees.dp * setup.seq_len,
        dp_rank=degrees.dp_rank(get_rank()),
        dp_world_size=degrees.dp,
    )
    timer = StepTimer(warmup=setup.warmup)
    trainer = TrainerConfig(
        save_folder=save_folder,
        max_duration=Duration.steps(setup.steps),
        no_checkpoints=True,
        metrics_collect_interval=10,
        callbacks={"timer": timer, "console_logger": ConsoleLoggerCallback(log_interval=10)},
    ).build(train_module, loader)
    trainer.fit()
    flops = model_config.num_flops_per_token(setup.seq_len)
    return (
        timer,
        flops,
        torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0,
        degrees.dp,
    )


def report(
    setup: Setup, timer: StepTimer, flops_per_token: int, memory_gib: float, dp: int
) -> None:
    assert timer.start is not None and timer.end is not None
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    seconds = timer.end - timer.start
    # Each of the dp data-parallel ranks' batches is trained by tp x pp devices together.
    step_tokens = setup.rank_batch * setup.seq_len * dp
    tokens_per_s = timer.timed_steps * step_tokens / get_world_size() / seconds
    peak = peak_flops(device, setup.dtype.as_pt())
    mfu = tokens_per_s * flops_per_token / peak if peak else None
    console = Console(width=120)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke size)"
    table = Table(
        title=f"{setup.preset}, seq {setup.seq_len}, {setup.dtype}, {get_world_size()} rank(s) "
        f"(tp {setup.tp}, pp {setup.pp}) on {name}"
    )
    for column in ("tokens/s per device", "ms/step", "TFLOP/s per device", "MFU", "peak memory"):
        table.add_column(column, justify="right")
    table.add_row(
        f"{tokens_per_s:,.0f}",
        f"{seconds / timer.timed_steps * 1e3:.1f}",
        f"{tokens_per_s * flops_per_token / 1e12:.1f}",
        f"{mfu:.1%}" if mfu is not None else "n/a",
        f"{memory_gib:.1f} GiB" if memory_gib else "n/a",
    )
    console.print(table)
    console.print(
        f"{timer.timed_steps} timed steps after {setup.warmup} warm-up steps; compile={setup.compile}, "
        f"{setup.rank_batch} x {setup.seq_len} tokens per data-parallel rank per step in micro-batches of "
        f"{setup.micro_batch}; {flops_per_token / 1e9:.2f} GFLOPs per token"
    )
    if device.type == "cuda" and mfu is not None:
        met = tokens_per_s >= TARGET_TOKENS_PER_S and mfu >= TARGET_MFU
        console.print(
            f"target (one H200: >= {TARGET_TOKENS_PER_S:,} tokens/s and MFU >= {TARGET_MFU:.0%}): "
            f"{'met' if met else 'NOT met'}"
        )


def main() -> None:
    setup = parse_args()
    prepare_training_environment(seed=0)
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
    # Every rank must name the same (unused: no checkpoints) save folder.
    save_folder = broadcast_object(tempfile.mkdtemp(prefix="gpu-throughput-"))
    timer, flops, memory, dp = run(setup, save_folder)
    if get_rank() == 0:
        report(setup, timer, flops, memory, dp)
    teardown_training_environment()


if __name__ == "__main__":
    main()
