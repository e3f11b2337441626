"""``olmolike plan``'s report: one layout's bytes per rank, and the layouts that fit.

"Cheapest" means the least communication and recomputation, compared in this order:

1. fewer pipeline stages (``pp``): every stage boundary idles GPUs in the pipeline bubble, a
   share of about ``(pp - 1) / (micro-batches + pp - 1)`` of the step;
2. a smaller tensor-parallel degree (``tp``): TP all-gathers and reduce-scatters activations in
   every block, on the critical path, so it wants the fast links inside a node;
3. a smaller context-parallel degree (``cp``): CP all-gathers every block's keys and values
   (and reduce-scatters their gradients), on the critical path too, but moves ``kv / d`` of
   TP's bytes per token and keeps the matmuls whole;
4. no activation checkpointing before checkpointing: recomputing the blocks costs about a
   third more compute, always;
5. less sharding (``dp_shard``): FSDP gathers the parameters in forward and backward and
   reduce-scatters gradients, about 1.5 times DDP's traffic, but overlapped with compute.

Each layout that fits also gets the longest sequence that would fit instead, one sequence per
micro-batch with the same activation checkpointing (:func:`longest_sequence`).

Plain data parallelism (DDP: one gradient all-reduce per step, overlapped with backward) is
thus the cheapest layout where the whole model state fits on one GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..distributed.parallel import DataParallelType
from ..distributed.pipeline import PipelineParallelConfig
from ..exceptions import ConfigurationError
from ..nn import TransformerConfig
from ..train.train_module.dpo import DPOTrainModuleConfig
from ..train.train_module.layout import check_data_parallel
from ..train.train_module.transformer import (
    ActivationCheckpointingConfig,
    ActivationCheckpointingMode,
    TransformerTrainModuleConfig,
)
from .activations import activation_bytes, microbatches_in_flight
from .memory import Layout, StateBytes, all_to_all_bytes, gathered_bytes, layouts, state_bytes

__all__ = ["RankMemory", "config_layout", "longest_sequence", "plan_report", "rank_memory"]

GIB = 1024**3
FULL_AC = ActivationCheckpointingConfig(mode=ActivationCheckpointingMode.full)
MAX_ROWS = 24
_COMM = {
    "ddp": "DDP's gradient buckets",
    "fsdp": "FSDP's gathered root and blocks",
    "hsdp": "HSDP's gathered root and blocks",
    "none": "none",
}


@dataclass(frozen=True)
class RankMemory:
    """One rank's bytes under one layout and activation-checkpointing setting."""

    layout: Layout
    """The layout the rank belongs to."""
    ac: ActivationCheckpointingConfig | None
    """The activation checkpointing assumed; ``None``: none."""
    state: StateBytes
    """Parameters, gradients, optimizer state and buffers, in bytes."""
    gathered: int
    """Communication buffers during a step, in bytes: DDP's gradient buckets, or FSDP's gathered
    root and blocks."""
    activations: int
    """The activations kept for backward at the peak of a step, in bytes."""
    pp_rank: int = 0
    """The rank's pipeline rank (the rank is the first of its pipeline stage's ranks)."""
    longest: int = 0
    """The longest sequence that fits instead (:func:`longest_sequence`; 0: not computed)."""

    @property
    def total(self) -> int:
        return self.state.total + self.gathered + self.activations

    @property
    def ac_name(self) -> str:
        if self.ac is None:
            return "none"
        if self.ac.mode == ActivationCheckpointingMode.full:
            return "full"
        return f"every {self.ac.block_interval}"


def _compute_dtype_bytes(module: TransformerTrainModuleConfig, layout: Layout) -> tuple[int, bool]:
    """(bytes of the dtype blocks compute in, whether under autocast)."""
    if module.autocast_precision is not None:
        return module.autocast_precision.as_pt().itemsize, True
    dp = module.dp_config
    if layout.data_parallel in ("fsdp", "hsdp") and dp is not None and dp.param_dtype:
        return dp.param_dtype.as_pt().itemsize, False
    return 4, False  # the model's parameters are float32


