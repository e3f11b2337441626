"""Model and optimizer state through ``torch.distributed.checkpoint`` (DCP).

Every rank writes its own shards; the state dicts come from ``get_model_state_dict`` /
``get_optimizer_state_dict``, so DDP, FSDP2 (DTensor) and plain modules all save the same
fully-qualified parameter names, and a checkpoint saved on N ranks loads on M.

DCP always writes to a *local* directory here. Its metadata file is written as
``.metadata.tmp`` and then renamed, and object stores have no rename (gcsfs falls back to a
server-side copy that some servers refuse); the trainer's checkpointer uploads the finished
files instead and writes its completion marker last.
"""

from __future__ import annotations

import logging
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..exceptions import CheckpointError, ConfigurationError
from ..io import is_url
from .checkpoint_format import dcp_reader, read_metadata
from .unshard import UnshardStrategy, UnshardStrategyType, unshard_checkpoint
from .utils import is_distributed

__all__ = [
    "ReusedBufferStager",
    "UnshardStrategy",
    "UnshardStrategyType",
    "apply_model_and_optim_state_dict",
    "async_save_state_dict",
    "check_checkpoint_backend",
    "checkpoint_keys",
    "load_model_and_optim_state",
    "load_state_dict",
    "model_and_optim_state_dict",
    "read_metadata",
    "save_model_and_optim_state",
    "save_state_dict",
    "unshard_checkpoint",
]

log = logging.getLogger(__name__)

# DCP warns on every single-process save and load; one process is a normal mode here.
warnings.filterwarnings(
    "ignore",
    message=r"torch\.distributed is (disabled, )?unavailable or uninitialized, assuming the intent",
    category=UserWarning,
)


