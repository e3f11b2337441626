"""The memory planner behind ``olmolike plan``: bytes per rank for a layout, and the layouts
that fit.

Parameters, gradients, buffers and optimizer state are counted tensor by tensor from the
model built on the ``meta`` device (no memory, no accelerator), sharded the way each
parallelism shards them:

* **DDP** (``dp_replicate``) keeps full copies.
* **FSDP/HSDP** (``dp_shard``) cut every tensor along dim 0 as ``torch.chunk`` does, as FSDP2
  does: ``ceil(rows / dp_shard)`` rows per rank, the last ranks fewer (or none).
* **TP** (``tp``) splits the matrices it parallelises: column-wise (dim 0) the attention's
  ``w_q``/``w_k``/``w_v``, the MLP's ``w_gate``/``w_up`` and the vocabulary-parallel
  ``lm_head``; row-wise (dim 1) ``w_out`` and ``w_down``; the embedding by vocabulary (dim 0).
  QK-norm weights are split with their heads; the other norms stay whole. FSDP then chunks
  the TP-local tensor.
* **PP** (``pp``) puts each stage's blocks on its ranks (:func:`stage_layers`), the embedding
  on the first stage, the final norm and head on the last (a tied embedding on both).

Gradients have the parameters' shapes and dtype (FSDP casts the reduced gradient back to it).
AdamW keeps ``exp_avg`` and ``exp_avg_sq`` like each parameter plus a 4-byte float32 ``step``
per parameter tensor; SGD with momentum one buffer like each parameter. Activations follow
:mod:`olmolike.train.activation_memory`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..distributed.mesh import MESH_DIMS, ParallelDegrees
from ..distributed.parallel import DataParallelConfig
from ..exceptions import ConfigurationError
from ..nn import TransformerConfig
from ..optim import AdamWConfig, OptimConfig, SGDConfig
from .activation_memory import stage_layers

__all__ = [
    "MESH_DIMS",
    "Layout",
    "StateBytes",
    "busiest_rank_state",
    "chunk_size",
    "gathered_bytes",
    "layouts",
    "model_tensors",
    "state_bytes",
]

_COLWISE = frozenset({"w_q", "w_k", "w_v", "w_gate", "w_up", "lm_head", "embeddings"})
_ROWWISE = frozenset({"w_out", "w_down"})
_FEATURE_SHARDED = frozenset({"q_norm", "k_norm"})  # QK-norm weights follow their heads
_FIRST_STAGE = frozenset({"embeddings"})
_LAST_STAGE = frozenset({"norm", "lm_head"})


@dataclass(frozen=True)
class Layout(ParallelDegrees):
    """The run's degrees (:class:`~olmolike.distributed.mesh.ParallelDegrees`, one per mesh
    dimension) with what the planner asks of them: how the data ranks hold the model, a rank's
    place in the mesh, and a short name."""

    @property
    def data_parallel(self) -> str:
        """``ddp``, ``fsdp``, ``hsdp`` or ``none``: how the data-parallel ranks hold the model."""
        if self.dp_shard > 1:
            return "hsdp" if self.dp_replicate > 1 else "fsdp"
        return "ddp" if self.dp_replicate > 1 else "none"

    def coordinates(self, rank: int) -> dict[str, int]:
        """``rank``'s index along each mesh dimension (row-major, ``tp`` fastest)."""
        coords = {}
        for name in reversed(MESH_DIMS):
            size = getattr(self, name)
            coords[name] = rank % size
            rank //= size
        return {name: coords[name] for name in MESH_DIMS}

    def __str__(self) -> str:
        return " x ".join(f"{name} {getattr(self, name)}" for name in MESH_DIMS if name != "cp")


@dataclass(frozen=True)
class StateBytes:
    """What one rank holds between steps, in bytes."""

    params: int
    grads: int
    optim: int
    buffers: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optim + self.buffers


def chunk_size(size: int, parts: int, index: int) -> int:
    """The length of chunk ``index`` of ``torch.chunk`` over ``size`` in ``parts``: what FSDP2
    (dim 0) and DTensor's ``Shard`` hold on a rank."""
    per = -(-size // parts)
    return max(0, min(per, size - index * per))


def _module_name(param_name: str) -> str:
    """``blocks.0.attention.w_q.weight`` -> ``w_q``; ``norm.weight`` -> ``norm``."""
    parts = param_name.split(".")
    return parts[-2] if len(parts) > 1 else parts[0]


def _on_stage(name: str, model: TransformerConfig, pp: int, stage: int) -> int:
    """How many copies of parameter or buffer ``name`` pipeline stage ``stage`` of ``pp``
    holds (a tied embedding: the first stage's and the last stage's head)."""
    last = stage == pp - 1
    if name.startswith("blocks."):
        index = int(name.split(".")[1])
        first = sum(stage_layers(model.n_layers, pp, s) for s in range(stage))
        return int(first <= index < first + stage_layers(model.n_layers, pp, stage))
    top = name.split(".")[0]
    if top in _FIRST_STAGE:
        return int(stage == 0) + int(last and pp > 1 and model.tie_weights)
    if top in _LAST_STAGE:
        return int(last)
    return 1  # the RoPE tables: every stage runs blocks


def _local_numel(name: str, shape: tuple[int, ...], layout: Layout, coords: dict[str, int]) -> int:
    """The shape rank ``coords`` holds of a tensor of ``shape``: TP first, then FSDP's dim 0."""
    local = list(shape)
    module = _module_name(name)
    if layout.tp > 1 and len(local) == 2:
        dim = 0 if module in _COLWISE else 1 if module in _ROWWISE else None
        if dim is not None:
            local[dim] = chunk_size(local[dim], layout.tp, coords["tp"])
    elif layout.tp > 1 and module in _FEATURE_SHARDED:
        local[0] = chunk_size(local[0], layout.tp, coords["tp"])
    if layout.dp_shard > 1 and local:
        local[0] = chunk_size(local[0], layout.dp_shard, coords["dp_shard"])
    return math.prod(local)


_TENSORS: dict[str, tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]] = {}


