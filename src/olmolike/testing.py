"""Small, fast building blocks for testing trainers and callbacks (yours and ours)."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

__all__ = [
    "TinyCausalLM",
    "busy_machine_factor",
    "random_token_instances",
    "run_distributed_test",
]  # and BACKENDS


class TinyCausalLM(nn.Module):
    """A pre-norm causal transformer built from ``nn.TransformerEncoderLayer``.

    Deterministic on CPU (no dropout), about 1 M parameters at the defaults; maps ``input_ids``
    ``(B, T)`` to logits ``(B, T, vocab_size)``.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        d_model: int = 128,
        n_layers: int = 4,
        n_heads: int = 4,
        max_seq_len: int = 512,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_seq_len, d_model)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                d_model, n_heads, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True
            )
            for _ in range(n_layers)
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seq_len = input_ids.shape[1]
        positions = torch.arange(seq_len, device=input_ids.device)
        x = self.embed(input_ids) + self.pos(positions)
        mask = nn.Transformer.generate_square_subsequent_mask(seq_len, device=input_ids.device)
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.head(self.norm(x))


def random_token_instances(
    num_instances: int, seq_len: int, vocab_size: int = 256, seed: int = 0
) -> torch.Tensor:
    """``(num_instances, seq_len)`` int64 token ids with some learnable structure.

    Each instance counts up from a random start (mod ``vocab_size``) with occasional random
    tokens, so the loss falls quickly when training works.
    """
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, vocab_size, (num_instances, 1), generator=generator)
    tokens = (starts + torch.arange(seq_len)) % vocab_size
    noise = torch.rand(num_instances, seq_len, generator=generator) < 0.1
    random_tokens = torch.randint(0, vocab_size, (num_instances, seq_len), generator=generator)
    return torch.where(noise, random_tokens, tokens)


def busy_machine_factor() -> float:
    """How many times slower than on a quiet machine work runs here now: the 1-minute load
    average per CPU, between 1 and 8.

    Test timeouts are stretched by it (:func:`run_distributed_test` does), so other work on
    the machine (data workers, other jobs, a parallel test run) makes a test slower, not
    failed, while a hang still fails, only later.
    """
    try:
        load = os.getloadavg()[0]
    except OSError:  # not available on this platform
        return 1.0
    return min(8.0, max(1.0, load / (os.cpu_count() or 1)))


def run_distributed_test(
    func: Callable[..., Any],
    world_size: int = 2,
    log_from_all_ranks: bool = False,
    backend: str = "gloo",
    start_method: str | None = None,
    func_args: tuple[Any, ...] | None = None,
    func_kwargs: dict[str, Any] | None = None,
    primary_addr: str = "127.0.0.1",
    primary_port: int | None = None,
    timeout: float = 300.0,
) -> None:
    """Run ``func(*func_args, **func_kwargs)`` on ``world_size`` local processes joined in a
    process group (OLMo-core's ``olmo_core.testing.run_distributed_test``).

    Raises if any rank fails. Never hangs: ranks still running after ``timeout`` seconds
    (stretched by :func:`busy_machine_factor` on a busy machine) are killed and the call
    raises ``TimeoutError``. ``start_method`` defaults to ``fork`` for
    gloo (``func`` may then be a local function) and ``spawn`` otherwise.
    """
    import torch.multiprocessing as mp

    method = start_method or ("fork" if backend == "gloo" else "spawn")
    port = primary_port or _free_port(primary_addr)
    context = mp.start_processes(
        _run_rank,
        args=(
            world_size,
            backend,
            log_from_all_ranks,
            func,
            func_args,
            func_kwargs,
            primary_addr,
            port,
        ),
        nprocs=world_size,
        start_method=method,
        join=False,
    )
    timeout *= busy_machine_factor()
    deadline = time.monotonic() + timeout
    while not context.join(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"distributed test did not finish within {timeout:.0f}s (hung)")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _run_rank(
    rank: int,
    world_size: int,
    backend: str,
    log_from_all_ranks: bool,
    func: Callable[..., Any],
    func_args: tuple[Any, ...] | None,
    func_kwargs: dict[str, Any] | None,
    addr: str,
    port: int,
) -> None:
    import datetime

    import torch.distributed as dist

    from .distributed.teardown import teardown_distributed
    from .utils import LogFilterType, setup_logging

    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR=addr,
        MASTER_PORT=str(port),
    )
    if "nccl" in backend and torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend=backend,
        timeout=datetime.timedelta(seconds=120),
        rank=rank,
        world_size=world_size,
    )
    setup_logging(LogFilterType.all_ranks if log_from_all_ranks else LogFilterType.rank0_only)
    try:
        func(*(func_args or ()), **(func_kwargs or {}))
    except BaseException:
        teardown_distributed(every_rank=False)  # the other ranks may be gone
        raise
    # Barriers, then no gloo worker still releasing an op (DTensor's collectives leave such
    # work behind) while this process exits: that would end it with SIGABRT.
    try:
        teardown_distributed()
    except Exception:  # a peer failed and is gone: its error, not this barrier's, is the one
        teardown_distributed(every_rank=False)


def __getattr__(name: str) -> Any:
    if name == "BACKENDS":
        # Built on first use: pytest is needed only by code that runs under pytest.
        import pytest

        two_gpus = torch.cuda.device_count() >= 2
        return [
            pytest.param("gloo", id="backend=GLOO"),
            pytest.param(
                "cuda:nccl,cpu:gloo",
                id="backend=NCCL",
                marks=pytest.mark.skipif(not two_gpus, reason="needs 2 GPUs"),
            ),
        ]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
