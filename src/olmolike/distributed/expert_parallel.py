"""Expert parallelism, the model-independent half: its config, the ``all_to_all`` that moves
tokens between the ranks of an expert-parallel group (with its backward), and FSDP over the
data ranks that hold the same experts.

A mixture-of-experts layer's experts are split over ``degree`` ranks carved from the
data-parallel (and context-parallel) ranks (:mod:`olmolike.distributed.mesh`); each routes
its own tokens, sends every routed copy to the rank that holds its expert and gets the
result back. What splits a model's experts and routes its tokens through these collectives
is :mod:`olmolike.nn.expert_parallel`.

Every rank of a group runs the same collectives in the same order whatever its routing: one
``all_to_all`` of the per-expert counts (so each rank learns how many rows it receives),
then one of the tokens and one of the results, of uneven sizes, in forward; the two of
tokens and results again in backward. A rank that sends or receives nothing still joins
each of them with empty buffers.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from ..config import Config

__all__ = [
    "ExpertParallelConfig",
    "all_to_all",
    "clip_grads_with_norm",
    "exchange_counts",
    "grad_norm",
    "shard_experts",
]


@dataclass
class ExpertParallelConfig(Config):
    """Expert parallelism: every MoE layer's experts split over ``degree`` ranks.

    Each rank holds ``num_experts / degree`` experts of every MoE layer (their stacked
    weights sharded on dim 0) and their optimizer state, and sends each routed token copy
    to the rank of its expert and back (two ``all_to_all`` in forward, two in backward,
    plus one of the counts). The ranks are carved from the data-parallel ranks that FSDP or
    HSDP shard over (and all the context-parallel ranks): ``degree`` must be a multiple of
    the ``cp`` degree and divide ``dp_shard x cp``. Non-expert parameters stay sharded over
    all those ranks; the experts' FSDP shards over the ranks that hold the same experts.
    Worth it when the experts no longer fit FSDP's per-layer gathers, or when gathering
    every expert's weights each step costs more than moving the tokens (large ``num_experts``
    with small ``top_k``). Checkpoints do not depend on the degree.
    """

    degree: int = 1
    """Ranks per expert-parallel group; must divide every MoE layer's ``num_experts``."""

    def validate(self) -> None:
        if self.degree < 1:
            raise self._invalid("degree", f"must be >= 1, got {self.degree}")


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits whose backward is the reverse exchange."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        output_splits: list[int],
        input_splits: list[int],
        group: dist.ProcessGroup,
    ) -> Tensor:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        output_splits, input_splits = ctx.splits
        grad_in = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        dist.all_to_all_single(
            grad_in, grad.contiguous(), input_splits, output_splits, group=ctx.group
        )
        return grad_in, None, None, None


def all_to_all(
    x: Tensor, output_splits: Sequence[int], input_splits: Sequence[int], group: dist.ProcessGroup
) -> Tensor:
    """Rows ``x`` sent in ``len(input_splits)`` consecutive blocks, block ``j`` to rank ``j``
    of ``group``; returns the blocks received, ``output_splits[j]`` rows from rank ``j``, in
    rank order. Differentiable: backward sends the gradients back the same way."""
    return _AllToAll.apply(x, list(output_splits), list(input_splits), group)


def exchange_counts(counts: Tensor, group: dist.ProcessGroup) -> Tensor:
    """``counts`` ``(ranks x k,)``: the rows this rank sends for each of the ``k`` local
    experts of each rank; returns ``(ranks, k)``: what each rank sends this rank's experts."""
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    return received.view(dist.get_world_size(group), -1)


def shard_experts(
    modules: Iterable[nn.Module],
    mesh: DeviceMesh,
    *,
    policy: MixedPrecisionPolicy,
    reshard_after_forward: bool,
    averaged_ranks: int,
) -> None:
    """FSDP2 over the ranks that hold the same experts (``mesh``), one unit per experts
    module, before the blocks around them are sharded (whose units then leave them out).

    An expert's gradient on one rank already sums the contributions of every token the
    expert-parallel group routed to it (the ``all_to_all`` backward brought them), so it is
    divided by all the ranks the other gradients are averaged over (``averaged_ranks``),
    not only by those ``mesh`` reduces: every parameter's gradient is then the mean over
    the same data. Over several shards the reduction is a sum, then a division (gloo has no
    pre-scaled sum); over one shard FSDP2 skips the reduce-scatter and divides as it copies,
    and forcing the sum there would divide a second time (torch 2.13)."""
    several_shards = mesh.size(mesh.ndim - 1) > 1
    for module in modules:
        fully_shard(
            module, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward
        )
        assert isinstance(module, FSDPModule)
        module.set_gradient_divide_factor(float(averaged_ranks))
        module.set_force_sum_reduction_for_comms(several_shards)


def _by_mesh(tensors: Iterable[Any]) -> list[list[Any]]:
    """``tensors`` grouped by the mesh they live on (plain tensors together), in order."""
    groups: dict[Any, list[Tensor]] = {}
    for tensor in tensors:
        key = tensor.device_mesh if isinstance(tensor, DTensor) else None
        groups.setdefault(key, []).append(tensor)
    return list(groups.values())


def grad_norm(grads: Iterable[Tensor]) -> Tensor:
    """The L2 norm of ``grads`` over every rank's shards, as a plain tensor: plain tensors
    and DTensors on any meshes (under expert parallelism the experts' gradients live on
    another mesh than the rest, and torch's total norm cannot stack the two)."""
    norms = []
    for group in _by_mesh(grads):
        norm = torch.nn.utils.get_total_norm(group)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if len(norms) <= 1:
        return norms[0] if norms else torch.zeros(())
    return torch.stack([norm.float() for norm in norms]).square().sum().sqrt()


def clip_grads_with_norm(params: Iterable[nn.Parameter], max_norm: float, total: Tensor) -> None:
    """Scale the gradients of ``params`` so their norm ``total`` (:func:`grad_norm`) is at
    most ``max_norm``, one mesh at a time (torch's clip multiplies them all at once)."""
    for group in _by_mesh(p for p in params if p.grad is not None):
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
