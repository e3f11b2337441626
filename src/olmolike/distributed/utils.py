"""Process-group set-up and rank helpers that also work when torch.distributed is not in use."""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from ..exceptions import ConfigurationError

__all__ = [
    "backend_supports_cpu",
    "barrier",
    "broadcast_object",
    "get_local_rank",
    "get_local_world_size",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_distributed",
    "is_shared_filesystem",
    "launched_distributed",
    "set_shared_filesystem",
]

log = logging.getLogger(__name__)

_SHARED_FS_ENV = "OLMOLIKE_SHARED_FILESYSTEM"


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if is_distributed() else 0


def get_world_size(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if is_distributed() else 1


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_local_world_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", str(get_world_size())))


def launched_distributed() -> bool:
    """Whether a launcher (torchrun, srun wrappers, ...) set up rank environment variables."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def backend_supports_cpu(group: dist.ProcessGroup | None = None) -> bool:
    """Whether collectives on CPU tensors work on ``group`` (e.g. gloo is part of the backend)."""
    if not is_distributed():
        return False
    return "gloo" in str(dist.get_backend(group))


def _resolve_backend(backend: str) -> str:
    """Drop the CUDA half of a ``cpu:X,cuda:Y`` backend when there is no GPU."""
    if torch.cuda.is_available() or "cuda" not in backend:
        return backend
    cpu_parts = [p.strip() for p in backend.split(",") if p.strip().startswith("cpu:")]
    if not cpu_parts:
        raise ConfigurationError(
            f"backend {backend!r} needs CUDA, which is not available; use 'gloo' on CPU",
            path="backend",
        )
    return cpu_parts[0].split(":", 1)[1]


def init_distributed(backend: str, timeout: datetime.timedelta) -> None:
    """Initialize the default process group from the launcher's environment variables."""
    if is_distributed():
        return
    resolved = _resolve_backend(backend)
    if torch.cuda.is_available() and "nccl" in resolved:
        torch.cuda.set_device(get_local_rank())
    dist.init_process_group(backend=resolved, timeout=timeout)


def barrier(group: dist.ProcessGroup | None = None) -> None:
    if is_distributed():
        dist.barrier(group)


def broadcast_object(obj: Any, src: int = 0, group: dist.ProcessGroup | None = None) -> Any:
    """Broadcast a picklable object from ``src``. Only use on values this program produced."""
    if not is_distributed():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src, group=group)
    return holder[0]


def set_shared_filesystem(shared: bool | None) -> None:
    if shared is not None:
        os.environ[_SHARED_FS_ENV] = "1" if shared else "0"


def is_shared_filesystem() -> bool:
    """Whether local paths are visible to every rank.

    True when the user said so, or when every rank runs on this node.
    """
    explicit = os.environ.get(_SHARED_FS_ENV)
    if explicit is not None:
        return explicit == "1"
    return get_local_world_size() == get_world_size()
