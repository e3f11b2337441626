"""Recording metrics on the training thread: device tensors, no sync, one host copy per interval.

A metric is *declared* by its first record: its name (and namespace), reduce type and merge
strategy are checked once then, and the record of a declared metric only stores its value.
The train module records into the :class:`MetricBuffer` directly, callbacks through
``Trainer.record_metric``: the same buffer, the same declarations. At each collect interval
:meth:`MetricBuffer.collect` stacks every pending tensor (one stack per device) and starts one
non-blocking copy to host memory; :mod:`olmolike.train.metrics` awaits it and reduces the
values across ranks on the bookkeeping thread.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..config import check_choice
from ..exceptions import MetricError
from .common import MetricMergeStrategy, ReduceType

__all__ = ["CollectedMetrics", "MetricBuffer"]

log = logging.getLogger(__name__)

MetricValue = torch.Tensor | float
_Declaration = tuple[str, str | None, ReduceType | None, MetricMergeStrategy]
"""How a metric is recorded: name, namespace, reduce type, merge strategy (as passed)."""


def metric_name(name: str, namespace: str | None) -> str:
    """The full name of metric ``name`` recorded under ``namespace``: ``namespace/name``."""
    return f"{namespace.strip()}/{name.strip()}" if namespace else name.strip()


@dataclass
class _DeviceBlock:
    """Tensor metrics from one device, stacked, with their host copy in flight."""

    keys: list[tuple[int, str]]
    host: torch.Tensor
    ready: torch.cuda.Event | None

    def values(self) -> list[float]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()


@dataclass
class CollectedMetrics:
    """The metrics of a run of steps, on their way to the host."""

    steps: list[int]
    """The steps whose metrics these are, in order."""
    reduce_types: dict[str, ReduceType | None]
    """How each metric is reduced over ranks, by name (``None``: not reduced)."""
    blocks: list[_DeviceBlock] = field(default_factory=list)
    """Tensor metrics, one stacked block per device, with their device-to-host copy in flight."""
    numbers: dict[tuple[int, str], float] = field(default_factory=dict)
    """Metrics that were already plain numbers, by (step, name)."""

    def host_values(self) -> dict[tuple[int, str], float]:
        """Wait for the device-to-host copies (off the training thread) and return all values."""
        values = dict(self.numbers)
        for block in self.blocks:
            values.update(zip(block.keys, block.values()))
        return values


class MetricBuffer:
    """Holds the metrics of steps that have not been collected yet."""

    def __init__(self) -> None:
        self._steps: dict[int, dict[str, MetricValue]] = {}
        self._reduce_types: dict[str, ReduceType | None] = {}
        self._declared: dict[_Declaration, tuple[str, MetricMergeStrategy]] = {}
        """Each way a metric was recorded, checked: its full name and merge strategy."""
        self._warned_duplicates: set[str] = set()

    def __len__(self) -> int:
        return len(self._steps)

    def begin_step(self, step: int) -> None:
        self._steps.setdefault(step, {})

    def record(
        self,
        step: int,
        name: str,
        value: MetricValue,
        reduce_type: ReduceType | None = None,
        merge_strategy: MetricMergeStrategy = MetricMergeStrategy.warn,
        *,
        namespace: str | None = None,
    ) -> None:
        """Record ``value`` as metric ``name`` (under ``namespace``) of ``step``; see
        ``Trainer.record_metric``. Checks the arguments the first time they are used together."""
        how = (name, namespace, reduce_type, merge_strategy)
        try:
            declared = self._declared.get(how)
        except TypeError:  # an unhashable choice: _declare says what is wrong with it
            declared = None
        full_name = metric_name(name, namespace) if declared is None else declared[0]
        # A float or a 0-dim tensor outside autograd is stored as it is (the common case, run
        # for every metric of every step without a call); a refused value declares nothing.
        if type(value) is not float and (
            type(value) is not torch.Tensor or value.dim() or value.requires_grad
        ):
            value = _as_metric_value(full_name, value)
        if declared is None:
            declared = self._declare(how, full_name)
        metrics = self._steps.get(step)
        if metrics is None:
            metrics = self._steps[step] = {}
        elif full_name in metrics:
            value = self._merge(full_name, step, metrics[full_name], value, declared[1])
        metrics[full_name] = value

    def _declare(self, how: _Declaration, full_name: str) -> tuple[str, MetricMergeStrategy]:
        """Check a new way of recording ``full_name``: its choices, and that it keeps the one
        reduce type the metric has for the whole run."""
        reduce_type, merge_strategy = how[2], how[3]
        if reduce_type is not None:
            reduce_type = check_choice(reduce_type, ReduceType, "reduce_type")
        merge_strategy = check_choice(merge_strategy, MetricMergeStrategy, "merge_strategy")
        previous_type = self._reduce_types.setdefault(full_name, reduce_type)
        if previous_type != reduce_type:
            raise MetricError(
                f"metric {full_name!r} was recorded with reduce_type={previous_type} and now "
                f"with {reduce_type}; a metric must keep one reduce type for the whole run"
            )
        self._declared[how] = (full_name, merge_strategy)
        return self._declared[how]

    def get(self, step: int, name: str) -> torch.Tensor | None:
        value = self._steps.get(step, {}).get(name)
        if value is None or isinstance(value, torch.Tensor):
            return value
        return torch.tensor(value)

    def collect(self) -> CollectedMetrics:
        """Take every pending step's metrics and start moving them to the host."""
        collected = CollectedMetrics(
            steps=sorted(self._steps), reduce_types=dict(self._reduce_types)
        )
        by_device: dict[torch.device, list[tuple[tuple[int, str], torch.Tensor]]] = defaultdict(
            list
        )
        for step, metrics in self._steps.items():
            for name, value in metrics.items():
                if isinstance(value, torch.Tensor):
                    by_device[value.device].append(((step, name), value))
                else:
                    collected.numbers[(step, name)] = value
        for device, items in by_device.items():
            stacked = torch.stack([t.float() for _, t in items])
            collected.blocks.append(_start_host_copy([k for k, _ in items], stacked, device))
        self._steps = {}
        return collected

    def _merge(
        self,
        name: str,
        step: int,
        old: MetricValue,
        new: MetricValue,
        strategy: MetricMergeStrategy,
    ) -> MetricValue:
        if strategy == MetricMergeStrategy.warn:
            if name not in self._warned_duplicates:
                self._warned_duplicates.add(name)
                log.warning(
                    "Metric %r was recorded twice in step %d; keeping the first value. Pass a "
                    "merge_strategy to record_metric() to merge duplicates instead.",
                    name,
                    step,
                )
            return old
        if strategy == MetricMergeStrategy.oldest:
            return old
        if strategy == MetricMergeStrategy.latest:
            return new
        if strategy in (MetricMergeStrategy.sum, MetricMergeStrategy.mean):
            total = _add(old, new)
            return total / 2 if strategy == MetricMergeStrategy.mean else total
        return _extreme(old, new, largest=strategy == MetricMergeStrategy.max)


