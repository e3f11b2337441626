"""Data parallelism for training: DDP, FSDP2 (``fully_shard``) and HSDP, on the data dimensions
of the run's one device mesh (:mod:`olmolike.distributed.mesh`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from ..config import Config, DType, StrEnum
from ..exceptions import ConfigurationError
from .mesh import ParallelDegrees, build_device_mesh, data_parallel_mesh, sharding_mesh
from .utils import (
    get_local_world_size,
    get_world_size,
    init_single_process_group,
    is_distributed,
)

__all__ = ["DataParallelConfig", "DataParallelType", "apply_ddp", "apply_fsdp"]


class DataParallelType(StrEnum):
    """How the model is replicated or sharded across data-parallel ranks."""

    ddp = "ddp"
    """Every rank holds the whole model; gradients are all-reduced. Simplest and fastest when
    the model, its gradients and the optimizer state fit on one device."""
    fsdp = "fsdp"
    """Parameters, gradients and optimizer state are sharded over all ranks (FSDP2)."""
    hsdp = "hsdp"
    """Sharded within groups of ranks (usually a node), replicated across groups: FSDP's memory
    savings with most of the traffic on the fast intra-node links."""


@dataclass
class DataParallelConfig(Config):
    """Data parallelism: DDP, FSDP2 or HSDP, and the dtypes FSDP gathers and reduces in."""

    name: DataParallelType = DataParallelType.fsdp
    """How the data-parallel ranks hold the model: ``ddp`` (each a whole copy), ``fsdp`` (sharded
    over all) or ``hsdp`` (sharded within groups, replicated across them)."""
    param_dtype: DType | None = None
    """FSDP/HSDP: the dtype parameters are gathered in for forward and backward (e.g. bfloat16);
    the sharded master copy stays in its own dtype. ``None`` keeps the parameters' dtype."""
    reduce_dtype: DType = DType.float32
    """FSDP/HSDP: the dtype gradients are reduced in. float32 keeps the sum exact enough that
    results do not depend on the number of ranks."""
    num_replicas: int | None = None
    """HSDP: the number of replica groups; ``None`` means one per node (world size / ranks per
    node). The world size must be a multiple of it."""
    reshard_after_forward: bool = True
    """FSDP/HSDP: free gathered block parameters after forward (less memory, one more gather in
    backward)."""

    def validate(self) -> None:
        if self.name == DataParallelType.ddp and self.param_dtype is not None:
            raise self._invalid(
                "param_dtype",
                "DDP keeps parameters in their own dtype; use the train module's "
                "autocast_precision for bf16 compute, or name=fsdp",
            )
        if self.num_replicas is not None:
            if self.name != DataParallelType.hsdp:
                raise self._invalid("num_replicas", "only HSDP (name=hsdp) has replica groups")
            if self.num_replicas <= 0:
                raise self._invalid("num_replicas", f"must be positive, got {self.num_replicas}")

    def degrees(
        self,
        world_size: int,
        *,
        pp: int = 1,
        cp: int = 1,
        tp: int = 1,
        ep: int = 1,
        local_world_size: int | None = None,
    ) -> ParallelDegrees:
        """The run's degrees: the data dimensions take the ranks the other degrees leave.

        DDP replicates over all of them (``dp_replicate``); FSDP shards over all of them
        (``dp_shard``); HSDP shards within ``num_replicas`` groups, by default one group per
        node's worth of data-parallel ranks, so the shard traffic stays on a node's links
        (``local_world_size`` ranks per node; default: this node's, from the launcher).
        Expert parallelism (``ep``) is carved from the ranks FSDP/HSDP shard over.
        """
        if ep > 1 and self.name == DataParallelType.ddp:
            raise ConfigurationError(
                "expert parallelism shards the experts over data-parallel ranks that FSDP or "
                "HSDP shard over, not DDP's replicas: set it to fsdp (or hsdp)",
                path="train_module.dp_config.name",
            )
        if self.name == DataParallelType.fsdp:
            return ParallelDegrees.resolve(world_size, pp=pp, cp=cp, tp=tp, ep=ep)
        inner = pp * cp * tp
        data = ParallelDegrees.resolve(world_size, pp=pp, cp=cp, tp=tp).dp
        if self.name == DataParallelType.ddp:
            return ParallelDegrees.resolve(world_size, pp=pp, dp_replicate=data, cp=cp, tp=tp)
        local = get_local_world_size() if local_world_size is None else local_world_size
        per_node = max(1, local // (cp * tp))
        replicas = self.num_replicas or max(1, data // per_node)
        if data % replicas:
            raise ConfigurationError(
                f"the data-parallel ranks ({data} = world size {world_size} / {inner} for the "
                f"other degrees) must be a multiple of num_replicas ({replicas})",
                path="num_replicas",
            )
        return ParallelDegrees.resolve(
            world_size, pp=pp, dp_replicate=replicas, cp=cp, tp=tp, ep=ep
        )

    def data_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The sub-mesh of the run's mesh that FSDP (``dp_shard``) or HSDP (``dp_replicate``
        x ``dp_shard``) shards over; the context-parallel ranks shard with ``dp_shard``."""
        if self.name == DataParallelType.ddp:
            raise ConfigurationError("DDP needs no device mesh", path="name")
        if self.name == DataParallelType.fsdp:
            return sharding_mesh(mesh)
        return data_parallel_mesh(mesh)

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The data sub-mesh of a mesh of data parallelism alone, over all ranks (for a model
        sharded outside a train module; the train module builds one mesh for every degree)."""
        if self.name == DataParallelType.ddp:
            raise ConfigurationError("DDP needs no device mesh", path="name")
        init_single_process_group()  # a mesh needs a group; a no-op under a launcher
        return self.data_mesh(build_device_mesh(self.degrees(get_world_size()), device_type))


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
) -> None:
    """Shard ``model`` in place: each of ``model.blocks`` is its own FSDP unit, the rest the root.

    One unit per block lets the gather of block ``i + 1`` overlap the compute of block ``i``.
    The root (embeddings, final norm, head) is not resharded after forward: backward needs it
    first, right away.
    """
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    blocks = getattr(model, "blocks", ())
    # A pipeline stage keys its blocks by global layer index (a ModuleDict).
    for block in blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)


def apply_ddp(model: nn.Module, process_group: dist.ProcessGroup | None = None) -> DDP:
    """Wrap ``model`` in DDP; its state-dict keys stay those of ``model`` (we save ``model``)."""
    if not is_distributed():
        raise ConfigurationError(
            "data parallelism needs torch.distributed: call prepare_training_environment() first, "
            "or set dp_config=None for a single process",
            path="dp_config",
        )
    return DDP(model, process_group=process_group)
