"""Helpers for tests: real multi-process runs on CPU (gloo) and small training set-ups."""

from __future__ import annotations

import os
import pickle
import queue
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import rank_processes
import torch
from rank_processes import AsSpawned

from olmolike.data import TokenTensorDataLoader
from olmolike.distributed.checkpoint_save import default_thread_count
from olmolike.testing import TinyCausalLM, busy_machine_factor, random_token_instances
from olmolike.train import BasicTrainModule, Callback, Trainer, TrainerConfig

SEQ_LEN = 16
VOCAB = 64


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launcher_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables a launcher such as torchrun gives rank ``rank`` on one machine."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def start_ranks(
    command: list[str], ranks: int = 2, *, stderr: int = subprocess.STDOUT
) -> list[subprocess.Popen[str]]:
    """Start ``command`` as the ``ranks`` ranks of one job on this machine, each with the
    variables a launcher gives it (:func:`launcher_env`, one free port) and one torch thread;
    stdout is piped as text, stderr into it unless ``stderr`` says otherwise."""
    port = free_port()
    return [
        subprocess.Popen(
            command,
            env={**os.environ, **launcher_env(rank, ranks, port), "OMP_NUM_THREADS": "1"},
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
        for rank in range(ranks)
    ]


def launch_two_nodes(
    node_args: Callable[[int], list[str]],
    *,
    nproc_per_node: int,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    preloaded: bool = False,
) -> list[str]:
    """Run a job of two nodes on this machine: one ``torchrun --nnodes=2`` per node with a
    c10d rendezvous on 127.0.0.1, node ``n`` running ``node_args(n)`` (the script and its
    arguments) on ``nproc_per_node`` ranks, with ``env`` added. Each node's output, in node
    order; a node that fails fails the test with the end of its output. ``preloaded``: the
    launchers and ranks run under :func:`preloaded_python.torchrun` (~0.2 CPU s each instead
    of a fresh interpreter's ~6)."""
    port = free_port()
    rendezvous = ["--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=two-nodes"]

    def torchrun(node: int) -> list[str]:
        options = ["--nnodes=2", f"--nproc_per_node={nproc_per_node}", f"--node_rank={node}"]
        if preloaded:
            import preloaded_python

            return preloaded_python.torchrun(*options, *rendezvous)
        return [sys.executable, "-m", "torch.distributed.run", *options, *rendezvous]

    launchers = [torchrun(node) for node in range(2)]  # the server's path now in os.environ
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    nodes = [
        subprocess.Popen(
            [*launchers[node], *node_args(node)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        for node in range(2)
    ]  # fmt: skip
    outputs = []
    try:
        for process in nodes:
            out, _ = process.communicate(timeout=patient(timeout))
            text = out.decode(errors="replace")
            failed = f"a node failed ({process.returncode}):\n{text[-4000:]}"
            assert process.returncode == 0, failed
            outputs.append(text)
    finally:
        for process in nodes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return outputs


@dataclass
class RankOutcome:
    rank: int
    result: Any = None
    error: str | None = None
    exitcode: int | None = None


def _worker(
    inherited: AsSpawned,
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    env: dict[str, str],
    results: Any,
) -> None:
    os.environ.update(launcher_env(rank, world_size, port), **env)
    torch.set_num_threads(1)
    from olmolike.train import prepare_training_environment, teardown_training_environment

    try:
        try:
            prepare_training_environment(seed=0)
            result = fn(*args)
        except BaseException as e:
            error = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            results.put(pickle.dumps(RankOutcome(rank, error=error)))
            raise
        # Plain pickle bytes: tensors travel by value, not as shared memory tied to this process.
        results.put(pickle.dumps(RankOutcome(rank, result=result)))
        teardown_training_environment()
    finally:
        inherited.exit()


def patient(seconds: float) -> float:
    """A test timeout of ``seconds`` on a quiet machine, stretched on a busy one (see
    :func:`olmolike.testing.busy_machine_factor`): other work makes a test slow, not failed."""
    return seconds * busy_machine_factor()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: tuple[Any, ...] = (),
    env: dict[str, str] | None = None,
    timeout: float = 120.0,
) -> list[RankOutcome]:
    """Run ``fn(*args)`` on ``world_size`` gloo ranks, each a new process as if spawned
    (:mod:`rank_processes`); return each rank's outcome.

    Never hangs: ranks still running after ``timeout`` seconds (:func:`patient`) are killed
    and reported as errors. ``fn`` must be a module-level function (it is pickled to the new processes).
    """
    ctx = rank_processes.context()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(AsSpawned(), fn, rank, world_size, port, args, env or {}, results),
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    timeout = patient(timeout)
    deadline = time.monotonic() + timeout
    outcomes = {rank: RankOutcome(rank) for rank in range(world_size)}
    try:
        # Drain while waiting: a child cannot exit while its result is stuck in a full pipe.
        while time.monotonic() < deadline:
            try:
                outcome = pickle.loads(results.get(timeout=0.2))
                outcomes[outcome.rank] = outcome
            except queue.Empty:
                if not any(p.is_alive() for p in procs):
                    break
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
    while not results.empty():
        outcome = pickle.loads(results.get())
        outcomes[outcome.rank] = outcome
    for rank, p in enumerate(procs):
        outcomes[rank].exitcode = p.exitcode
        if p.exitcode == -9 and outcomes[rank].error is None:
            outcomes[rank].error = f"killed after the {timeout:.0f}s timeout (hung)"
    return [outcomes[rank] for rank in range(world_size)]


def run_distributed_test(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: tuple[Any, ...] = (),
    timeout: float = 120.0,
) -> list[Any]:
    """Like :func:`run_distributed` but every rank must succeed; returns their results."""
    outcomes = run_distributed(fn, world_size, args=args, timeout=timeout)
    failures = [o for o in outcomes if o.error is not None or o.exitcode != 0]
    if failures:
        report = "\n".join(f"rank {o.rank} (exit {o.exitcode}): {o.error}" for o in failures)
        raise AssertionError(f"distributed test failed:\n{report}")
    return [o.result for o in outcomes]


def build_trainer(
    save_folder: str | Path,
    *,
    num_instances: int = 64,
    instances_per_batch: int = 8,
    micro_batch_instances: int | None = None,
    seed: int = 0,
    fsdp: bool = False,
    overrides: tuple[str, ...] = (),
    **config: Any,
) -> Trainer:
    """A small model, optimizer, loader and trainer over synthetic tokens.

    ``fsdp`` shards the model with FSDP2 over all ranks (else several ranks use DDP).
    """
    torch.manual_seed(seed)
    model = TinyCausalLM(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2, max_seq_len=SEQ_LEN)
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from olmolike.distributed.utils import get_world_size as world

        mesh = init_device_mesh("cpu", (world(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    from olmolike.distributed.utils import get_world_size

    world_size = get_world_size()
    rank_instances = instances_per_batch // world_size
    train_module = BasicTrainModule(
        model,
        optim,
        rank_microbatch_size=(micro_batch_instances or rank_instances) * SEQ_LEN,
        max_grad_norm=1.0,
    )
    loader = TokenTensorDataLoader(
        random_token_instances(num_instances, SEQ_LEN, VOCAB, seed=1),
        global_batch_size=instances_per_batch * SEQ_LEN,
        seed=seed,
    )
    trainer_config = TrainerConfig(save_folder=str(save_folder), **config).merge(list(overrides))
    return trainer_config.build(train_module, loader)


def full_params(trainer: Trainer) -> list[torch.Tensor]:
    """The model's parameters as plain, whole tensors (gathered if sharded)."""
    from torch.distributed.tensor import DTensor

    model = trainer.train_module.model  # type: ignore[attr-defined]
    return [
        (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for p in model.parameters()
    ]


ADAM_UPDATE_BOUND = 1.05
"""The most one Adam update moves an element, in units of the learning rate, over the first
8 updates with PyTorch's default betas (0.9, 0.999): ``|m_hat| / sqrt(v_hat)`` is 1 at the
first update and at most 1.028 at the 8th (Cauchy-Schwarz over the moments' sums)."""


def assert_within_adam_reach(
    got: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
    want: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
    *,
    lr: float,
    updates: int,
) -> None:
    """Weights of two runs that took ``updates`` AdamW updates (``lr``: the largest learning
    rate of the schedule) from the same weights, under layouts that add up gradients in a
    different order, differ by no more than Adam can move them.

    Adam divides each gradient element by its own running scale: an element whose gradient
    is near zero moves by up to ``lr`` per update, in a direction that rounding decides, so
    the two runs may differ there by twice that on some machine (each moves by at most
    ``ADAM_UPDATE_BOUND * lr`` per update; weight decay only shrinks a difference). No tighter
    tolerance holds on every CPU. What the runs compute deterministically (losses, gradients
    of the first step, which is one SGD step's weights) the tests compare tightly; this check
    catches a parameter missed, stale, or loaded from elsewhere, which differs by more.
    """
    reach = 2 * ADAM_UPDATE_BOUND * lr * updates + 1e-6
    got_named, want_named = _named(got), _named(want)
    assert got_named.keys() == want_named.keys()
    for name, value in want_named.items():
        msg = f"{name}: further than {updates} Adam updates at lr {lr} reach"
        torch.testing.assert_close(got_named[name], value, rtol=0, atol=reach, msg=msg)


def _named(
    tensors: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
) -> dict[str | int, torch.Tensor]:
    return dict(tensors) if isinstance(tensors, Mapping) else dict(enumerate(tensors))


def whole_tensors(model: torch.nn.Module, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """The model's parameters (or their gradients) by name, as whole tensors (gathered if
    sharded: on every rank together)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        tensor = p.grad if grads else p
        assert tensor is not None, f"{name} has no gradient"
        out[name] = (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()
    return {name: tensor.clone() for name, tensor in out.items()}


class Crash(RuntimeError):
    """The failure :class:`CrashAtStep` raises."""


@dataclass
class CrashAtStep(Callback):
    """Fails at the start of ``step_to_crash``, as a preempted or crashed job would."""

    step_to_crash: int = 0

    def pre_step(self, batch: dict[str, Any]) -> None:
        del batch
        if self.step == self.step_to_crash:
            raise Crash(f"crash at step {self.step}")


def dcp_shards(ranks: int = 1, prefix: str = "", threads: int | None = None) -> list[str]:
    """The shard files a DCP save writes: one per rank and writing thread (by default as
    many threads as the checkpointer's default on this machine)."""
    per_rank = threads or default_thread_count()
    return [f"{prefix}__{r}_{i}.distcp" for r in range(ranks) for i in range(per_rank)]
