"""How many bytes of activations one rank keeps for backward: the planner's formula.

Counted per token of one micro-batch (``rank_microbatch_size`` tokens), from what autograd
saves in :class:`~olmolike.nn.Transformer`'s forward, with ``a`` the bytes of the compute dtype
(4 for float32, 2 for bfloat16), ``d``, ``kv`` (= ``n_kv_heads * head_dim``), ``h`` (MLP
hidden size), ``H`` (heads) and ``V`` (vocabulary)::

    block       2(8 + a)d + a(2d + 2kv + 4h) + 4(H + 2)   [+ 8(d + kv) + 8 with qk_norm]
    outside     (8 + a)d + 4 + (a + 4)V                   (final norm, logits, fp32 log-softmax)
    checkpoint  a*d                                       (a checkpointed block keeps its input)
    MoE block   the block with a(3kd + 4k h_e + 4h_s) + (a + 8)E for 4ah (ActivationBytes.of)

Each RMSNorm keeps its input and normalised value in float32 and its output in ``a`` bytes
(``8 + a`` per feature); the rest of a block keeps the rotated queries, the attention output and
the residual between attention and MLP (``2d``), rotated keys and values (``2kv``), the SwiGLU
gate, up, ``silu(gate)`` and their product (``4h``), and the fp32 log-sum-exp per head and
inverse RMS per norm (``H + 2``). No ``T x T`` score matrix: flash and memory-efficient
attention keep none (a packed-document mask of ``T x T`` booleans per sequence is not counted).
Under ``autocast_precision`` the residual stream stays float32: each block adds ``(4 + a)d``,
a checkpointed block keeps ``4d``, and the ``a``-byte copies of the weights that autocast
makes for the matmuls are kept for backward (those of checkpointed blocks are recomputed).

The peak is the larger of the end of forward (every block's part plus the outside) and, with
activation checkpointing, the backward of a checkpointed block, which recomputes all of its
activations while the logits (``aV``) are still alive. Tensor parallelism with sequence
parallelism divides all of it by ``tp`` (heads and hidden units split in the blocks, the
sequence in the norms, the vocabulary in the loss).

Under pipeline parallelism a stage keeps each micro-batch's part (its blocks', plus the
outside on the last stage, or its output hidden state, ``a*d`` (``4d`` under autocast), on
the others) from that micro-batch's forward to its backward, so the peak of a
pipeline rank is the most micro-batches its schedule has in flight at once, weighted by the
stages they are in: with ``n`` micro-batches per step, GPipe (all forwards, then all
backwards) holds all ``n``; 1F1B holds ``min(n, pp - r)`` on pipeline rank ``r`` (``pp`` on
the first, one on the last); interleaved 1F1B holds what torch's own order of its forwards
and backwards (``ScheduleInterleaved1F1B``, replayed here) keeps alive:
``min(n x v, (v - 1) x n / rounds + 2(pp - 1 - r) + 1)`` stage-micro-batches of about
``1 / (pp x v)`` of the blocks each, with ``v`` stages per rank and ``rounds =
max(1, n // pp)``. Each checkpointed block is counted at its global index (activation
checkpointing is applied before the model is cut into stages).

Under context parallelism each rank computes ``tokens / cp`` of a micro-batch's tokens
(:mod:`olmolike.nn.context_parallel`) and keeps their activations, and every block also keeps
the keys and values of the whole sequence that it all-gathered (``2 a kv`` per token of the
micro-batch, of which ``1 / cp`` is its own): ``(tokens - tokens / cp) x 2 a kv`` more per
block than its share alone, and ``a d`` per own token for the join of its two query chunks'
attention outputs; the RoPE tables at the rank's positions add ``8 head_dim`` per own token
and stage. A checkpointed block keeps only its input, and gathers the keys and values again
when its backward recomputes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from ..distributed.pipeline import PipelineScheduleType, split_layers
from ..nn import TransformerConfig
from ..train.train_module.transformer import ActivationCheckpointingConfig
from .memory import Layout

__all__ = ["ActivationBytes", "activation_bytes", "microbatches_in_flight", "pipeline_actions"]

FP32 = 4


@dataclass(frozen=True)
class ActivationBytes:
    """The formula's terms (see the module docstring): bytes per token, and per rank for the
    weight copies autocast keeps."""

    block: int
    """A block without activation checkpointing, per token."""
    checkpointed: int
    """A checkpointed block between its forward and its backward (its input), per token."""
    outside: int
    """The final norm, the logits and the loss, per token."""
    logits: int
    """The logits alone, per token: alive through backward."""
    stage_output: int
    """A pipeline stage's output hidden state, per token: kept until its backward (except on
    the last stage, whose output is the logits)."""
    block_weight_copies: int = 0
    """Autocast: the compute-dtype copies of one block's matmul weights."""
    head_weight_copy: int = 0
    """Autocast: the compute-dtype copy of the output head."""
    moe_block: int = 0
    """A mixture-of-experts block without activation checkpointing, per token (see
    :meth:`of`); its weight copies are :attr:`moe_block_weight_copies`."""
    moe_block_weight_copies: int = 0
    """Autocast: the compute-dtype copies of an MoE block's matmul weights (every expert's)."""
    keys_values: int = 0
    """A block's rotated keys and values (part of ``block``), per token: under context
    parallelism a block keeps them for every token of the sequence."""
    attention_output: int = 0
    """A block's attention output, per token: under context parallelism the two query
    chunks' outputs are joined into a new tensor for the output projection, one more copy."""
    rope_tables: int = 0
    """The float32 cos and sin at a token's position, per token and stage: under context
    parallelism they are looked up for the rank's positions (one process slices the table)."""

    @classmethod
    def of(
        cls, model: TransformerConfig, dtype_bytes: int, autocast: bool, tp: int = 1
    ) -> ActivationBytes:
        """The terms of ``model``. An MoE block keeps, instead of the dense MLP's ``4h``, the
        router's logits, float32 probabilities and log-sum-exp input (``(a + 8)E``), each
        routed copy's input, output and weighted output (``3k d``) and its expert's four
        SwiGLU values (``4k h_e``), and a shared expert's four (``4h_s``): ``a(3kd + 4k h_e
        + 4h_s) + (a + 8)E``. That part is not split by tensor parallelism (every rank routes
        every token), so it is counted ``tp`` times before the whole is divided by ``tp``."""
        a, d, h, heads = dtype_bytes, model.d_model, model.hidden_size, model.n_heads
        head = model.head_dim
        kv = model.kv_heads * head
        common = 2 * (2 * FP32 + a) * d + a * (2 * d + 2 * kv) + FP32 * (heads + 2)
        if model.qk_norm:
            common += 2 * FP32 * (d + kv) + 2 * FP32
        block, moe_block = common + a * 4 * h, common + tp * _moe_feed_forward(model, a)
        outside = (2 * FP32 + a) * d + FP32 + (a + FP32) * model.vocab_size
        split = dict(keys_values=2 * a * kv, attention_output=a * d, rope_tables=2 * FP32 * head)
        if not autocast:
            return cls(
                block, a * d, outside, a * model.vocab_size, a * d, moe_block=moe_block, **split
            )
        attention_params = 2 * d * d + 2 * d * kv
        residual = (FP32 + a) * d
        return cls(
            block + residual,
            FP32 * d,
            outside,
            a * model.vocab_size,
            FP32 * d,
            block_weight_copies=a * (attention_params + 3 * d * h),
            head_weight_copy=a * d * model.vocab_size,
            moe_block=moe_block + residual,
            moe_block_weight_copies=a * (attention_params + _moe_params(model)),
            **split,
        )

    def layer(self, model: TransformerConfig, index: int) -> tuple[int, int]:
        """Layer ``index``'s block bytes per token and its autocast weight copies."""
        if model.is_moe_layer(index):
            return self.moe_block, self.moe_block_weight_copies
        return self.block, self.block_weight_copies


