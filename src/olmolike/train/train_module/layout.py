"""The parallel layout of a transformer train module: one device mesh, and the model split on it.

The mesh (:mod:`olmolike.distributed.mesh`) has every dimension, outermost first: ``pp``,
``dp_replicate``, ``dp_shard``, ``cp``, ``tp``. Tensor parallelism splits each layer over the
innermost dimension; context parallelism splits every sequence over ``cp`` (the model computes
its rank's tokens, :mod:`olmolike.nn.context_parallel`); FSDP/HSDP then shard those (possibly
already split) parameters over the data dimensions and ``cp`` together; DDP replicates over
them and averages gradients over both. The ranks of one tensor- or context-parallel group see
the same batch, so the data loader, the micro-batch agreement and the loss's token count use
the data-parallel group (:attr:`ParallelLayout.dp_process_group`), never the global ranks.

Expert parallelism (``ep``) is carved from the ``dp_shard x cp`` ranks: each MoE layer's
experts are split over ``ep`` of them (:mod:`olmolike.nn.expert_parallel`), and FSDP/HSDP
shard the experts over the data ranks that hold the same experts
(:func:`~olmolike.distributed.mesh.expert_data_mesh`), every other parameter over all of
them as without experts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from ...distributed.expert_parallel import shard_experts
from ...distributed.mesh import (
    DATA_DIMS,
    ParallelDegrees,
    build_device_mesh,
    expert_data_mesh,
    expert_mesh,
    gradient_mesh,
)
from ...distributed.parallel import DataParallelConfig, DataParallelType, apply_fsdp
from ...distributed.utils import adopt_group, get_world_size, is_distributed
from ...exceptions import ConfigurationError
from ...nn.context_parallel import ContextParallel, apply_context_parallel
from ...nn.expert_parallel import apply_expert_parallel
from ...nn.moe import Experts
from ...nn.parallel_plan import apply_tensor_parallel, keep_embedding_gradient_sharded
from ...nn.transformer import Transformer
from .train_module import data_parallel_group

__all__ = ["ParallelLayout", "check_data_parallel"]

log = logging.getLogger(__name__)


def check_data_parallel(degrees: ParallelDegrees, dp_config: DataParallelConfig | None) -> None:
    """Refuse what no train module runs: DDP (``dp_config`` ``ddp``, or unset, on several
    data-parallel or context-parallel ranks) with tensor parallelism. The memory planner asks the same,
    so that it lists only layouts that train."""
    # An unset dp_config runs DDP on several data (or context-parallel) ranks.
    if dp_config is None:
        ddp = degrees.dp * degrees.cp > 1
    else:
        ddp = dp_config.name == DataParallelType.ddp
    if degrees.tp > 1 and ddp:
        raise ConfigurationError(
            "tensor parallelism composes with FSDP or HSDP over the data (and "
            "context-parallel) ranks, not with DDP: set train_module.dp_config.name=fsdp "
            "(or hsdp)",
            path="train_module.dp_config.name",
        )


@dataclass
class ParallelLayout:
    """The degrees of every parallelism of a run, its mesh, and its data-parallel group."""

    degrees: ParallelDegrees
    """How many ranks each dimension of the mesh spans."""
    dp_config: DataParallelConfig | None
    """The data parallelism in force: ``None`` on one data-parallel rank without FSDP."""
    mesh: DeviceMesh | None
    """The run's mesh; ``None`` when nothing shards (one process, or DDP alone)."""
    dp_process_group: dist.ProcessGroup | None
    """The ranks that see different batches: a group whenever distributed (the default group
    when that is all ranks), ``None`` only on one process."""
    context_parallel: ContextParallel | None = None
    """How sequences are split over the ``cp`` ranks; ``None`` without context parallelism."""

    @classmethod
    def build(
        cls,
        degrees: ParallelDegrees,
        dp_config: DataParallelConfig | None,
        device: torch.device,
        dp_process_group: dist.ProcessGroup | None = None,
    ) -> ParallelLayout:
        """The layout for ``degrees`` (already checked against the world size)."""
        given = dp_process_group
        dp_process_group = data_parallel_group(given)
        if dp_config is None and degrees.dp * degrees.cp > 1:
            dp_config = DataParallelConfig(name=DataParallelType.ddp)
            log.info(
                "dp_config is unset on %d data-parallel x %d context-parallel ranks: using DDP",
                degrees.dp,
                degrees.cp,
            )
        check_data_parallel(degrees, dp_config)
        ddp = dp_config is not None and dp_config.name == DataParallelType.ddp
        split = degrees.world_size // degrees.dp > 1
        if split and given is not None:
            raise ConfigurationError(
                "with tensor parallelism the data-parallel group comes from the device mesh; "
                "build the train module without dp_process_group",
                path="train_module",
            )
        if not split and (dp_config is None or ddp):
            return cls(degrees, dp_config, None, dp_process_group)
        mesh = build_device_mesh(degrees, device.type)
        if not split:  # the data dimensions span every rank: the default group is the group
            return cls(degrees, dp_config, mesh, dp_process_group)
        dp_group = mesh[DATA_DIMS]._flatten("dp").get_group()
        adopt_group(dp_group)
        cp = None
        if degrees.cp > 1:
            cp = ContextParallel(mesh["cp"].get_group(), multiple_of=degrees.tp)
        return cls(degrees, dp_config, mesh, dp_group, cp)

    @property
    def dp_world_size(self) -> int:
        return get_world_size(self.dp_process_group) if is_distributed() else 1

    @property
    def averaged_ranks(self) -> int:
        """How many ranks' gradients DDP or FSDP average: the data-parallel ranks times the
        context-parallel ranks (each holds a share of the tokens). A loss normalised by the
        global token count is multiplied by it, so that the average is the sum."""
        return self.dp_world_size * self.degrees.cp

    @property
    def gradient_group(self) -> dist.ProcessGroup | None:
        """The group DDP averages gradients over: the data-parallel group, with the
        context-parallel ranks in it under context parallelism."""
        if self.context_parallel is None:
            return self.dp_process_group
        assert self.mesh is not None
        return gradient_mesh(self.mesh).get_group()

    @property
    def sharded(self) -> bool:
        """Whether FSDP/HSDP shard the parameters over the data dimensions."""
        return self.dp_config is not None and self.dp_config.name != DataParallelType.ddp

    @property
    def ddp(self) -> bool:
        return self.dp_config is not None and self.dp_config.name == DataParallelType.ddp

    def finish(self, model: nn.Module, *, sharded: bool | None = None) -> None:
        """What needs the model's final parameters (after a meta model is materialised).
        ``sharded``: whether FSDP/HSDP sharded it (default :attr:`sharded`; a pipeline, which
        runs DDP as FSDP2 replication and no FSDP on one data rank, says which it did)."""
        sharded = self.sharded if sharded is None else sharded
        if self.degrees.tp > 1 and not sharded and isinstance(model, Transformer):
            keep_embedding_gradient_sharded(model)

    def shard(self, model: nn.Module) -> None:
        """Expert, tensor and context parallelism, then FSDP/HSDP: the model's parameters
        become DTensors on the mesh (on the ``meta`` device too: they are materialised shard
        by shard afterwards)."""
        self.expert_parallel(model)  # first: tensor parallelism replicates the rest of a layer
        self.tensor_parallel(model)
        self.split_sequences(model)
        if self.sharded:
            assert self.dp_config is not None
            self.fully_shard(model, self.dp_config)

    def tensor_parallel(self, model: nn.Module) -> None:
        """Split ``model``'s layers over the ``tp`` dimension (nothing when its size is 1). A
        pipeline splits the whole model before it cuts it into stages: each stage then holds
        its layers' tensor-parallel shards."""
        if self.degrees.tp == 1:
            return
        assert self.mesh is not None
        if not isinstance(model, Transformer):
            raise ConfigurationError(
                f"tensor parallelism splits olmolike's Transformer; {type(model).__name__} "
                "has no tensor-parallel plan: set tp_config.degree=1",
                path="train_module.tp_config",
            )
        apply_tensor_parallel(model, self.mesh["tp"])

    def split_sequences(self, model: nn.Module) -> None:
        """Make ``model`` compute its rank's share of every sequence over the ``cp`` dimension
        (nothing when its size is 1); a pipeline does it before cutting the model into stages."""
        if self.context_parallel is None:
            return
        if not isinstance(model, Transformer):
            raise ConfigurationError(
                f"context parallelism splits the attention of olmolike's Transformer; "
                f"{type(model).__name__} has none: set cp_config.degree=1",
                path="train_module.cp_config",
            )
        apply_context_parallel(model, self.context_parallel.group, tensor_parallel=self.degrees.tp)

    def expert_parallel(self, model: nn.Module) -> None:
        """Split every MoE layer's experts over the expert-parallel ranks (nothing when
        ``ep`` is 1); a pipeline does it before cutting the model into stages."""
        if self.degrees.ep == 1:
            return
        assert self.mesh is not None
        apply_expert_parallel(model, expert_mesh(self.mesh))

    def fully_shard(self, module: nn.Module, dp: DataParallelConfig) -> None:
        """FSDP/HSDP per ``dp`` over the data dimensions: ``module`` (the model, or one
        pipeline stage) becomes an FSDP root, each of its blocks its own unit; under expert
        parallelism each MoE layer's experts are a unit first, over the ranks that hold the
        same experts."""
        assert self.mesh is not None
        if self.degrees.ep > 1:
            shard_experts(
                [m for m in module.modules() if isinstance(m, Experts)],
                expert_data_mesh(self.mesh, replicate=dp.name == DataParallelType.hsdp),
                policy=MixedPrecisionPolicy(
                    param_dtype=dp.param_dtype.as_pt() if dp.param_dtype else None,
                    reduce_dtype=dp.reduce_dtype.as_pt(),
                ),
                reshard_after_forward=dp.reshard_after_forward,
                averaged_ranks=self.averaged_ranks,
            )
        apply_fsdp(
            module,
            dp.data_mesh(self.mesh),
            param_dtype=dp.param_dtype.as_pt() if dp.param_dtype else None,
            reduce_dtype=dp.reduce_dtype.as_pt(),
            reshard_after_forward=dp.reshard_after_forward,
        )
