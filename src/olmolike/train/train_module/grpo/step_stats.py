"""What a GRPO step reports about its loss: statistics summed over the step's micro-batches on
one rank, turned into the metrics the trainer reduces over the ranks.

The rollout's own metrics (rewards, lengths, generation speed) come from
:func:`.rollout.rollout`; :func:`rollout_metrics` says how each is reduced.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from ...common import ReduceType
from .loss import GRPOLossStats
from .rollout import Rollout

__all__ = ["StepStats", "rollout_metrics"]

_ROLLOUT_REDUCE = {
    "completion length/max": ReduceType.max,
    "generation seconds": ReduceType.max,
    "generation tokens/s": ReduceType.sum,
}
"""The rollout metrics that are not averaged over ranks."""
_STATS = ("KL", "clip fraction", "clip fraction/low", "clip fraction/high", "ratio", "entropy")
"""Token means over the step (every update, every rank)."""
_EXTREMES = {"clip fraction/low min": ReduceType.min, "clip fraction/high max": ReduceType.max}
"""Over every completion of the step: the smallest share of a completion's tokens clipped
low, the largest clipped high (TRL's ``clip_ratio/low_min`` and ``clip_ratio/high_max``)."""

Metric = tuple[str, "Tensor | float", ReduceType]


def rollout_metrics(out: Rollout, replicas: int) -> Iterator[Metric]:
    """The rollout's metrics with their reductions. ``replicas`` ranks hold each rollout (the
    ranks of a tensor-parallel group generate the same completions): a summed metric is
    divided by it, so the sum over all ranks counts each rollout once."""
    for name, value in out.metrics.items():
        reduce = _ROLLOUT_REDUCE.get(name, ReduceType.mean)
        yield name, value / replicas if reduce == ReduceType.sum else value, reduce


class StepStats:
    """One step's loss statistics on this rank, added up micro-batch by micro-batch (no host
    sync): the loss, the token-weighted sums of :data:`_STATS` and the completions' extremes."""

    def __init__(self, device: torch.device) -> None:
        self.sums = torch.zeros(len(_STATS) + 2, device=device)
        """The loss, then each stat times its tokens, then the tokens."""
        self.extremes = torch.full((2,), torch.inf, device=device)
        """The smallest low-clip share of a completion and the negated largest high-clip share
        (both kept as minima)."""

    def add(self, loss: Tensor, stats: GRPOLossStats, entropy: Tensor, mask: Tensor) -> None:
        """One micro-batch: its (scaled) ``loss``, :func:`.loss.grpo_loss`'s ``stats``, the mean
        ``entropy`` of its tokens and its completion ``mask``."""
        tokens = mask.sum()
        values = (stats.kl, stats.clip_fraction, stats.clip_low_fraction,
                  stats.clip_high_fraction, stats.ratio_mean, entropy)  # fmt: skip
        self.sums += torch.stack([loss.detach(), *(v * tokens for v in values), tokens])
        extremes = torch.stack([stats.clip_low_min, -stats.clip_high_max]).nan_to_num(torch.inf)
        self.extremes = torch.minimum(self.extremes, extremes)

    def loss(self, updates: int) -> Tensor:
        """The step's loss: the mean over its ``updates`` optimizer updates."""
        return self.sums[0] / updates

    def metrics(self, *, with_kl: bool) -> Iterator[Metric]:
        """Token means of the stats (``KL`` only ``with_kl``) and the clip extremes."""
        tokens = self.sums[-1].clamp(min=1.0)
        for name, value in zip(_STATS, self.sums[1:-1]):
            if name != "KL" or with_kl:
                yield name, value / tokens, ReduceType.mean
        values = (self.extremes[0], -self.extremes[1])
        for (name, reduce), value in zip(_EXTREMES.items(), values):
            yield name, value, reduce