def _moe_feed_forward(model: TransformerConfig, a: int) -> int:
    """What an MoE feed-forward keeps per token (see :meth:`ActivationBytes.of`)."""
    if model.moe is None:
        return 0
    k, experts, d = model.moe.top_k, model.moe.num_experts, model.d_model
    shared = model.moe.shared_expert_hidden_size or 0
    return (
        a * (3 * k * d + 4 * k * model.expert_hidden_size + 4 * shared) + (a + 2 * FP32) * experts
    )


def _moe_params(model: TransformerConfig) -> int:
    """The matmul weights of an MoE feed-forward: router, every expert, the shared expert."""
    if model.moe is None:
        return 0
    d, experts = model.d_model, model.moe.num_experts
    shared = model.moe.shared_expert_hidden_size or 0
    return experts * d + 3 * d * (experts * model.expert_hidden_size + shared)


def pipeline_actions(layout: Layout, microbatches: int, pp_rank: int) -> list[tuple[int, bool]]:
    """The (stage, is forward) computations pipeline rank ``pp_rank`` runs in one step, in
    the order its schedule runs them (without a pipeline: one micro-batch's forward, then its
    backward, as gradient accumulation runs them)."""
    n, stage = microbatches, pp_rank
    if layout.pp == 1:
        return [(0, True), (0, False)]
    if layout.schedule == PipelineScheduleType.gpipe:
        return [(stage, True)] * n + [(stage, False)] * n
    if layout.schedule == PipelineScheduleType.one_f_one_b:
        warmup = min(n, layout.pp - pp_rank)  # then one backward, one forward (torch's order)
        return (
            [(stage, True)] * warmup
            + [(stage, False), (stage, True)] * (n - warmup)
            + [(stage, False)] * warmup
        )
    # Imported here, as in distributed/pipeline.py: pipelining imports torch._dynamo.
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    rounds = max(1, n // layout.pp)
    schedule = SimpleNamespace(  # the attributes torch's interleaved order is computed from
        n_local_stages=layout.stages_per_rank,
        pp_group_size=layout.pp,
        microbatches_per_round=n // rounds,
        _n_microbatches=n,
    )
    actions = ScheduleInterleaved1F1B._calculate_single_rank_operations(schedule, pp_rank)  # type: ignore[arg-type]
    return [
        (a.stage_index, a.computation_type == _ComputationType.FORWARD)
        for a in actions
        if a is not None
    ]


def microbatches_in_flight(layout: Layout, microbatches: int, pp_rank: int) -> int:
    """The most micro-batch forwards pipeline rank ``pp_rank`` holds before their backwards
    (counted over all its stages)."""
    held = most = 0
    for _, forward in pipeline_actions(layout, microbatches, pp_rank):
        held += 1 if forward else -1
        most = max(most, held)
    return most


def _rank_peak(
    terms: ActivationBytes,
    model: TransformerConfig,
    layout: Layout,
    ac: ActivationCheckpointingConfig | None,
    tokens: int,
    microbatches: int,
    pp_rank: int,
) -> int:
    """Pipeline rank ``pp_rank``'s peak: its schedule replayed, each forward adding its
    stage's kept bytes, each backward first adding its recompute, then freeing them."""
    layers = split_layers(model.n_layers, layout.num_stages)
    last = layout.num_stages - 1
    # Context parallelism: this rank's share of the tokens; each block keeps the other ranks'
    # keys and values and one more copy of its attention output (see ActivationBytes).
    local, split = -(-tokens // layout.cp), layout.cp > 1
    gathered = (tokens - local) * terms.keys_values + split * local * terms.attention_output
    kept, recompute, weights = {}, {}, 0
    for s in layout.stage_indices(pp_rank):
        checkpointed = [terms.layer(model, i) for i in layers[s] if ac and ac.selects(i)]
        plain = [terms.layer(model, i) for i in layers[s] if not (ac and ac.selects(i))]
        outside = local * terms.outside if s == last else 0
        output = local * terms.stage_output if layout.pp > 1 and s != last else 0
        kept[s] = local * (sum(b for b, _ in plain) + len(checkpointed) * terms.checkpointed)
        kept[s] += len(plain) * gathered + outside + output + split * local * terms.rope_tables
        weights += sum(w for _, w in plain) + (terms.head_weight_copy if s == last else 0)
        recompute[s] = 0
        if checkpointed:  # one block's activations and weight copies, made again in backward
            block, copies = max(checkpointed)
            per_token = block - terms.checkpointed + (terms.logits if s == last else 0)
            made_again = local * per_token + gathered + copies
            recompute[s] = max(0, made_again - outside)
    held = peak = 0
    for stage, forward in pipeline_actions(layout, microbatches, pp_rank):
        if forward:
            held += kept[stage]
            peak = max(peak, held)
        else:
            peak = max(peak, held + recompute[stage])
            held -= kept[stage]
    return weights + peak


def activation_bytes(
    model: TransformerConfig,
    tokens: int,
    dtype_bytes: int,
    ac: ActivationCheckpointingConfig | None = None,
    *,
    autocast: bool = False,
    layout: Layout | None = None,
    microbatches: int = 1,
    pp_rank: int | None = None,
) -> int:
    """Peak activation bytes of pipeline rank ``pp_rank`` (``None``: the busiest) of
    ``layout`` for micro-batches of ``tokens`` tokens, ``microbatches`` of them per step
    (only a pipeline runs several at once). Under context parallelism ``tokens`` counts whole
    sequences, of which each rank computes ``1 / cp``."""
    layout = layout or Layout()
    terms = ActivationBytes.of(model, dtype_bytes, autocast, tp=layout.tp)
    ranks = range(layout.pp) if pp_rank is None else [pp_rank]
    peak = max(_rank_peak(terms, model, layout, ac, tokens, microbatches, r) for r in ranks)
    return -(-peak // layout.tp)
