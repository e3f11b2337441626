"""One named device mesh for every kind of parallelism a run composes.

Dimensions, outermost first: pipeline (``pp``), data replicate (``dp_replicate``), data shard
(``dp_shard``), context (``cp``), tensor (``tp``). The order puts the chattiest parallelism on
the closest ranks: tensor parallelism all-reduces activations in every layer, so its ranks are
adjacent (on one node); pipeline stages only pass activations between neighbours once per
micro-batch, so they may span nodes. Every dimension is kept even when its size is 1, so code
can always ask for ``mesh["tp"]`` or ``mesh["dp_shard"]``.

Context parallelism splits the sequences, not the parameters: its ranks hold the same
parameters and read the same batch, so FSDP shards over the data and context ranks together
(``dp_shard`` and ``cp`` flattened into ``dp_shard_cp``, as torchtitan does) and DDP averages
gradients over them (:func:`sharding_mesh`, :func:`gradient_mesh`).

Expert parallelism is carved from the data and context ranks, as torchtitan does: ``ep``
ranks (a multiple of ``cp`` that divides ``dp_shard x cp``) hold ``1 / ep`` of every MoE
layer's experts each, and exchange tokens with ``all_to_all``. The mesh then splits
``dp_shard`` into ``dp_shard_mod_ep`` (outer) and ``dp_shard_in_ep`` (inner, ``ep / cp``)
and flattens them back into ``dp_shard``, so every other parallelism sees the mesh it sees
without experts (the global rank order is the same); the expert-parallel group is
``dp_shard_in_ep x cp`` (:func:`expert_mesh`), and the experts' FSDP shards over the data
ranks left (:func:`expert_data_mesh`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..exceptions import ConfigurationError
from .utils import adopt_group, get_world_size, init_single_process_group

__all__ = [
    "DATA_DIMS",
    "MESH_DIMS",
    "ParallelDegrees",
    "build_device_mesh",
    "data_parallel_mesh",
    "expert_data_mesh",
    "expert_mesh",
    "gradient_mesh",
    "sharding_mesh",
]

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""The mesh's dimension names, outermost (farthest apart) first."""

DATA_DIMS = ("dp_replicate", "dp_shard")
"""The dimensions whose ranks see different data."""

EXPERT_SHARD_DIMS = ("dp_shard_mod_ep", "dp_shard_in_ep")
"""Under expert parallelism, the two dimensions ``dp_shard`` is made of (outermost first)."""


@dataclass(frozen=True)
class ParallelDegrees:
    """How many ranks each kind of parallelism spans; their product is the world size."""

    pp: int = 1
    """Pipeline stages."""
    dp_replicate: int = 1
    """Data-parallel replica groups (DDP, or HSDP's replicate dimension)."""
    dp_shard: int = 1
    """Data-parallel ranks that shard parameters among themselves (FSDP, HSDP's shard dimension)."""
    cp: int = 1
    """Context-parallel ranks (sequence split for attention)."""
    tp: int = 1
    """Tensor-parallel ranks (matrices split within each layer)."""
    ep: int = 1
    """Expert-parallel ranks: each holds ``1 / ep`` of every MoE layer's experts. Not a
    dimension of its own: carved from ``dp_shard x cp`` (a multiple of ``cp`` dividing it)."""

    @classmethod
    def resolve(
        cls,
        world_size: int,
        *,
        pp: int = 1,
        dp_replicate: int = 1,
        dp_shard: int = -1,
        cp: int = 1,
        tp: int = 1,
        ep: int = 1,
    ) -> ParallelDegrees:
        """The degrees for ``world_size`` ranks; ``dp_shard=-1`` takes whatever the others leave.

        :raises ConfigurationError: a degree below 1, degrees that do not multiply to the
            world size (the message shows the product), or an ``ep`` that cannot be carved
            from ``dp_shard x cp``.
        """
        fixed = {"pp": pp, "dp_replicate": dp_replicate, "cp": cp, "tp": tp}
        for name, value in fixed.items():
            if value < 1:
                raise ConfigurationError(f"the {name} degree must be >= 1, got {value}")
        if dp_shard == -1:
            rest = math.prod(fixed.values())
            if world_size % rest:
                raise ConfigurationError(
                    f"{_product_text(fixed)} = {rest} does not divide the world size "
                    f"({world_size}): choose degrees whose product divides it"
                )
            dp_shard = world_size // rest
        degrees = cls(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, ep=ep)
        degrees.check_world_size(world_size)
        degrees.check_expert_parallel()
        return degrees

    @property
    def world_size(self) -> int:
        return math.prod(self.as_dict().values())

    @property
    def dp(self) -> int:
        """Ranks that see different data: the data loader's world size."""
        return self.dp_replicate * self.dp_shard

    def dp_rank(self, rank: int) -> int:
        """The data-parallel rank of global ``rank`` in :func:`build_device_mesh`'s mesh: its
        index over (``dp_replicate``, ``dp_shard``); the data loader serves that slice. Known
        without the mesh, so a data loader can be built before the model is."""
        return (rank // (self.cp * self.tp)) % self.dp

    @property
    def dp_shard_in_ep(self) -> int:
        """The ``dp_shard`` ranks of one expert-parallel group (with all of its ``cp`` ranks)."""
        return self.ep // self.cp

    @property
    def dp_shard_mod_ep(self) -> int:
        """The ``dp_shard`` ranks that hold the same experts: the experts' FSDP shards over
        them (times ``dp_replicate`` under HSDP)."""
        return self.dp_shard // self.dp_shard_in_ep

    def check_expert_parallel(self) -> None:
        """``ep`` must be carved from ``dp_shard x cp``: a multiple of ``cp`` that divides it."""
        if self.ep < 1:
            raise ConfigurationError(f"the ep degree must be >= 1, got {self.ep}")
        if self.ep == 1:
            return
        shards = self.dp_shard * self.cp
        if self.ep % self.cp or shards % self.ep:
            raise ConfigurationError(
                f"the expert-parallel degree ({self.ep}) must be a multiple of cp ({self.cp}) "
                f"that divides dp_shard x cp ({self.dp_shard} x {self.cp} = {shards}): expert "
                "parallelism is carved from the data ranks that FSDP shards over; choose "
                "ep_config.degree accordingly",
                path="train_module.ep_config.degree",
            )

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_DIMS}

    def check_world_size(self, world_size: int) -> None:
        if min(self.as_dict().values()) < 1 or self.world_size != world_size:
            raise ConfigurationError(
                f"{_product_text(self.as_dict())} = {self.world_size}, but the world size is "
                f"{world_size}: the parallel degrees must multiply to the number of ranks"
            )


