"""Tensor parallelism for :class:`~olmolike.nn.transformer.Transformer` (Megatron-LM's split,
with sequence parallelism), applied with torch's ``parallelize_module``.

Per block: the q/k/v projections and the MLP's gate and up projections are split column-wise
(each rank computes some heads, some hidden units), the attention output and the MLP's down
projection row-wise (each rank's partial product is summed across ranks). Between the
sublayers the activations are sharded on the sequence dimension (sequence parallelism): the
RMSNorms and the residual adds then work on ``1/tp`` of the tokens, and the all-reduce of each
row-wise projection becomes a reduce-scatter, with an all-gather before the next column-wise
one. The embedding is split on the vocabulary (each rank looks up the ids it owns, the others
contribute zeros) and the head column-wise, so the logits stay sharded on the vocabulary:
:mod:`olmolike.nn.vocab_parallel` computes the loss from them without gathering a full row.

QK-norm (OLMo-2) normalises over all heads at once, so it cannot act on one rank's heads
alone: there the q/k projections hand on feature-sharded DTensors and the norm's mean of
squares is all-reduced, which keeps the result equal to the unsplit model's.

A mixture-of-experts feed-forward is not split (:class:`ReplicatedMoE`): its parameters are
replicated over the tensor-parallel ranks, which gather the sequence, each route and compute
every token, and keep their sequence shard of the result (the experts are split by expert
parallelism, not tensor parallelism). Attention is split as in a dense block.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from ..exceptions import ConfigurationError
from .moe import MoEFeedForward
from .transformer import Transformer, TransformerBlock
from .transformer_config import TransformerConfig

__all__ = [
    "FeatureShardedNorm",
    "ReplicatedMoE",
    "apply_tensor_parallel",
    "block_plan",
    "check_tensor_parallel_degree",
    "keep_embedding_gradient_sharded",
    "root_plan",
]


def check_tensor_parallel_degree(config: TransformerConfig, degree: int) -> None:
    """Every split dimension must divide evenly by the tensor-parallel degree; the error
    names the dimension that does not, and its own fix."""
    hidden = "mlp_hidden_size" if config.mlp_hidden_size is not None else "mlp_multiple_of"
    sizes = {
        "n_heads": (config.n_heads, "model.n_heads"),
        "n_kv_heads": (config.kv_heads, "model.n_kv_heads"),
    }
    if not all(config.is_moe_layer(i) for i in range(config.n_layers)):  # experts: not split
        sizes["MLP hidden size"] = (config.hidden_size, f"model.{hidden}")
    sizes["vocab_size"] = (config.vocab_size, "model.vocab_size")
    for name, (size, field) in sizes.items():
        if size % degree == 0:
            continue
        if name == "vocab_size":
            padded = -(-size // degree) * degree
            fix = f"pad model.vocab_size to a multiple of {degree} (e.g. {padded})"
        elif name == "MLP hidden size" and config.mlp_hidden_size is None:
            fix = (
                f"set model.mlp_hidden_size to a multiple of {degree} (or mlp_multiple_of, "
                f"which rounds it, to one)"
            )
        else:
            fix = f"change {field} to a multiple of {degree}"
        raise ConfigurationError(
            f"tensor parallelism over {degree} ranks splits the model's {name} ({size}) "
            f"evenly, but {degree} does not divide it; choose a tp degree that divides {size}, "
            f"or {fix}",
            path="train_module.tp_config.degree",
        )


def apply_tensor_parallel(model: Transformer, mesh: DeviceMesh) -> None:
    """Split ``model`` in place over the 1-D tensor-parallel ``mesh`` (before FSDP, which
    then shards the resulting DTensors over the data dimensions)."""
    check_tensor_parallel_degree(model.config, mesh.size())
    parallelize_module(model, mesh, root_plan())
    if model.config.tie_weights:  # each style distributed its own copy: share one again
        model.lm_head.weight = model.embeddings.weight
    for block in model.blocks:
        assert isinstance(block, TransformerBlock)
        moe = isinstance(block.feed_forward, MoEFeedForward)
        parallelize_module(block, mesh, block_plan(block.attention.q_norm is not None, moe=moe))


def root_plan() -> dict[str, ParallelStyle]:
    """The styles of the modules outside the blocks, by their names in the model."""
    sequence = Shard(1)
    return {
        "embeddings": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=sequence, use_local_output=False
        ),
        "norm": SequenceParallel(),
        "lm_head": ColwiseParallel(
            input_layouts=sequence, output_layouts=Shard(-1), use_local_output=False
        ),
    }


def block_plan(qk_norm: bool, *, moe: bool = False) -> dict[str, ParallelStyle]:
    """The styles of one block's modules, by their names in the block (the memory planner
    reads the split of every parameter from this plan and :func:`root_plan`); ``moe``: the
    block's feed-forward is a mixture of experts (:class:`ReplicatedMoE`)."""
    sequence = Shard(1)
    # The attention's arguments after x (cos, sin, mask, cache) are plain, replicated values.
    gather = PrepareModuleInput(
        input_layouts=(sequence, None, None, None, None),
        desired_input_layouts=(Replicate(), None, None, None, None),
    )
    # With QK-norm, q and k leave their projections as DTensors for the norm (see the module
    # docstring); the norm hands its rank's heads on as a plain tensor.
    projection = ColwiseParallel(use_local_output=not qk_norm)
    plan: dict[str, ParallelStyle] = {
        "attention_norm": SequenceParallel(),
        "feed_forward_norm": SequenceParallel(),
        "attention": gather,
        "attention.w_q": projection,
        "attention.w_k": projection,
        "attention.w_v": ColwiseParallel(),
        "attention.w_out": RowwiseParallel(output_layouts=sequence, use_local_output=False),
        "feed_forward": PrepareModuleInput(
            input_layouts=(sequence,), desired_input_layouts=(Replicate(),)
        ),
        "feed_forward.w_gate": ColwiseParallel(),
        "feed_forward.w_up": ColwiseParallel(),
        "feed_forward.w_down": RowwiseParallel(output_layouts=sequence, use_local_output=False),
    }
    if qk_norm:
        plan["attention.q_norm"] = FeatureShardedNorm()
        plan["attention.k_norm"] = FeatureShardedNorm()
    if moe:
        for name in [n for n in plan if n.startswith("feed_forward.")]:
            del plan[name]
        plan["feed_forward"] = ReplicatedMoE()
    return plan