def model_and_optim_state_dict(
    model: nn.Module, optim: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` keyed by parameter names, as DCP saves and loads it."""
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optim is not None:
        state["optim"] = get_optimizer_state_dict(model, optim)
    return state


_CPU_BACKENDS = ("gloo", "mpi")


def check_checkpoint_backend(backend: str) -> None:
    """Refuse a process-group backend that cannot run collectives on CPU tensors.

    Checkpoint collectives (DCP's planning, the checkpointer's agreement on success) exchange
    CPU tensors and objects, also from a background thread; ``"nccl"`` alone cannot. Accepted:
    a CPU backend (``"gloo"``) or a per-device string with a CPU part (``"cpu:gloo,cuda:nccl"``).
    """
    parts = [p.strip().lower() for p in str(backend).split(",") if p.strip()]
    for part in parts:
        device, _, name = part.rpartition(":")
        if device in ("", "cpu") and name in _CPU_BACKENDS:
            return
    raise ConfigurationError(
        f"checkpoints need a process-group backend with CPU collectives, but the backend is "
        f"{backend!r}. Initialize with backend='cpu:gloo,cuda:nccl' (e.g. "
        "prepare_training_environment(backend='cpu:gloo,cuda:nccl')), or pass a gloo group "
        "as checkpointer_pg to TrainerConfig.build()",
        path="backend",
    )


def _writer(dir: str | Path, thread_count: int | None) -> FileSystemWriter:
    if is_url(dir):
        raise CheckpointError(f"DCP writes to local directories only, got {dir}")
    return FileSystemWriter(str(dir), thread_count=thread_count or 1, sync_files=True)


def save_state_dict(
    dir: str | Path,
    state_dict: dict[str, Any],
    *,
    process_group: dist.ProcessGroup | None = None,
    thread_count: int | None = None,
) -> None:
    """Save every rank's shards of ``state_dict`` into the local directory ``dir``."""
    dcp.save(
        state_dict,
        storage_writer=_writer(dir, thread_count),
        process_group=process_group,
        no_dist=not is_distributed(),
    )


class ReusedBufferStager(AsyncStager):
    """Copies the state into CPU buffers allocated on first use and reused afterwards.

    Filling freshly allocated memory costs page faults that, on some machines, take an order
    of magnitude longer than the copy itself; reusing the buffers keeps the part of an async
    save that blocks training short. The caller must not stage again before the previous
    write has finished (the checkpointer never overlaps saves). Buffers are re-allocated when
    the state's structure changes (e.g. once the optimizer has state).
    """

    _synchronize_after_execute = False

    def __init__(self) -> None:
        self._buffers: dict[str, Any] | None = None
        self._signature: list[tuple[str, tuple[int, ...], torch.dtype]] = []

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        signature = _tensor_signature(state_dict)
        if self._buffers is None or signature != self._signature:
            self._buffers = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
            self._signature = signature
        return _copy_state_dict(state_dict, self._buffers)

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` copies synchronously."""

    def close(self) -> None:
        self._buffers = None


def _tensor_signature(
    state: Any, prefix: str = ""
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    if isinstance(state, torch.Tensor):
        return [(prefix, tuple(state.shape), state.dtype)]
    if isinstance(state, dict):
        return [item for k, v in state.items() for item in _tensor_signature(v, f"{prefix}.{k}")]
    if isinstance(state, (list, tuple)):
        return [
            item for i, v in enumerate(state) for item in _tensor_signature(v, f"{prefix}[{i}]")
        ]
    return [(f"{prefix}={state!r}", (), torch.float32)]


def async_save_state_dict(
    dir: str | Path,
    state_dict: dict[str, Any],
    *,
    process_group: dist.ProcessGroup | None = None,
    thread_count: int | None = None,
    stager: AsyncStager | None = None,
) -> Future[Any]:
    """Copy ``state_dict`` to CPU memory now, write it to ``dir`` in a background thread.

    When this returns, later optimizer steps can no longer change what is saved. The
    ``process_group`` must support CPU tensors (gloo); use one that training does not use.
    Pass a :class:`ReusedBufferStager` kept across saves to avoid re-allocating the copy.
    """
    future = dcp.async_save(
        state_dict,
        storage_writer=_writer(dir, thread_count),
        process_group=process_group,
        async_stager=stager,
        no_dist=not is_distributed(),
    )
    assert isinstance(future, Future)
    return future


def load_state_dict(
    dir: str | Path, state_dict: dict[str, Any], *, process_group: dist.ProcessGroup | None = None
) -> None:
    """Load saved values into the tensors of ``state_dict`` in place (any sharding, any ranks)."""
    dcp.load(
        state_dict,
        storage_reader=dcp_reader(dir),
        process_group=process_group,
        no_dist=not is_distributed(),
    )


def checkpoint_keys(dir: str | Path) -> set[str]:
    """Top-level names saved in a DCP checkpoint (e.g. ``{"model", "optim"}``)."""
    return {key.split(".", 1)[0] for key in read_metadata(dir).state_dict_metadata}


def save_model_and_optim_state(
    dir: str | Path,
    model: nn.Module,
    optim: torch.optim.Optimizer | None = None,
    *,
    process_group: dist.ProcessGroup | None = None,
    thread_count: int | None = None,
) -> None:
    """Save model (and optimizer) shards of every rank into the local directory ``dir``."""
    save_state_dict(
        dir,
        model_and_optim_state_dict(model, optim),
        process_group=process_group,
        thread_count=thread_count,
    )


def load_model_and_optim_state(
    dir: str | Path,
    model: nn.Module,
    optim: torch.optim.Optimizer | None = None,
    *,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Load model (and, if ``optim`` is given, optimizer) state saved with the functions here.

    Works across a change of the number of ranks and of sharding (DDP, FSDP2, one process).
    """
    if optim is not None and "optim" not in checkpoint_keys(dir):
        raise CheckpointError(
            f"{dir} holds no optimizer state; load with load_optim_state=False to load only "
            "the model weights"
        )
    state = model_and_optim_state_dict(model, optim)
    load_state_dict(dir, state, process_group=process_group)
    apply_model_and_optim_state_dict(model, optim, state)


def apply_model_and_optim_state_dict(
    model: nn.Module, optim: torch.optim.Optimizer | None, state: dict[str, Any]
) -> None:
    """Set what :func:`model_and_optim_state_dict` returned (after loading into it)."""
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))
    if optim is not None and "optim" in state:
        set_optimizer_state_dict(model, optim, state["optim"])