def forward_tokens(module: TransformerTrainModuleConfig) -> int:
    """Tokens in one forward pass: DPO's ``rank_microbatch_size`` counts one side of its
    pairs and runs chosen and rejected together."""
    sides = 2 if isinstance(module, DPOTrainModuleConfig) else 1
    return sides * module.rank_microbatch_size


def microbatches(
    module: TransformerTrainModuleConfig, layout: Layout, global_batch_size: int | None
) -> int:
    """Micro-batches per step on each data-parallel rank: the rank batch (``global_batch_size``
    tokens over the data-parallel ranks) in ``rank_microbatch_size`` pieces; unknown, the
    fewest 1F1B runs (one per pipeline rank)."""
    if global_batch_size is None:
        return layout.pp
    return max(1, global_batch_size // (layout.dp * module.rank_microbatch_size))


def pipeline_memory(
    model: TransformerConfig,
    module: TransformerTrainModuleConfig,
    layout: Layout,
    ac: ActivationCheckpointingConfig | None,
    n_microbatches: int = 1,
) -> list[RankMemory]:
    """What each pipeline rank of ``layout`` needs (one entry without a pipeline) when
    training ``model`` as ``module`` says, with activation checkpointing ``ac`` (which may
    differ from the module's own) and ``n_microbatches`` per step."""
    dtype_bytes, autocast = _compute_dtype_bytes(module, layout)
    memories = []
    for pp_rank, rank in enumerate(layout.pipeline_ranks()):
        activations = activation_bytes(
            model,
            forward_tokens(module),
            dtype_bytes,
            ac,
            autocast=autocast,
            layout=layout,
            microbatches=n_microbatches,
            pp_rank=pp_rank,
        )
        state = state_bytes(model, layout, module.optim, rank)
        gathered = gathered_bytes(model, layout, module.dp_config, rank)
        gathered += all_to_all_bytes(model, layout, forward_tokens(module), dtype_bytes)
        memories.append(RankMemory(layout, ac, state, gathered, activations, pp_rank))
    return memories


def rank_memory(
    model: TransformerConfig,
    module: TransformerTrainModuleConfig,
    layout: Layout,
    ac: ActivationCheckpointingConfig | None,
    n_microbatches: int = 1,
) -> RankMemory:
    """The busiest rank of ``layout`` (:func:`pipeline_memory`)."""
    return max(pipeline_memory(model, module, layout, ac, n_microbatches), key=lambda m: m.total)


def config_layout(
    module: TransformerTrainModuleConfig,
    gpus: int,
    gpus_per_node: int,
    tp: int,
    pp: int,
    cp: int = 1,
    ep: int = 1,
) -> Layout:
    """The layout the train module's ``dp_config`` gives on ``gpus`` GPUs, with ``tp``/``pp``
    (and ``pp_config``'s schedule), ``cp`` and ``ep`` (carved from FSDP/HSDP's ranks, as
    training carves it)."""
    layout = _data_layout(module, gpus, gpus_per_node, tp, pp, cp)
    if ep == 1:
        return layout
    if module.dp_config is None or module.dp_config.name == DataParallelType.ddp:
        raise ConfigurationError(
            f"--ep {ep}: expert parallelism is carved from the ranks FSDP or HSDP shard over; "
            "set --train_module.dp_config.name=fsdp (or hsdp)"
        )
    layout = replace(layout, ep=ep)
    layout.check_expert_parallel()
    return layout


def _data_layout(
    module: TransformerTrainModuleConfig, gpus: int, gpus_per_node: int, tp: int, pp: int, cp: int
) -> Layout:
    """:func:`config_layout` without expert parallelism."""
    for flag, degree in (("--tp", tp), ("--pp", pp), ("--cp", cp)):
        if degree < 1 or gpus % degree:
            raise ConfigurationError(
                f"{flag} {degree} does not divide --gpus {gpus}; pick a divisor of {gpus}"
            )
    if gpus % (tp * pp * cp):
        raise ConfigurationError(
            f"--tp {tp} x --pp {pp} x --cp {cp} = {tp * pp * cp} does not divide --gpus "
            f"{gpus}; pick degrees whose product divides {gpus}"
        )
    schedule = _schedule(module, pp)
    dp_ranks = gpus // (tp * pp * cp)
    dp = module.dp_config
    if dp is None or dp.name == DataParallelType.ddp:
        # A pipeline replicates with FSDP2, which shards over the context ranks.
        layout = Layout(pp=pp, dp_replicate=dp_ranks, cp=cp, tp=tp, cp_sharded=pp > 1)
        check_data_parallel(layout, dp)  # as training refuses DDP with tensor parallelism
        return replace(layout, **schedule)
    if dp.name == DataParallelType.fsdp:
        return Layout(pp=pp, dp_shard=dp_ranks, cp=cp, tp=tp, **schedule)
    replicas = dp.num_replicas or max(1, gpus // gpus_per_node)
    if dp_ranks % replicas:
        raise ConfigurationError(
            f"HSDP's {replicas} replica groups do not divide the {dp_ranks} data-parallel "
            f"ranks of --gpus {gpus}; set --train_module.dp_config.num_replicas to a divisor "
            f"of {dp_ranks} or change --gpus-per-node"
        )
    shard = dp_ranks // replicas
    return Layout(pp=pp, dp_replicate=replicas, dp_shard=shard, cp=cp, tp=tp, hsdp=True, **schedule)


def _schedule(module: TransformerTrainModuleConfig, pp: int) -> dict[str, Any]:
    """The config's pipeline schedule and stages per rank (1F1B without ``pp_config``)."""
    config = module.pp_config or PipelineParallelConfig()
    return {"schedule": config.schedule, "stages_per_rank": config.local_stages if pp > 1 else 1}


def _splits_heads(model: TransformerConfig, tp: int) -> bool:
    return bool(model.n_heads % tp or model.kv_heads % tp)


def _pipeline_refusal(
    model: TransformerConfig, module: TransformerTrainModuleConfig, layout: Layout, n: int
) -> str | None:
    """Why training refuses ``layout``'s pipeline (``None``: it runs), as the fix to print."""
    if layout.pp == 1:
        return None
    if module.pipeline_refusal:
        return f"{type(module).__name__} does not run pipelined: {module.pipeline_refusal}"
    if model.tie_weights:
        return "a pipeline cannot tie the embedding to the head; set model.tie_weights=false"
    if layout.num_stages > model.n_layers:
        return (
            f"--pp {layout.pp} x {layout.stages_per_rank} stages per rank is more pipeline "
            f"stages than the model's {model.n_layers} blocks; pick --pp <= "
            f"{model.n_layers // layout.stages_per_rank}"
        )
    pipeline = PipelineParallelConfig(
        degree=layout.pp, schedule=layout.schedule, stages_per_rank=layout.stages_per_rank
    )
    try:
        pipeline.check_microbatches(n)
    except ConfigurationError as e:
        return str(e)
    return None


def _context_refusal(module: TransformerTrainModuleConfig, layout: Layout) -> str | None:
    """Why training refuses ``layout``'s context parallelism (``None``: it runs)."""
    if layout.cp > 1 and module.context_parallel_refusal:
        return (
            f"{type(module).__name__} does not run under context parallelism: "
            f"{module.context_parallel_refusal}"
        )
    return None


def _expert_refusal(model: TransformerConfig, layout: Layout) -> str | None:
    """Why training refuses ``layout``'s expert parallelism for ``model`` (``None``: it runs)."""
    if layout.ep == 1:
        return None
    if model.moe is None:
        return f"--ep {layout.ep}: the model has no MoE layer to split; set --ep 1"
    if model.moe.num_experts % layout.ep:
        return (
            f"--ep {layout.ep} must divide num_experts ({model.moe.num_experts}): every "
            "expert-parallel rank holds the same number of experts"
        )
    return None


def check_model_split(
    model: TransformerConfig, module: TransformerTrainModuleConfig, layout: Layout, n: int
) -> None:
    """Refuse a TP degree that splits attention heads, or a pipeline or context parallelism
    training refuses."""
    refusal = _context_refusal(module, layout) or _expert_refusal(model, layout)
    if refusal:
        raise ConfigurationError(refusal)
    if _splits_heads(model, layout.tp):
        raise ConfigurationError(
            f"tensor parallelism {layout.tp} must divide n_heads ({model.n_heads}) and "
            f"n_kv_heads ({model.kv_heads}) so that no head is split; pick --tp among "
            f"{', '.join(map(str, _tp_choices(model)))}"
        )
    refusal = _pipeline_refusal(model, module, layout, n)
    if refusal:
        raise ConfigurationError(refusal)


def _tp_choices(model: TransformerConfig) -> list[int]:
    return [t for t in range(1, model.kv_heads + 1) if model.kv_heads % t == 0]


def fitting(
    model: TransformerConfig,
    module: TransformerTrainModuleConfig,
    gpus: int,
    limit: int,
    global_batch_size: int | None = None,
) -> tuple[list[RankMemory], RankMemory | None]:
    """The cheapest way each layout of ``gpus`` fits in ``limit`` bytes, cheapest first; and
    if none fits, the layout that comes closest. Pipelines run the config's schedule (1F1B
    without ``pp_config``); with the config's ``ep_config``, the layouts its expert
    parallelism can be carved from (FSDP/HSDP)."""
    options: list[ActivationCheckpointingConfig | None] = [None, FULL_AC]
    if module.ac_config is not None and module.ac_config.mode != ActivationCheckpointingMode.full:
        options.insert(1, module.ac_config)
    schedule = _schedule(module, pp=2)
    ep = module.ep_config.degree if module.ep_config else 1
    fits, closest = [], None
    for candidate in layouts(gpus, schedule["stages_per_rank"]):
        layout = _with_experts(replace(candidate, schedule=schedule["schedule"]), ep)
        if layout is None or _expert_refusal(model, layout):
            continue
        n = microbatches(module, layout, global_batch_size)
        if _splits_heads(model, layout.tp) or _pipeline_refusal(model, module, layout, n):
            continue
        if _context_refusal(module, layout):
            continue
        for ac in options:
            ranks = pipeline_memory(model, module, layout, ac, n)
            memory = max(ranks, key=lambda m: m.total)
            if memory.total <= limit:
                longest = longest_sequence(model, module, layout, ac, limit, n, ranks)
                fits.append(replace(memory, longest=longest))
                break
            if closest is None or memory.total < closest.total:
                closest = memory
    fits.sort(
        key=lambda m: (
            m.layout.pp, m.layout.tp, m.layout.cp, options.index(m.ac), m.layout.dp_shard,
            m.layout.cp_sharded,
        )
    )  # fmt: skip
    return fits, None if fits else closest


def _with_experts(layout: Layout, ep: int) -> Layout | None:
    """``layout`` with expert parallelism ``ep``; ``None`` where training would refuse it."""
    if ep == 1:
        return layout
    if layout.data_parallel not in ("fsdp", "hsdp") or not layout.cp_sharded:
        return None
    if ep % layout.cp or (layout.dp_shard * layout.cp) % ep:
        return None
    return replace(layout, ep=ep)


def longest_sequence(
    model: TransformerConfig,
    module: TransformerTrainModuleConfig,
    layout: Layout,
    ac: ActivationCheckpointingConfig | None,
    limit: int,
    n_microbatches: int = 1,
    ranks: list[RankMemory] | None = None,
) -> int:
    """The longest sequence, in tokens, that fits ``limit`` bytes on every rank of ``layout``
    with activation checkpointing ``ac`` when a micro-batch is that one sequence (two for
    DPO's pairs): the state and buffers stay, the activations grow with it. A multiple of
    ``2 x cp x tp`` (what training pads a sequence to); 0 if not even that fits. The RoPE
    tables are counted at the model's ``max_sequence_length``. ``ranks``: the layout's
    :func:`pipeline_memory` with ``ac``, if already computed."""
    dtype_bytes, autocast = _compute_dtype_bytes(module, layout)
    sides = forward_tokens(module) // module.rank_microbatch_size
    ranks = ranks or pipeline_memory(model, module, layout, ac, n_microbatches)

    def spare(units: int, m: RankMemory) -> int:
        """Bytes left on ``m``'s rank with sequences of ``units x step`` tokens."""
        activations = activation_bytes(
            model, sides * units * step, dtype_bytes, ac, autocast=autocast, layout=layout,
            microbatches=n_microbatches, pp_rank=m.pp_rank,
        )  # fmt: skip
        return limit - m.state.total - m.gathered - activations

    step = 2 * layout.cp * layout.tp
    # The activations grow linearly with the tokens (to a byte: the formula rounds up once).
    units = min(spare(1, m) // max(1, spare(1, m) - spare(2, m)) + 1 for m in ranks)
    while units > 0 and min(spare(units, m) for m in ranks) < 0:
        units -= 1
    return max(0, units) * step


_MOE_FORMULA = "; an MoE block a(3kd+4k h_e+4h_s)+(a+8)E for 4ah, not divided by tp"


def _gib(n: int) -> str:
    return f"{n / GIB:9.3f}"


def _pipeline_lines(layout: Layout, n: int, ranks: list[RankMemory]) -> list[str]:
    """Under a pipeline: its schedule, and each pipeline rank's total and micro-batches in
    flight (the ranks of different stages hold different bytes)."""
    if layout.pp == 1:
        return []
    per_rank = "; ".join(
        f"pp {m.pp_rank}: {m.total / GIB:.3f} GiB, "
        f"{microbatches_in_flight(layout, n, m.pp_rank)} in flight"
        for m in ranks
    )
    return [
        f"pipeline: {layout.schedule}, {layout.stages_per_rank} stage(s) per rank, {n} "
        f"micro-batches per step; per pipeline rank (as configured): {per_rank}"
    ]


def plan_report(
    model: TransformerConfig,
    module: TransformerTrainModuleConfig,
    layout: Layout,
    gpu_memory_gib: float,
    reserve_gib: float,
    global_batch_size: int | None = None,
) -> str:
    """The text ``olmolike plan`` prints; ``global_batch_size`` (tokens per step) gives a
    pipeline its micro-batch count."""
    n = microbatches(module, layout, global_batch_size)
    check_model_split(model, module, layout, n)
    limit = int((gpu_memory_gib - reserve_gib) * GIB)
    if limit <= 0:
        raise ConfigurationError(
            f"--gpu-memory {gpu_memory_gib:g} GiB leaves nothing after --reserve "
            f"{reserve_gib:g} GiB; give the GPU's memory in GiB (80 for an H100)"
        )
    configured = pipeline_memory(model, module, layout, module.ac_config, n)
    busiest = max(configured, key=lambda m: m.total)
    plain = pipeline_memory(model, module, layout, None, n)[busiest.pp_rank]
    checkpointed = pipeline_memory(model, module, layout, module.ac_config or FULL_AC, n)
    checkpointed_busiest = checkpointed[busiest.pp_rank]
    dtype_bytes, autocast = _compute_dtype_bytes(module, layout)
    lines = [
        f"model: {model.num_params():,} parameters"
        + (f" ({model.num_active_params():,} active per token)" if model.moe else "")
        + f"; {forward_tokens(module):,} tokens per "
        f"forward pass on each rank; activations in {dtype_bytes}-byte dtype"
        + (" (autocast)" if autocast else ""),
        f"layout from the config: {layout} ({layout.data_parallel} on "
        f"{layout.world_size} GPUs); bytes of the busiest rank, GiB:",
        f"  parameters        {_gib(plain.state.params)}",
        f"  gradients         {_gib(plain.state.grads)}",
        f"  optimizer state   {_gib(plain.state.optim)}   ({type(module.optim).__name__})",
        f"  buffers           {_gib(plain.state.buffers)}   (RoPE tables)",
        f"  comm buffers      {_gib(plain.gathered)}   ({_COMM[layout.data_parallel]}"
        + (", the all-to-all of one MoE layer at balanced routing" if layout.ep > 1 else "")
        + ")",
        f"  activations       {_gib(plain.activations)}   without activation checkpointing",
        f"                    {_gib(checkpointed_busiest.activations)}   with "
        f"{checkpointed_busiest.ac_name} "
        "activation checkpointing",
        f"  total             {_gib(busiest.total)}   (activation checkpointing: "
        f"{busiest.ac_name}, as configured)",
        *_pipeline_lines(layout, n, configured),
        f"longest sequence that fits in {gpu_memory_gib:g} GiB (one per micro-batch): "
        f"{longest_sequence(model, module, layout, None, limit, n):,} tokens without "
        f"activation checkpointing, "
        f"{longest_sequence(model, module, layout, checkpointed_busiest.ac, limit, n):,} with "
        f"{checkpointed_busiest.ac_name}",
        "activations per token: block 2(8+a)d + a(2d+2kv+4h) + 4(H+2); outside the blocks "
        "(8+a)d + 4 + (a+4)V; a checkpointed block a*d; divided by tp; under a pipeline, times "
        "the micro-batches its schedule holds (GPipe n, 1F1B pp - r on pipeline rank r); under "
        "context parallelism for 1/cp of the tokens, and each block keeps every token's keys "
        "and values 2a*kv" + (_MOE_FORMULA if model.moe else "") + " (docs/memory-planner.md)",
    ]
    if type(module) is not TransformerTrainModuleConfig:
        lines.append(
            f"note: this counts the trained model only; {type(module).__name__}'s other "
            "models (a frozen reference, rollouts) come on top"
        )
    fits, closest = fitting(model, module, layout.world_size, limit, global_batch_size)
    if not fits:
        assert closest is not None
        raise ConfigurationError(
            f"no layout of {layout.world_size} GPUs fits in {gpu_memory_gib:g} GiB "
            f"(less {reserve_gib:g} GiB reserve): the closest, {closest.layout} with "
            f"{closest.ac_name} activation checkpointing, needs {closest.total / GIB:.2f} GiB "
            "per GPU; add GPUs, use larger GPUs or lower train_module.rank_microbatch_size"
        )
    schedule = _schedule(module, pp=2)
    lines.append(
        f"layouts that fit in {gpu_memory_gib:g} GiB less {reserve_gib:g} GiB reserve, "
        f"cheapest (least communication and recomputation) first; pipelines run "
        f"{schedule['schedule']} with {schedule['stages_per_rank']} stage(s) per rank"
        + (f", experts split over ep {layout.ep} ranks (no DDP)" if layout.ep > 1 else "")
        + ":"
    )
    lines.append(
        "data-par is the dp_config each row trains with (hsdp's num_replicas: dp_replicate); "
        "replication alone runs as DDP without tp or pp, else as hsdp with one-rank shards"
    )
    lines.append(
        "     pp  dp_replicate  dp_shard   cp   tp  data-par  act-ckpt   GiB/GPU   longest seq"
    )
    for m in fits[:MAX_ROWS]:
        lo = m.layout
        lines.append(
            f"  {lo.pp:5d} {lo.dp_replicate:13d} {lo.dp_shard:9d} {lo.cp:4d} {lo.tp:4d}  "
            f"{lo.data_parallel:8s}  {m.ac_name:8s} {m.total / GIB:9.3f} {m.longest:13,d}"
        )
    if len(fits) > MAX_ROWS:
        lines.append(f"  ... and {len(fits) - MAX_ROWS} more")
    return "\n".join(lines) + "\n"