def keep_embedding_gradient_sharded(model: Transformer) -> None:
    """DTensor's embedding backward returns the vocabulary-sharded table's gradient replicated
    (the whole table on every rank, held until the next step); keep this rank's rows only, as
    the weight itself: a local slice, no communication. Call it on the final parameters (after
    materialising a meta model); under FSDP the reduce-scatter shards the gradient anyway."""
    weight = model.embeddings.weight
    if isinstance(weight, DTensor):
        placements = weight.placements
        weight.register_hook(lambda grad: grad.redistribute(placements=placements))


class FeatureShardedNorm(ParallelStyle):
    """An RMSNorm over a feature dimension that is sharded across the ranks.

    Its scale is sharded like the features (``Shard(0)``); the input is a DTensor sharded on
    its last dimension, so the mean of squares over the features is a partial sum that DTensor
    all-reduces. The output is this rank's slice, as a plain tensor.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            partition_fn=partial(_place_parameters, Shard(0)),
            output_fn=_local_output,
        )


def _place_parameters(placement: Placement, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    """``distribute_module``'s ``partition_fn``: each of ``module``'s own parameters becomes a
    DTensor placed as ``placement`` says (bound with :func:`functools.partial`); one that
    is a DTensor already (experts split by expert parallelism) stays as it is."""
    del name
    for param_name, param in list(module.named_parameters(recurse=False)):
        if isinstance(param, DTensor):
            continue
        placed = nn.Parameter(distribute_tensor(param, mesh, [placement]))
        module.register_parameter(param_name, placed)


def _local_output(module: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
    del module, mesh
    return output.to_local() if isinstance(output, DTensor) else output


class ReplicatedMoE(ParallelStyle):
    """A mixture-of-experts feed-forward on every tensor-parallel rank: its parameters become
    replicated DTensors (``Replicate()``), its input the gathered sequence as a plain tensor,
    and its output, the same on every rank, is cut back to the rank's sequence shard.

    Every rank computes the same values (the layer runs on the plain local weights), so each
    parameter's gradient is the same on every rank, as ``Replicate()`` says; the sequence
    gather's backward keeps each rank's shard of the input gradient. Under expert
    parallelism the experts are already split (DTensors on the expert-parallel ranks) and
    stay so: every tensor-parallel rank holds its expert-parallel rank's experts and
    exchanges the whole sequence's tokens with the ranks of the same ``tp`` index."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            partition_fn=partial(_place_parameters, Replicate()),
            input_fn=_gather_sequence,
            output_fn=_scatter_sequence,
        )


def _gather_sequence(module: nn.Module, inputs: Any, mesh: DeviceMesh) -> Any:
    del module
    x = inputs[0]
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
    return (x.redistribute(placements=[Replicate()]).to_local(), *inputs[1:])


def _scatter_sequence(module: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
    del module
    whole = DTensor.from_local(output, mesh, [Replicate()], run_check=False)
    return whole.redistribute(placements=[Shard(1)])
