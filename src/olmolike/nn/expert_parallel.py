"""Expert parallelism for olmolike's mixture-of-experts layers (:mod:`olmolike.nn.moe`).

:func:`apply_expert_parallel` splits every MoE layer's stacked expert weights on dim 0 over
the ranks of an expert-parallel mesh (``Shard(0)`` DTensors: rank ``r`` of ``n`` holds
experts ``r E/n`` to ``(r + 1) E/n - 1``) and gives the layer an
:class:`ExpertParallelDispatcher`, which replaces the local dispatch (a stable sort by
expert) with an exchange between the ranks:

1. each rank sorts its routed token copies by expert (so by destination rank), as one
   process does, and sends every rank how many copies it has for each of that rank's
   experts (one ``all_to_all`` of ``E`` counts);
2. the copies go to their experts' ranks (``all_to_all`` of uneven sizes), where they are
   regrouped by local expert (the copies from rank 0 first within an expert, then rank 1's,
   ...) and computed;
3. the results go back the same way and are put in token order.

The router, the auxiliary losses and the routing statistics stay on the rank that routes
the tokens: they see its tokens exactly as without expert parallelism. Every rank runs
the same three collectives per forward (two in backward) whatever its routing; the counts
are moved to the host once per layer to size the exchange (a sync on an accelerator).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from ..distributed.expert_parallel import all_to_all, exchange_counts
from ..exceptions import ConfigurationError
from .moe import Dispatched, Experts, MoEFeedForward, TokenDispatcher

__all__ = ["ExpertParallelDispatcher", "apply_expert_parallel"]


@dataclass
class _Exchanged(Dispatched):
    """A dispatch across ranks: what :meth:`ExpertParallelDispatcher.combine` undoes."""

    regroup: Tensor
    """``(received,)`` the received row (grouped by source rank, then local expert) that
    each row of ``tokens`` (grouped by local expert, then source rank) is."""
    sent: list[int]
    """Rows sent to each rank of the group (and received back from it by the combine)."""
    received: list[int]
    """Rows received from each rank (and sent back to it)."""


class ExpertParallelDispatcher(TokenDispatcher):
    """Sends routed copies to the ranks of ``group`` that hold their experts and the
    results back (see the module doc); ``group``'s rank ``r`` holds experts ``r E/n`` on."""

    def __init__(self, num_experts: int, group: dist.ProcessGroup) -> None:
        super().__init__(num_experts)
        self.group = group
        self.ranks = dist.get_world_size(group)
        self.local_experts = num_experts // self.ranks

    def dispatch(self, x: Tensor, experts: Tensor, counts: Tensor) -> Dispatched:
        # Grouped by expert, so by destination rank, in token order within a group.
        order = torch.argsort(experts.reshape(-1), stable=True)
        tokens = x.index_select(0, order // experts.shape[-1])
        per_source = exchange_counts(counts, self.group)  # (ranks, local experts)
        sizes = torch.stack([counts.view(self.ranks, -1).sum(1), per_source.sum(1)])
        sent, received = sizes.tolist()  # the exchange's sizes, on the host
        arrived = all_to_all(tokens, received, sent, self.group)
        # Regroup the arrivals (by source, then expert) by expert, then source: stable.
        local_expert = torch.arange(self.local_experts, device=x.device).repeat(self.ranks)
        row_expert = local_expert.repeat_interleave(
            per_source.reshape(-1), output_size=sum(received)
        )
        regroup = torch.argsort(row_expert, stable=True)
        return _Exchanged(
            tokens=arrived.index_select(0, regroup),
            tokens_per_expert=per_source.sum(0),
            order=order,
            regroup=regroup,
            sent=sent,
            received=received,
        )

    def combine(self, expert_out: Tensor, dispatched: Dispatched, shape: torch.Size) -> Tensor:
        assert isinstance(dispatched, _Exchanged)
        by_source = expert_out.new_empty(expert_out.shape)
        by_source = by_source.index_copy(0, dispatched.regroup, expert_out)
        returned = all_to_all(by_source, dispatched.sent, dispatched.received, self.group)
        return super().combine(returned, dispatched, shape)


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh) -> list[Experts]:
    """Split the experts of every MoE layer of ``model`` over ``mesh`` (1-D: the
    expert-parallel ranks) and route the layers' tokens through them; returns the
    :class:`~olmolike.nn.moe.Experts` modules (for FSDP over the ranks that hold the same
    experts). Works on a ``meta`` model (materialised afterwards, shard by shard).

    :raises ConfigurationError: ``model`` has no MoE layer, or a layer's experts do not
        split evenly over the ranks.
    """
    layers = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    if not layers:
        raise ConfigurationError(
            f"expert parallelism splits the experts of a mixture of experts; "
            f"{type(model).__name__} has no MoE layer: set ep_config=null",
            path="train_module.ep_config",
        )
    ranks = mesh.size()
    for layer in layers:
        if layer.num_experts % ranks:
            raise ConfigurationError(
                f"the expert-parallel degree ({ranks}) must divide num_experts "
                f"({layer.num_experts}): every rank holds the same number of experts",
                path="train_module.ep_config.degree",
            )
        experts = layer.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            sharded = nn.Parameter(
                distribute_tensor(param.data, mesh, [Shard(0)]), requires_grad=param.requires_grad
            )
            experts.register_parameter(name, sharded)
        layer.dispatcher = ExpertParallelDispatcher(layer.num_experts, mesh.get_group())
    return [layer.experts for layer in layers]