class _RecordsMetrics(Protocol):
    """The trainer or the train module: what :func:`_record_metric` records for."""

    record_metric: Callable[..., None]

    def _metric_buffer(self) -> tuple[MetricBuffer, int]:
        """The buffer records go to, and the step they belong to."""
        ...


def _record_metric(
    self: _RecordsMetrics,
    name: str,
    value: MetricValue,
    reduce_type: ReduceType | None = None,
    namespace: str | None = None,
    merge_strategy: MetricMergeStrategy = MetricMergeStrategy.warn,
) -> None:
    """Record a metric for the current step. Tensors stay on the device (no sync). The
    arguments are checked the first time a metric is recorded with them."""
    buffer, step = self._metric_buffer()
    buffer.record(step, name, value, reduce_type, merge_strategy, namespace=namespace)


def _record_ce_loss(
    self: _RecordsMetrics, value: MetricValue, reduce_type: ReduceType | None = None
) -> None:
    """Record the cross-entropy loss, as ``train/CE loss``."""
    self.record_metric("CE loss", value, reduce_type, namespace="train")


def _as_metric_value(name: str, value: MetricValue) -> MetricValue:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise MetricError(
                f"metric {name!r} must be a scalar, got a tensor of shape {tuple(value.shape)}"
            )
        # Skip the ops when they would change nothing: this runs for every metric of every step.
        if value.requires_grad:
            value = value.detach()
        return value if value.dim() == 0 else value.reshape(())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise MetricError(f"metric {name!r} must be a number or a scalar tensor, got {value!r}")


def _add(a: MetricValue, b: MetricValue) -> MetricValue:
    # A Python number combined with a tensor goes into the kernel as a scalar argument: no
    # host-to-device copy, hence no sync.
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.device != b.device:
        b = b.to(a.device)
    return a + b


def _extreme(a: MetricValue, b: MetricValue, *, largest: bool) -> MetricValue:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        b = b.to(a.device)
        return torch.maximum(a, b) if largest else torch.minimum(a, b)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        tensor, number = (a, b) if isinstance(a, torch.Tensor) else (b, a)
        assert isinstance(tensor, torch.Tensor) and not isinstance(number, torch.Tensor)
        return tensor.clamp(min=number) if largest else tensor.clamp(max=number)
    return max(a, b) if largest else min(a, b)


def _start_host_copy(
    keys: list[tuple[int, str]], stacked: torch.Tensor, device: torch.device
) -> _DeviceBlock:
    if device.type != "cuda":
        return _DeviceBlock(keys, stacked.cpu(), None)
    host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
    host.copy_(stacked, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return _DeviceBlock(keys, host, ready)
