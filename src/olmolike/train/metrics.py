"""Collected metrics reduced across ranks, on the bookkeeping thread.

Metrics are recorded into a :class:`~olmolike.train.metric_buffer.MetricBuffer` as device
tensors, with no sync; at each collect interval it stacks them and starts one host copy. The
copy is awaited and the values reduced across ranks by :class:`MetricReducer` (or
:func:`reduce_collected`), which runs on the bookkeeping thread.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist

from ..exceptions import MetricError
from .common import ReduceType
from .metric_buffer import CollectedMetrics, MetricBuffer

__all__ = [
    "CollectedMetrics",  # from metric_buffer: their names before it had a module of its own
    "MetricBuffer",
    "MetricReducer",
    "reduce_collected",
]

StepMetrics = dict[int, dict[str, float]]


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
                reduced[(step, name, reduce_type.value)] = value
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
