"""Data parallelism for training: DDP, FSDP2 (``fully_shard``) and HSDP, and their device meshes."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from ..config import Config, DType, StrEnum
from ..exceptions import ConfigurationError
from .utils import (
    get_local_world_size,
    get_world_size,
    init_single_process_group,
    is_distributed,
)

__all__ = ["DataParallelConfig", "DataParallelType", "apply_ddp", "apply_fsdp"]

log = logging.getLogger(__name__)


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

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The device mesh for FSDP (1-D) or HSDP (2-D: replicate x shard) over all ranks."""
        if self.name == DataParallelType.ddp:
            raise ConfigurationError("DDP needs no device mesh", path="name")
        init_single_process_group()  # a mesh needs a group; a no-op under a launcher
        world = get_world_size()
        if self.name == DataParallelType.fsdp:
            return init_device_mesh(device_type, (world,), mesh_dim_names=("dp_shard",))
        replicas = self.num_replicas or max(1, world // get_local_world_size())
        if world % replicas:
            raise ConfigurationError(
                f"the world size ({world}) must be a multiple of num_replicas ({replicas})",
                path="num_replicas",
            )
        return init_device_mesh(
            device_type, (replicas, world // replicas), mesh_dim_names=("dp_replicate", "dp_shard")
        )


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
