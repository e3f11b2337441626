"""Metric reduction and RNG-state helpers with OLMo-core's names and signatures.

The trainer itself reduces metrics through :mod:`olmolike.train.metrics` (one host sync per
collect interval, on the bookkeeping thread). These functions are the stand-alone form of the
same reduction, for code written against OLMo-core's ``olmo_core.train.utils``: they take
``{step: {name: tensor}}`` dicts and return ``{step: {name: float}}``.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..config import Config, check_choice
from ..distributed.utils import get_world_size, is_distributed
from .common import ReduceType
from .metrics import CollectedMetrics, reduce_collected

__all__ = [
    "EnvRngStates",
    "LibRngState",
    "check_metrics_consistent",
    "move_metrics",
    "reduce_metrics",
]

StepTensors = dict[int, dict[str, torch.Tensor]]

_SUMMED = (ReduceType.mean, ReduceType.sum, ReduceType.l2_norm)


@torch.no_grad()
def move_metrics(source: StepTensors, device: torch.device) -> StepTensors:
    """Move every metric tensor to ``device`` in one transfer (one stack, one copy).

    Tensors already on a device of that type are left where they are; the result keeps the
    steps and names of ``source`` in their order.
    """
    to_move = [
        (step, name, _local(value))
        for step, metrics in source.items()
        for name, value in metrics.items()
        # Compare types: "cuda" and "cuda:0" are different devices that are the same device.
        if value.device.type != device.type
    ]
    moved: dict[tuple[int, str], torch.Tensor] = {}
    if to_move:
        stacked = torch.stack([v.reshape(()) for _, _, v in to_move]).to(device)
        moved = {(step, name): stacked[i] for i, (step, name, _) in enumerate(to_move)}
    return {
        step: {name: moved.get((step, name), value) for name, value in metrics.items()}
        for step, metrics in source.items()
    }


def check_metrics_consistent(
    metrics_reduce_type: dict[str, ReduceType | None],
    process_group: dist.ProcessGroup | None = None,
) -> bool:
    """Whether every rank reduces the same set of metric names (a collective: call on all ranks).

    When they do not (e.g. a metric recorded on some ranks only), pass
    ``metrics_consistent=False`` to :func:`reduce_metrics`.
    """
    if not is_distributed():
        return True
    mine = sorted(name for name, kind in metrics_reduce_type.items() if kind is not None)
    everyone = _all_gather(mine, process_group)
    return all(names == mine for names in everyone)


@torch.no_grad()
def reduce_metrics(
    metrics: StepTensors,
    metrics_reduce_type: dict[str, ReduceType | None],
    device: torch.device,
    process_group: dist.ProcessGroup | None = None,
    metrics_consistent: bool = True,
) -> dict[int, dict[str, float]]:
    """Reduce per-step metric tensors across ranks (a collective: call on all ranks).

    ``mean`` averages over the ranks that recorded the metric at that step, ``sum`` adds,
    ``max`` takes the largest, ``min`` the smallest, ``l2_norm`` combines per-rank norms into the norm of the whole,
    and ``None`` keeps this rank's own value. It is the trainer's own reduction
    (:class:`~olmolike.train.metrics.MetricReducer`): the ranks first agree on the exact
    metric keys, then all values travel in one SUM and one MAX all-reduce.

    :param metrics_consistent: OLMo-core's flag for ranks that may record different metrics;
        accepted for compatibility: the agreement on keys covers that case either way.
    """
    del metrics_consistent
    values = {
        (step, name): float(_local(value).reshape(()).item())
        for step, step_metrics in metrics.items()
        for name, value in step_metrics.items()
    }
    collected = CollectedMetrics(
        steps=sorted(metrics),
        reduce_types={n: _reduce_type(k) for n, k in metrics_reduce_type.items()},
        numbers=values,
    )
    group = process_group or (dist.group.WORLD if is_distributed() else None)
    return reduce_collected(collected, group, device)


def _all_gather(obj: Any, process_group: dist.ProcessGroup | None) -> list[Any]:
    gathered: list[Any] = [None] * get_world_size(process_group)
    dist.all_gather_object(gathered, obj, group=process_group)
    return gathered


def _reduce_type(kind: ReduceType | str | None) -> ReduceType | None:
    return None if kind is None else check_choice(kind, ReduceType, "reduce_type")


def _local(value: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else value


# -- RNG states --------------------------------------------------------------------------------


@dataclass
class LibRngState:
    """One library's RNG state and the (major, minor) version of the library that made it."""

    version: tuple[int, int]
    """The (major, minor) version of the library that made the state; it is restored only under the
    same."""
    state: Any
    """The state as the library gives it (``random.getstate()``, a tensor, ...)."""


@dataclass
class EnvRngStates(Config):
    """The RNG states of Python, NumPy, torch and (when initialized) CUDA, together.

    A state is restored only under the same (major, minor) version of its library: the format
    of a state is not promised across versions.
    """

    python: LibRngState
    """The state of Python's ``random``."""
    numpy: LibRngState
    """The state of NumPy's global generator (``np.random``)."""
    torch: LibRngState
    """The state of torch's CPU generator."""
    cuda: LibRngState | None = None
    """The state of the current CUDA device's generator; ``None`` if CUDA was not initialized."""

    @classmethod
    def current_state(cls) -> EnvRngStates:
        cuda = None
        if (cuda_version := _cuda_version()) is not None:
            cuda = LibRngState(cuda_version, torch.cuda.get_rng_state())
        return cls(
            python=LibRngState(_python_version(), random.getstate()),
            numpy=LibRngState(_numpy_version(), np.random.get_state()),
            torch=LibRngState(_torch_version(), torch.random.get_rng_state()),
            cuda=cuda,
        )

    def restore(self) -> bool:
        """Restore every state whose library version matches; ``False`` if any was skipped."""
        restored = True
        if tuple(self.python.version) == _python_version():
            random.setstate(_as_python_state(self.python.state))
        else:
            restored = False
        if tuple(self.numpy.version) == _numpy_version():
            np.random.set_state(self.numpy.state)
        else:
            restored = False
        if tuple(self.torch.version) == _torch_version():
            torch.set_rng_state(self.torch.state)
        else:
            restored = False
        if self.cuda is not None:
            if _cuda_version() is not None and tuple(self.cuda.version) == _cuda_version():
                torch.cuda.set_rng_state(self.cuda.state)
            else:
                restored = False
        return restored


def _as_python_state(state: Any) -> Any:
    # ``random.setstate`` wants tuples; a state that went through a list-based format (JSON,
    # a config dict) comes back with lists.
    version, internal, gauss = state
    return (version, tuple(internal), gauss)


def _major_minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def _python_version() -> tuple[int, int]:
    return sys.version_info[0], sys.version_info[1]


def _numpy_version() -> tuple[int, int]:
    return _major_minor(np.__version__)


def _torch_version() -> tuple[int, int]:
    return _major_minor(torch.__version__)


def _cuda_version() -> tuple[int, int] | None:
    if torch.cuda.is_available() and torch.cuda.is_initialized() and torch.version.cuda:
        return _major_minor(torch.version.cuda)
    return None