def model_tensors(
    model: TransformerConfig,
) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    """The model's parameters (a tied embedding once) and buffers, built on ``meta``: shapes
    and dtypes exactly as training builds them, without memory. Cached: a plan asks for them
    once per layout."""
    key = repr(model)
    if key not in _TENSORS:
        meta = model.build(init_device="meta")
        _TENSORS.clear()  # one model at a time
        _TENSORS[key] = list(meta.named_parameters()), list(meta.named_buffers())
    return _TENSORS[key]


def _optim_states(optim: OptimConfig) -> tuple[int, int]:
    """(states like each parameter, extra bytes per parameter tensor) of ``optim``."""
    if isinstance(optim, AdamWConfig):
        return 2, 4  # exp_avg, exp_avg_sq; step is a float32 scalar tensor
    if isinstance(optim, SGDConfig):
        return (1 if optim.momentum else 0), 0
    raise ConfigurationError(
        f"the planner knows the optimizer state of AdamWConfig and SGDConfig, not "
        f"{type(optim).__name__}; plan with --train_module.optim._CLASS_=AdamWConfig",
        path="train_module.optim",
    )


def state_bytes(
    model: TransformerConfig, layout: Layout, optim: OptimConfig, rank: int = 0
) -> StateBytes:
    """Bytes of parameters, gradients, optimizer state and buffers that ``rank`` holds."""
    coords = layout.coordinates(rank)
    states, per_tensor = _optim_states(optim)
    params, buffers = model_tensors(model)
    param_bytes = optim_bytes = 0
    for name, p in params:
        copies = _on_stage(name, model, layout.pp, coords["pp"])
        numel = _local_numel(name, tuple(p.shape), layout, coords)
        param_bytes += copies * numel * p.element_size()
        optim_bytes += copies * (states * numel * p.element_size() + per_tensor)
    buffer_bytes = sum(
        b.numel() * b.element_size()
        for name, b in buffers
        if _on_stage(name, model, layout.pp, coords["pp"])
    )
    return StateBytes(param_bytes, param_bytes, optim_bytes, buffer_bytes)


def busiest_rank_state(model: TransformerConfig, layout: Layout, optim: OptimConfig) -> StateBytes:
    """The state of the rank that holds the most (rank 0's shards are the largest; the
    pipeline stage varies)."""
    ranks = (stage * (layout.world_size // layout.pp) for stage in range(layout.pp))
    return max((state_bytes(model, layout, optim, rank) for rank in ranks), key=lambda s: s.total)


def layouts(gpus: int) -> Iterator[Layout]:
    """Every ``pp x dp_replicate x dp_shard x tp`` with product ``gpus`` (``cp`` 1)."""
    for p in range(1, gpus + 1):
        for t in range(1, gpus // p + 1):
            if gpus % (p * t):
                continue
            dp = gpus // (p * t)
            for shard in range(1, dp + 1):
                if dp % shard == 0:
                    yield Layout(pp=p, dp_replicate=dp // shard, dp_shard=shard, tp=t)


def gathered_bytes(
    model: TransformerConfig, layout: Layout, dp: DataParallelConfig | None, state: StateBytes
) -> int:
    """Communication buffers of the rank that holds ``state``, during a step.

    DDP: its gradient buckets, a second copy of the gradients (``gradient_as_bucket_view`` is
    off). FSDP/HSDP: the gathered root (embedding, final norm, head: not resharded after
    forward) and two gathered blocks (the one computing and the one prefetched; every block
    of the stage with ``reshard_after_forward: false``), in ``param_dtype``; as rank 0 of the
    busiest stage.
    """
    if layout.data_parallel in ("ddp", "none"):
        return state.grads if layout.data_parallel == "ddp" else 0
    whole = Layout(pp=layout.pp, tp=layout.tp)  # the same ranks without the dp_shard cut
    gather_dtype = dp.param_dtype.as_pt() if dp is not None and dp.param_dtype else None
    per_stage = []
    for stage in range(layout.pp):
        coords = {**layout.coordinates(0), "pp": stage}
        root = block = 0
        for name, p in model_tensors(model)[0]:
            dtype = gather_dtype or p.dtype
            size = _local_numel(name, tuple(p.shape), whole, coords) * dtype.itemsize
            if name.startswith("blocks.0."):
                block += size
            elif not name.startswith("blocks."):
                root += size * _on_stage(name, model, layout.pp, stage)
        layers = stage_layers(model.n_layers, layout.pp, stage)
        gathered = layers if dp is not None and not dp.reshard_after_forward else min(2, layers)
        per_stage.append(root + gathered * block)
    return max(per_stage)
