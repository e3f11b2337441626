"""The memory planner behind ``olmolike plan``: bytes per rank for a layout, and the layouts
that fit.

Parameters, gradients, buffers and optimizer state are counted tensor by tensor from the
model built on the ``meta`` device (no memory, no accelerator), sharded the way each
parallelism shards them:

* **DDP** (``dp_replicate``) keeps full copies.
* **FSDP/HSDP** (``dp_shard``) cut every tensor along dim 0 as ``torch.chunk`` does, as FSDP2
  does: ``ceil(rows / dp_shard)`` rows per rank, the last ranks fewer (or none).
* **TP** (``tp``) splits each parameter as the tensor-parallel plan says
  (:func:`~olmolike.nn.parallel_plan.root_plan` and
  :func:`~olmolike.nn.parallel_plan.block_plan`, read here, not restated): a column-wise
  linear layer along dim 0 of its weight, a row-wise one along dim 1, a row-wise embedding
  along the vocabulary (dim 0), a feature-sharded norm along its features; what the plan
  leaves out or sequence-parallelises stays whole (a mixture of experts' router and experts
  too: they are replicated over the tensor-parallel ranks). FSDP then chunks the TP-local
  tensor (the stacked experts ``(E, ...)`` along the expert dimension).
* **CP** (``cp``) splits the sequences, not the parameters: FSDP/HSDP cut each tensor over
  ``dp_shard x cp`` ranks (the train module shards over both), DDP replicates over them.
* **EP** (``ep``, carved from ``dp_shard x cp``) splits every MoE layer's stacked experts
  evenly along the expert dimension: expert-parallel rank ``r`` (``dp_shard``'s index within
  its group of ``ep / cp``, times ``cp``, plus the ``cp`` index) holds experts ``r E/ep`` on;
  FSDP/HSDP then chunk those rows over the ``dp_shard_mod_ep`` ranks that hold the same
  experts, every other tensor over all ``dp_shard x cp`` ranks as without experts.
* **PP** (``pp``) gives each pipeline rank the stages the pipeline train module gives it
  (:class:`~olmolike.nn.transformer_stage.TransformerStage`, built here on ``meta``: stage
  ``s`` of ``pp x stages_per_rank`` on pipeline rank ``s % pp``, layers split by
  :func:`~olmolike.distributed.pipeline.split_layers`, the embedding on the first stage, the
  final norm and head on the last, a RoPE table on every stage). Pipeline ranks hold
  different bytes: :func:`state_bytes` counts any rank; the report takes the busiest.

Gradients have the parameters' shapes and dtype (FSDP casts the reduced gradient back to it).
AdamW keeps ``exp_avg`` and ``exp_avg_sq`` like each parameter plus a 4-byte float32 ``step``
per parameter tensor; SGD with momentum one buffer like each parameter. Activations follow
:mod:`olmolike.plan.activations`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from ..config_coerce import check_choice
from ..distributed.mesh import MESH_DIMS, ParallelDegrees
from ..distributed.parallel import DataParallelConfig
from ..distributed.pipeline import PipelineScheduleType, split_layers
from ..exceptions import ConfigurationError
from ..nn import TransformerConfig
from ..nn.parallel_plan import FeatureShardedNorm, block_plan, root_plan
from ..nn.transformer import Transformer
from ..nn.transformer_stage import TransformerParts, TransformerStage
from ..optim import AdamWConfig, OptimConfig, SGDConfig

__all__ = [
    "MESH_DIMS",
    "Layout",
    "StateBytes",
    "all_to_all_bytes",
    "chunk_size",
    "gathered_bytes",
    "is_expert_weight",
    "layouts",
    "rank_tensors",
    "state_bytes",
    "tensor_parallel_dims",
]

Named = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class Layout(ParallelDegrees):
    """The run's degrees (:class:`~olmolike.distributed.mesh.ParallelDegrees`, one per mesh
    dimension) and pipeline schedule, with what the planner asks of them: how the data ranks
    hold the model, a rank's place in the mesh, and a short name."""

    stages_per_rank: int = 1
    """Pipeline stages on each pipeline rank (more than 1 with interleaved 1F1B only)."""
    schedule: PipelineScheduleType = PipelineScheduleType.one_f_one_b
    """The pipeline schedule (with ``pp`` 1: none)."""
    cp_sharded: bool = True
    """With ``cp`` > 1: FSDP/HSDP shard the parameters over the context-parallel ranks too
    (the train module's FSDP and HSDP); ``False``: DDP replicates over them."""
    hsdp: bool = False
    """The config asks for HSDP: replication alone (``dp_shard`` 1) then runs as HSDP with
    one-rank shards, not as DDP."""

    def __post_init__(self) -> None:
        schedule = check_choice(self.schedule, PipelineScheduleType, "schedule")
        object.__setattr__(self, "schedule", schedule)  # frozen: a name becomes its member

    @property
    def shards(self) -> int:
        """The ranks FSDP cuts every parameter over: ``dp_shard``, with the context-parallel
        ranks when they shard too."""
        return self.dp_shard * (self.cp if self.cp_sharded else 1)

    def shard_index(self, coords: dict[str, int]) -> int:
        """The chunk of each parameter the rank at ``coords`` holds (``dp_shard`` and ``cp``
        flattened, as the train module's ``dp_shard_cp`` mesh dimension)."""
        return (
            coords["dp_shard"] * self.cp + coords["cp"] if self.cp_sharded else coords["dp_shard"]
        )

    @property
    def data_parallel(self) -> str:
        """``ddp``, ``fsdp``, ``hsdp`` or ``none``: how the data-parallel (and context-parallel)
        ranks hold the model as training runs them. Replication alone (over ``dp_replicate``,
        and the context-parallel ranks when they do not shard) is DDP, except with tensor
        parallelism (DDP does not compose with it: training runs these degrees only as HSDP
        with one-rank shards), under a pipeline (which runs them so too), or when the config
        asks for HSDP."""
        if self.shards > 1:
            return "hsdp" if self.dp_replicate > 1 else "fsdp"
        if self.dp_replicate * self.cp == 1:
            return "none"
        plain = self.tp == 1 and self.pp == 1 and not self.hsdp
        return "ddp" if plain else "hsdp"

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def stage_indices(self, pp_rank: int) -> list[int]:
        """The stages pipeline rank ``pp_rank`` runs (loop placement, as the pipeline does)."""
        return [pp_rank + k * self.pp for k in range(self.stages_per_rank)]

    def pipeline_ranks(self) -> list[int]:
        """One global rank per pipeline rank, the one whose shards are the largest (index 0
        on every other dimension: ``torch.chunk`` gives the first chunks the most rows)."""
        return [p * (self.world_size // self.pp) for p in range(self.pp)]

    def coordinates(self, rank: int) -> dict[str, int]:
        """``rank``'s index along each mesh dimension (row-major, ``tp`` fastest)."""
        coords = {}
        for name in reversed(MESH_DIMS):
            size = getattr(self, name)
            coords[name] = rank % size
            rank //= size
        return {name: coords[name] for name in MESH_DIMS}

    def expert_coordinates(self, coords: dict[str, int]) -> tuple[int, int]:
        """Under expert parallelism, (the expert-parallel rank, the index among the ranks
        holding the same experts) of the rank at ``coords``: ``dp_shard`` is laid out as
        ``dp_shard_mod_ep x dp_shard_in_ep`` (row-major), and the expert-parallel ranks are
        ``dp_shard_in_ep x cp`` flattened (see :func:`~olmolike.distributed.mesh.expert_mesh`)."""
        in_ep = self.dp_shard_in_ep
        shard = coords["dp_shard"]
        return (shard % in_ep) * self.cp + coords["cp"], shard // in_ep

    def __str__(self) -> str:
        dims = " x ".join(f"{name} {getattr(self, name)}" for name in MESH_DIMS)
        return dims + (f" (ep {self.ep})" if self.ep > 1 else "")


@dataclass(frozen=True)
class StateBytes:
    """What one rank holds between steps, in bytes."""

    params: int
    """The parameter shards the rank holds, in bytes."""
    grads: int
    """The gradients the rank holds, in bytes (like its parameters)."""
    optim: int
    """The optimizer state the rank holds, in bytes (AdamW: two moments like each parameter and a
    float32 step per tensor)."""
    buffers: int
    """Non-parameter tensors the rank holds (the RoPE tables), in bytes."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optim + self.buffers


def chunk_size(size: int, parts: int, index: int) -> int:
    """The length of chunk ``index`` of ``torch.chunk`` over ``size`` in ``parts``: what FSDP2
    (dim 0) and DTensor's ``Shard`` hold on a rank."""
    per = -(-size // parts)
    return max(0, min(per, size - index * per))


_META: dict[str, Transformer] = {}


def _meta_model(model: TransformerConfig) -> Transformer:
    """``model`` built on ``meta``: shapes and dtypes exactly as training builds them, without
    memory. Cached: a plan asks for it once per layout and pipeline rank."""
    key = repr(model)
    if key not in _META:
        _META.clear()  # one model at a time
        built = model.build(init_device="meta")
        assert isinstance(built, Transformer)
        _META[key] = built
    return _META[key]


def rank_tensors(model: TransformerConfig, layout: Layout, pp_rank: int = 0) -> tuple[Named, Named]:
    """The unsharded parameters (a tied embedding once) and buffers that pipeline rank
    ``pp_rank`` holds: the whole model's, or under PP its stages', built on ``meta`` as the
    pipeline train module builds them."""
    meta = _meta_model(model)
    if layout.pp == 1:
        return list(meta.named_parameters()), list(meta.named_buffers())
    layers = split_layers(model.n_layers, layout.num_stages)
    last = layout.num_stages - 1
    with torch.device("meta"):  # the stages' RoPE tables too: no cos and sin to compute
        stages = [
            TransformerStage(meta, layers[s], first=s == 0, last=s == last)
            for s in layout.stage_indices(pp_rank)
        ]
    buffers = [named for stage in stages for named in stage.named_buffers()]
    return list(TransformerParts(stages).named_parameters()), buffers


def _split_dim(style: ParallelStyle, module: nn.Module, param: str) -> int | None:
    """The dim of ``module``'s parameter ``param`` that tensor-parallel ``style`` shards (as
    torch's styles place them), or ``None``: replicated."""
    if isinstance(style, FeatureShardedNorm):
        return 0
    embedding = isinstance(module, nn.Embedding)
    if isinstance(style, ColwiseParallel):
        return 1 if embedding else 0
    if isinstance(style, RowwiseParallel):
        return 0 if embedding else 1 if param == "weight" else None
    return None  # sequence parallel norms, input preparation: whole on every rank


def tensor_parallel_dims(model: TransformerConfig) -> dict[str, int]:
    """Parameter name -> the dim tensor parallelism shards it along, read from
    :mod:`olmolike.nn.parallel_plan`'s plan (a parameter not named is replicated)."""
    meta = _meta_model(model)
    plans: list[tuple[str, nn.Module, dict[str, ParallelStyle]]] = [("", meta, root_plan())]
    plans += [
        (f"blocks.{i}.", b, block_plan(model.qk_norm, moe=model.is_moe_layer(int(i))))
        for i, b in meta.blocks.named_children()
    ]
    dims = {}
    for prefix, root, plan in plans:
        for path, style in plan.items():
            module = root.get_submodule(path)
            for param, _ in module.named_parameters(recurse=False):
                dim = _split_dim(style, module, param)
                if dim is not None:
                    dims[f"{prefix}{path}.{param}"] = dim
    return dims


def _local_numel(
    name: str,
    shape: tuple[int, ...],
    layout: Layout,
    coords: dict[str, int],
    tp_dims: dict[str, int],
    sharded: bool = True,
) -> int:
    """The elements rank ``coords`` holds of a tensor of ``shape``: TP first (or EP for an
    MoE layer's stacked experts), then FSDP's dim 0 (``sharded=False``: as FSDP gathers it)."""
    local = list(shape)
    if layout.ep > 1 and is_expert_weight(name):
        ep_rank, holder = layout.expert_coordinates(coords)
        local[0] = chunk_size(local[0], layout.ep, ep_rank)
        if sharded:
            local[0] = chunk_size(local[0], layout.dp_shard_mod_ep, holder)
        return math.prod(local)
    dim = tp_dims.get(name)
    if layout.tp > 1 and dim is not None:
        local[dim] = chunk_size(local[dim], layout.tp, coords["tp"])
    if sharded and layout.shards > 1 and local:
        local[0] = chunk_size(local[0], layout.shards, layout.shard_index(coords))
    return math.prod(local)


def is_expert_weight(name: str) -> bool:
    """Whether parameter ``name`` is an MoE layer's stacked routed-expert weight (what expert
    parallelism splits; a shared expert is not one)."""
    return ".experts." in name


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


def _param_bytes(model: TransformerConfig, layout: Layout, rank: int) -> list[tuple[str, int]]:
    """(name, bytes) of every parameter shard that ``rank`` holds."""
    coords = layout.coordinates(rank)
    tp_dims = tensor_parallel_dims(model) if layout.tp > 1 else {}
    params, _ = rank_tensors(model, layout, coords["pp"])
    return [
        (name, _local_numel(name, tuple(p.shape), layout, coords, tp_dims) * p.element_size())
        for name, p in params
    ]


def state_bytes(
    model: TransformerConfig, layout: Layout, optim: OptimConfig, rank: int = 0
) -> StateBytes:
    """Bytes of parameters, gradients, optimizer state and buffers that ``rank`` holds."""
    states, per_tensor = _optim_states(optim)
    shards = [size for _, size in _param_bytes(model, layout, rank)]
    params = sum(shards)
    _, buffers = rank_tensors(model, layout, layout.coordinates(rank)["pp"])
    buffer_bytes = sum(b.numel() * b.element_size() for _, b in buffers)
    return StateBytes(params, params, states * params + per_tensor * len(shards), buffer_bytes)


def layouts(gpus: int, stages_per_rank: int = 1) -> Iterator[Layout]:
    """Every ``pp x dp_replicate x dp_shard x tp`` with product ``gpus``, and with context
    parallelism (``cp`` > 1) FSDP over the data and context ranks or, without TP and PP, DDP
    over them (HSDP under context parallelism is left out: it would double the list for a rare choice); pipelines
    with ``stages_per_rank`` stages per rank."""
    divisors = [d for d in range(1, gpus + 1) if gpus % d == 0]
    for p, t, c in itertools.product(divisors, repeat=3):
        if gpus % (p * t * c):
            continue
        dp = gpus // (p * t * c)
        base = Layout(pp=p, cp=c, tp=t, stages_per_rank=stages_per_rank if p > 1 else 1)
        if c > 1:
            yield replace(base, dp_shard=dp)
            if t == p == 1:  # DDP composes with neither TP nor a pipeline
                yield replace(base, dp_replicate=dp, cp_sharded=False)
            continue
        for shard in range(1, dp + 1):
            if dp % shard == 0:
                yield replace(base, dp_replicate=dp // shard, dp_shard=shard)


def gathered_bytes(
    model: TransformerConfig, layout: Layout, dp: DataParallelConfig | None, rank: int = 0
) -> int:
    """Communication buffers of ``rank`` during a step.

    DDP: its gradient buckets, a second copy of the gradients (``gradient_as_bucket_view`` is
    off). FSDP/HSDP: the gathered roots of its stages (embedding, final norm, head: not
    resharded after forward) and two gathered blocks (the one computing and the one
    prefetched; every block of the rank with ``reshard_after_forward: false``), in
    ``param_dtype``.
    """
    if layout.data_parallel in ("ddp", "none"):
        ddp = layout.data_parallel == "ddp"
        return sum(size for _, size in _param_bytes(model, layout, rank)) if ddp else 0
    gather_dtype = dp.param_dtype.as_pt() if dp is not None and dp.param_dtype else None
    coords = layout.coordinates(rank)
    tp_dims = tensor_parallel_dims(model) if layout.tp > 1 else {}
    root = 0
    blocks: dict[str, int] = {}
    for name, p in rank_tensors(model, layout, coords["pp"])[0]:
        size = _local_numel(name, tuple(p.shape), layout, coords, tp_dims, sharded=False)
        size *= (gather_dtype or p.dtype).itemsize
        if name.startswith("blocks."):
            index = name.split(".")[1]
            blocks[index] = blocks.get(index, 0) + size
        else:
            root += size
    gathered = len(blocks) if dp is not None and not dp.reshard_after_forward else 2
    return root + sum(sorted(blocks.values(), reverse=True)[:gathered])


def all_to_all_bytes(
    model: TransformerConfig, layout: Layout, tokens: int, dtype_bytes: int
) -> int:
    """Expert parallelism's exchange buffers on a rank during one MoE layer (an estimate: they
    live one layer at a time, beside the activations): the ``top_k`` routed copies of the
    rank's ``tokens / cp`` tokens sorted for sending, the copies received, the results sent
    back and received, ``4 k d`` values per token in ``dtype_bytes``-byte elements. Received
    equals sent when the routing is balanced; a rank whose experts every rank prefers
    receives up to ``ep`` times more. 0 without expert parallelism."""
    if layout.ep == 1 or model.moe is None:
        return 0
    return 4 * -(-tokens // layout.cp) * model.moe.top_k * model.d_model * dtype_bytes