def _product_text(degrees: dict[str, int]) -> str:
    return " x ".join(f"{name} ({value})" for name, value in degrees.items())


def build_device_mesh(degrees: ParallelDegrees, device_type: str) -> DeviceMesh:
    """The 5-D mesh over all ranks, with every dimension of :data:`MESH_DIMS`, in that order.

    Starts a one-rank process group when none exists, so a plain ``python`` run gets a mesh too.
    The mesh's groups get the run's timeout, shortened with the others after the first step
    (:func:`~olmolike.distributed.utils.adopt_group`): a collective of a tensor-parallel group
    that one rank never joins then fails like any other, instead of hanging for 30 minutes.

    With expert parallelism (``degrees.ep > 1``) ``dp_shard`` is made of ``dp_shard_mod_ep``
    and ``dp_shard_in_ep`` (see the module doc): ``mesh["dp_shard"]`` is their flattening.
    """
    init_single_process_group()
    degrees.check_world_size(get_world_size())
    degrees.check_expert_parallel()
    shape = tuple(degrees.as_dict().values())
    if degrees.ep == 1:
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
        for name in MESH_DIMS:
            adopt_group(mesh.get_group(name))
        return mesh
    pp, replicate, _, cp, tp = shape
    names = ("pp", "dp_replicate", *EXPERT_SHARD_DIMS, "cp", "tp")
    split = (pp, replicate, degrees.dp_shard_mod_ep, degrees.dp_shard_in_ep, cp, tp)
    mesh = init_device_mesh(device_type, split, mesh_dim_names=names)
    for name in names:
        adopt_group(mesh.get_group(name))
    _flattened(mesh, EXPERT_SHARD_DIMS, "dp_shard")
    return mesh


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The (replicate, shard) sub-mesh: FSDP shards over its last dimension (the context
    ranks included, :func:`sharding_mesh`), HSDP over both."""
    if mesh["cp"].size() == 1:
        return mesh[DATA_DIMS]
    return DeviceMesh._concatenate([mesh["dp_replicate"], sharding_mesh(mesh)])


def sharding_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ranks FSDP shards parameters over: ``dp_shard``, with the ``cp`` ranks flattened in
    (``dp_shard_cp``) under context parallelism."""
    if mesh["cp"].size() == 1:
        return mesh["dp_shard"]
    return _flattened(mesh, ("dp_shard", "cp"), "dp_shard_cp")


def gradient_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """Every rank whose gradients DDP averages: the data ranks and the context ranks
    (``dp_cp``); the pipeline and tensor-parallel ranks hold other parameters."""
    return _flattened(mesh, (*DATA_DIMS, "cp"), "dp_cp")


def _flattened(mesh: DeviceMesh, dims: tuple[str, ...], name: str) -> DeviceMesh:
    """``dims`` of ``mesh`` as one dimension ``name`` (made once; torch keeps it), whose group
    gets the run's timeout like the mesh's own."""
    flat = mesh[dims]._flatten(name)
    adopt_group(flat.get_group())
    return flat


def expert_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The expert-parallel ranks of a mesh built with ``ep > 1``: ``dp_shard_in_ep`` with the
    ``cp`` ranks flattened in (``ep``); they hold different experts and exchange tokens."""
    if mesh["cp"].size() == 1:
        return mesh["dp_shard_in_ep"]
    return _flattened(mesh, ("dp_shard_in_ep", "cp"), "ep")


def expert_data_mesh(mesh: DeviceMesh, replicate: bool) -> DeviceMesh:
    """The ranks that hold the same experts, which the experts' FSDP shards over:
    ``dp_shard_mod_ep``, under HSDP (``replicate``) with ``dp_replicate`` outside it."""
    if replicate:
        return mesh["dp_replicate", "dp_shard_mod_ep"]
    return mesh["dp_shard_mod_ep"]
