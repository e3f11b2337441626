"""The load of a mixture of experts' experts: max/mean imbalance per layer, from the tokens
each expert received over all ranks.

A train module records, at each metrics collection, the routed tokens of every expert of every
MoE layer since the last one (:data:`~olmolike.train.train_module.moe.EXPERT_TOKENS`, summed
over the ranks); this callback turns each layer's counts into its imbalance
(:data:`LOAD_IMBALANCE`): the most loaded expert's tokens over the mean, 1 when perfectly
balanced, ``num_experts`` when every token went to one expert. It works on the reduced values,
so the imbalance is that of the whole run's routing, not an average of each rank's. The
trainer's config adds it (as ``moe_load``) for a train module of an MoE model when none is
configured (:meth:`~olmolike.train.train_module.TrainModule.default_callbacks`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import ClassVar

from .callback import Callback

__all__ = ["LOAD_IMBALANCE", "MoELoadCallback", "expert_loads"]

LOAD_IMBALANCE = "moe/layer {layer}/load max/mean"
"""Max over mean of a layer's expert tokens (1: balanced)."""

_EXPERT_TOKENS = re.compile(r"^moe/layer (\d+)/expert (\d+) tokens$")


def expert_loads(metrics: dict[str, float]) -> dict[int, list[float]]:
    """Each layer's expert token counts found in ``metrics``, in expert order."""
    found: dict[int, dict[int, float]] = {}
    for name, value in metrics.items():
        match = _EXPERT_TOKENS.match(name)
        if match:
            found.setdefault(int(match[1]), {})[int(match[2])] = value
    return {layer: [c[e] for e in sorted(c)] for layer, c in sorted(found.items())}


@dataclass
class MoELoadCallback(Callback, name="moe_load"):
    """Adds ``moe/layer {i}/load max/mean`` to every step whose metrics hold the layer's
    expert token counts, and keeps the last counts (:attr:`last_loads`)."""

    priority: ClassVar[int] = 50
    """Before the loggers: they see the imbalance beside the counts."""

    _loads: dict[int, list[float]] = field(default_factory=dict, init=False, repr=False)

    @property
    def last_loads(self) -> dict[int, list[float]]:
        """The latest collection's tokens per expert, by layer (on every rank)."""
        return self._loads

    def pre_log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        del step
        for layer, counts in expert_loads(metrics).items():
            mean = sum(counts) / len(counts)
            if mean > 0:
                metrics[LOAD_IMBALANCE.format(layer=layer)] = max(counts) / mean
            self._loads[layer] = counts
