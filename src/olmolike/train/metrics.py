"""Per-step metrics: recorded as device tensors, moved to the host once per collect interval.

Recording a metric never synchronizes with the device. At each collect interval the trainer
calls :meth:`MetricBuffer.collect`, which stacks every pending tensor (one stack per device)
and starts one non-blocking copy to host memory. The copy is awaited and the values reduced
across ranks by :func:`reduce_collected`, which runs on the bookkeeping thread.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..config import check_choice
from ..exceptions import MetricError
from .common import MetricMergeStrategy, ReduceType

__all__ = ["CollectedMetrics", "FlopCounter", "MetricBuffer", "MetricReducer", "reduce_collected"]

log = logging.getLogger(__name__)

MetricValue = torch.Tensor | float
StepMetrics = dict[int, dict[str, float]]


def metric_name(name: str, namespace: str | None) -> str:
    return f"{namespace.strip()}/{name.strip()}" if namespace else name.strip()


@dataclass
class FlopCounter:
    """The petaflops of trained tokens (the trainer's ``global_train_petaflops``), from the
    train module's FLOPs per token, asked once per sequence length."""

    flops_per_token: Callable[[int], int | None]
    """FLOPs per trained token at a sequence length; ``None`` if unknown."""
    known: dict[int, int | None] = field(default_factory=dict)
    """FLOPs per token already asked for, by sequence length (``None``: the train module cannot
    tell)."""

    def petaflops(self, seq_len: int, tokens: int) -> float:
        if seq_len not in self.known:
            self.known[seq_len] = self.flops_per_token(seq_len)
        per_token = self.known[seq_len]
        return 0.0 if per_token is None else per_token * tokens / 1e15


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
    ) -> None:
        value = _as_metric_value(name, value)
        if reduce_type is not None:
            reduce_type = check_choice(reduce_type, ReduceType, "reduce_type")
        merge_strategy = check_choice(merge_strategy, MetricMergeStrategy, "merge_strategy")
        previous_type = self._reduce_types.setdefault(name, reduce_type)
        if previous_type != reduce_type:
            raise MetricError(
                f"metric {name!r} was recorded with reduce_type={previous_type} and now with "
                f"{reduce_type}; a metric must keep one reduce type for the whole run"
            )
        metrics = self._steps.setdefault(step, {})
        if name in metrics:
            value = self._merge(name, step, metrics[name], value, merge_strategy)
        metrics[name] = value

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


# -- cross-rank reduction (runs on the bookkeeping thread) -------------------------------------

_Key = tuple[int, str, str]  # (step, name, reduce type)


class MetricReducer:
    """Reduces collected metrics across ranks; one per trainer, used by the bookkeeping thread.

    It remembers the reduce type every metric was agreed with, so that a metric recorded as
    ``mean`` on one rank and as ``sum`` on another raises :class:`MetricError` even when the two
    records fall in different steps or collections.
    """

    def __init__(self) -> None:
        self._agreed_types: dict[str, str] = {}

    def __call__(
        self,
        collected: CollectedMetrics,
        group: dist.ProcessGroup | None,
        device: torch.device,
    ) -> StepMetrics:
        """Reduce ``collected`` across ``group`` and return ``{step: {name: value}}``.

        Every rank issues the same collectives in the same order, whatever it recorded (a rank
        with nothing still joins): an exchange of the exact metric keys, then one SUM and one
        MAX all-reduce over their union.
        """
        values = collected.host_values()
        result: StepMetrics = {step: {} for step in collected.steps}
        reduced: dict[_Key, float] = {}
        for (step, name), value in values.items():
            reduce_type = collected.reduce_types.get(name)
            if reduce_type is None:
                result[step][name] = value
            else:
                reduced[(step, name, str(reduce_type))] = value
        distributed = group is not None and dist.is_initialized() and dist.get_world_size(group) > 1
        if not distributed:  # one rank: its values are the reduced values
            keys = sorted(reduced)  # the order of several ranks
            self._check_types([keys])
            values_out = [reduced[k] for k in keys]
        else:
            keys = self._agree_on_keys(sorted(reduced), group)
            values_out = _reduce_values(keys, reduced, group, device)
        for (step, name, _), value in zip(keys, values_out):
            result.setdefault(step, {})[name] = value
        return result

    def _agree_on_keys(self, local: list[_Key], group: dist.ProcessGroup | None) -> list[_Key]:
        """The union of every rank's keys, compared exactly (no digest that could collide)."""
        gathered: list[list[_Key] | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, local, group=group)
        per_rank = [keys or [] for keys in gathered]
        self._check_types(per_rank)
        return sorted({key for keys in per_rank for key in keys})

    def _check_types(self, per_rank: list[list[_Key]]) -> None:
        """Raise if a metric has two reduce types, across ranks, steps or collections."""
        types: dict[str, set[str]] = defaultdict(set)
        for keys in per_rank:
            for _, name, reduce_type in keys:
                types[name].add(reduce_type)
        for name, agreed in self._agreed_types.items():
            if name in types:
                types[name].add(agreed)
        conflicts = {name: sorted(kinds) for name, kinds in types.items() if len(kinds) > 1}
        if conflicts:
            details = "; ".join(
                f"{name!r}: {', '.join(k)}" for name, k in sorted(conflicts.items())
            )
            raise MetricError(
                f"metrics were recorded with different reduce types on different ranks or "
                f"steps ({details}); a metric must keep one reduce type on every rank for "
                "the whole run"
            )
        for name, kinds in types.items():
            self._agreed_types[name] = next(iter(kinds))


def reduce_collected(
    collected: CollectedMetrics,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> StepMetrics:
    """Reduce ``collected`` once, with no memory of earlier collections (see MetricReducer)."""
    return MetricReducer()(collected, group, device)


def _reduce_values(
    keys: list[_Key],
    local: dict[_Key, float],
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> list[float]:
    extreme = (ReduceType.max, ReduceType.min)
    summed = [k for k in keys if k[2] not in extreme]
    maxed = [k for k in keys if k[2] in extreme]
    sign = {k: -1.0 if k[2] == ReduceType.min else 1.0 for k in maxed}  # min(x) = -max(-x)
    # Sums carry a presence count per key, so a mean is over the ranks that recorded it.
    sum_values = torch.tensor(
        [_sum_term(k, local) for k in summed] + [1.0 if k in local else 0.0 for k in summed],
        dtype=torch.float64,
        device=device,
    )
    max_values = torch.tensor(
        [sign[k] * local.get(k, sign[k] * -math.inf) for k in maxed],
        dtype=torch.float64,
        device=device,
    )
    if summed:
        dist.all_reduce(sum_values, op=dist.ReduceOp.SUM, group=group)
    if maxed:
        dist.all_reduce(max_values, op=dist.ReduceOp.MAX, group=group)
    totals, counts = sum_values[: len(summed)].tolist(), sum_values[len(summed) :].tolist()
    out = {k: sign[k] * v for k, v in zip(maxed, max_values.tolist())}
    for key, total, count in zip(summed, totals, counts):
        if key[2] == ReduceType.mean:
            out[key] = total / count
        elif key[2] == ReduceType.l2_norm:
            out[key] = math.sqrt(total)
        else:
            out[key] = total
    return [out[k] for k in keys]


def _sum_term(key: _Key, local: dict[_Key, float]) -> float:
    value = local.get(key)
    if value is None:
        return 0.0
    return value**2 if key[2] == ReduceType.l2_norm else value
