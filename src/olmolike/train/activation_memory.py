"""How many bytes of activations one rank keeps for backward: the planner's formula.

Counted per token of one micro-batch (``rank_microbatch_size`` tokens), from what autograd
saves in :class:`~olmolike.nn.Transformer`'s forward, with ``a`` the bytes of the compute dtype
(4 for float32, 2 for bfloat16), ``d``, ``kv`` (= ``n_kv_heads * head_dim``), ``h`` (MLP
hidden size), ``H`` (heads) and ``V`` (vocabulary)::

    block       2(8 + a)d + a(2d + 2kv + 4h) + 4(H + 2)   [+ 8(d + kv) + 8 with qk_norm]
    outside     (8 + a)d + 4 + (a + 4)V                   (final norm, logits, fp32 log-softmax)
    checkpoint  a*d                                       (a checkpointed block keeps its input)

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
activations while the logits (``aV``, held by the training loop) are still alive. Tensor
parallelism with sequence parallelism divides all of it by ``tp`` (heads and hidden units
split in the blocks, the sequence in the norms, the vocabulary in the loss). Under pipeline
parallelism with 1F1B, stage ``s`` of ``pp`` keeps ``pp - s`` micro-batches of its own blocks
in flight; the planner reports the busiest stage.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..nn import TransformerConfig
from .train_module.transformer import ActivationCheckpointingConfig

__all__ = ["ActivationBytes", "activation_bytes", "checkpointed_blocks", "stage_layers"]

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
    """The logits alone, per token: the training loop holds them through backward."""
    block_weight_copies: int = 0
    """Autocast: the compute-dtype copies of one block's matmul weights."""
    head_weight_copy: int = 0
    """Autocast: the compute-dtype copy of the output head."""

    @classmethod
    def of(cls, model: TransformerConfig, dtype_bytes: int, autocast: bool) -> ActivationBytes:
        a, d, h, heads = dtype_bytes, model.d_model, model.hidden_size, model.n_heads
        kv = model.kv_heads * model.head_dim
        block = 2 * (2 * FP32 + a) * d + a * (2 * d + 2 * kv + 4 * h) + FP32 * (heads + 2)
        if model.qk_norm:
            block += 2 * FP32 * (d + kv) + 2 * FP32
        outside = (2 * FP32 + a) * d + FP32 + (a + FP32) * model.vocab_size
        if not autocast:
            return cls(block, a * d, outside, a * model.vocab_size)
        matmul_params = 2 * d * d + 2 * d * kv + 3 * d * h
        return cls(
            block + (FP32 + a) * d,
            FP32 * d,
            outside,
            a * model.vocab_size,
            block_weight_copies=a * matmul_params,
            head_weight_copy=a * d * model.vocab_size,
        )


def stage_layers(n_layers: int, pp: int, stage: int) -> int:
    """Blocks on pipeline stage ``stage``: an even split, the first ``n_layers % pp`` stages
    taking one more."""
    return n_layers // pp + (1 if stage < n_layers % pp else 0)


def checkpointed_blocks(n_layers: int, ac: ActivationCheckpointingConfig | None) -> int:
    """How many of ``n_layers`` blocks ``ac`` checkpoints (``ac.selects`` each index)."""
    return 0 if ac is None else sum(ac.selects(i) for i in range(n_layers))


def _stage_peak(
    terms: ActivationBytes, layers: int, checkpointed: int, last: bool, tokens: int, in_flight: int
) -> int:
    """A stage's peak with ``in_flight`` micro-batches of ``tokens`` tokens kept for backward."""
    plain = layers - checkpointed
    kept = in_flight * tokens * (plain * terms.block + checkpointed * terms.checkpointed)
    kept += plain * terms.block_weight_copies + (terms.head_weight_copy if last else 0)
    end_of_forward = tokens * terms.outside if last else 0
    recompute = 0
    if checkpointed:  # one block's activations and weight copies, made again in backward
        per_token = terms.block - terms.checkpointed + (terms.logits if last else 0)
        recompute = tokens * per_token + terms.block_weight_copies
    return kept + max(end_of_forward, recompute)


def activation_bytes(
    model: TransformerConfig,
    tokens: int,
    dtype_bytes: int,
    ac: ActivationCheckpointingConfig | None = None,
    *,
    autocast: bool = False,
    tp: int = 1,
    pp: int = 1,
) -> int:
    """Peak activation bytes on the busiest rank for micro-batches of ``tokens`` tokens.

    ``ac`` applies to each stage's own blocks, numbered from 0 per stage (each pipeline stage
    is a model of its own).
    """
    terms = ActivationBytes.of(model, dtype_bytes, autocast)
    peaks = []
    for stage in range(pp):
        layers = stage_layers(model.n_layers, pp, stage)
        in_flight = pp - stage  # 1F1B: the first stage waits longest for its backwards
        checkpointed = checkpointed_blocks(layers, ac)
        peaks.append(_stage_peak(terms, layers, checkpointed, stage == pp - 1, tokens, in_flight))
    return -(-max(peaks) // tp)
