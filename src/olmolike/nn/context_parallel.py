"""Context parallelism: each rank of a group holds part of every sequence, and attention still
sees all of it.

A sequence of ``T`` tokens is cut into ``2 cp`` chunks of ``c = T / (2 cp)`` tokens; rank ``i``
of the context-parallel group holds chunks ``i`` and ``2 cp - 1 - i`` ("zig-zag"). Under
causal attention a query's cost grows with its position: pairing an early chunk with a late
one gives every rank the same number of (query, key) pairs, where cutting the sequence into
``cp`` plain pieces would give the last rank ``2 cp - 1`` times the first one's work.

Everything but attention (embedding, norms, MLP, head, loss) works token by token and runs on
the rank's ``2c`` tokens alone. Attention needs every earlier key: in each layer the ranks
all-gather their keys and values (the approach of Llama 3), and each rank attends its two
query chunks to the keys up to each chunk's end. The gather's backward reduce-scatters the
keys' and values' gradients to the ranks that computed them. Only ``torch.distributed``
collectives are used, so gloo (CPU) and NCCL (GPU) run the same code.

The gathered keys are put in reverse order of position. A query chunk then attends a suffix
of them, and its causal mask (key position <= query position) becomes ``i + j >= c - 1`` for
query ``i`` and key ``j`` of that suffix: a function of ``i + j``, so the mask is a view with
strides ``(1, 1)`` of one vector of ``c + T - 1`` values, not a ``c x T`` tensor, and SDPA runs
its flash kernel on it. Packed documents need a real mask (a query sees its own document's
keys only): one per chunk, ``(B, 1, c, keys)``, built once per forward and shared by every
layer (``T x T / cp`` values per sequence over both chunks, where one process holds ``T x T``).

Per layer and rank this costs an all-gather of ``2 x kv_dim x T`` values (keys and values of
the whole sequence) in forward and a reduce-scatter of as many in backward, and the gathered
keys and values are kept for backward; every other activation is kept for ``T / cp`` tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor

from .rope import RotaryEmbedding, document_starts

if TYPE_CHECKING:
    from .transformer import Transformer

__all__ = ["ContextParallel", "ShardAttention", "apply_context_parallel"]


def apply_context_parallel(
    model: Transformer, group: dist.ProcessGroup, *, tensor_parallel: int = 1
) -> None:
    """Make ``model`` compute its shard of every sequence over the ranks of ``group``.

    Its forward then takes whole sequences (``input_ids``, ``doc_ids``) and returns the logits
    of this rank's tokens only, in :meth:`ContextParallel.shard`'s order: shard the labels the
    same way. No parameter changes: gradients must still be reduced over ``group`` (FSDP or DDP
    over the data and context-parallel ranks together). ``tensor_parallel``: the degree the
    model is also split over, whose sequence parallelism divides a rank's tokens again.
    """
    model.context_parallel = ContextParallel(group, multiple_of=tensor_parallel)


class ContextParallel:
    """The zig-zag split of sequences over the ranks of ``group`` (see the module doc)."""

    def __init__(self, group: dist.ProcessGroup, *, multiple_of: int = 1) -> None:
        self.group = group
        self.degree = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.multiple = 2 * self.degree * multiple_of
        """Sequences are padded to a multiple of this: two equal chunks per rank, each rank's
        tokens a multiple of ``multiple_of``."""

    def padded_length(self, seq_len: int) -> int:
        return -(-seq_len // self.multiple) * self.multiple

    def positions(self, seq_len: int, device: torch.device, rank: int | None = None) -> Tensor:
        """The positions in a (padded) sequence of ``seq_len`` tokens that ``rank`` (default:
        this one) holds, in the order it holds them: ``(2c,)``."""
        rank = self.rank if rank is None else rank
        c = seq_len // (2 * self.degree)
        first, second = rank * c, (2 * self.degree - 1 - rank) * c
        return torch.cat(
            (
                torch.arange(first, first + c, device=device),
                torch.arange(second, second + c, device=device),
            )
        )

    def shard(self, x: Tensor, *, pad_value: float = 0, dim: int = 1) -> Tensor:
        """This rank's tokens of ``x``, whose dimension ``dim`` is the sequence: the sequence
        is right-padded with ``pad_value`` to :meth:`padded_length` (an ignored label, a
        padding token), then chunks ``rank`` and ``2 cp - 1 - rank`` are kept."""
        seq_len = x.shape[dim]
        padded = self.padded_length(seq_len)
        if padded != seq_len:
            x = F.pad(
                x, [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, padded - seq_len], value=pad_value
            )
        c = padded // (2 * self.degree)
        second = (2 * self.degree - 1 - self.rank) * c
        return torch.cat((x.narrow(dim, self.rank * c, c), x.narrow(dim, second, c)), dim=dim)

    @torch.no_grad()
    def gather(self, x: Tensor, seq_len: int, dim: int = 1) -> Tensor:
        """The whole sequence of ``seq_len`` tokens from every rank's shard ``x`` (the inverse
        of :meth:`shard`, padding dropped), on every rank; no gradient. A tensor-parallel
        model's vocabulary-sharded logits stay a DTensor sharded the same way."""
        if isinstance(x, DTensor):
            whole = self.gather(x.to_local(), seq_len, dim)
            return DTensor.from_local(whole, x.device_mesh, x.placements, run_check=False)
        parts = [torch.empty_like(x) for _ in range(self.degree)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        chunks: list[Tensor] = [x] * (2 * self.degree)
        for rank, part in enumerate(parts):
            chunks[rank], chunks[2 * self.degree - 1 - rank] = part.chunk(2, dim=dim)
        return torch.cat(chunks, dim=dim).narrow(dim, 0, seq_len)

    def sum(self, x: Tensor) -> Tensor:
        """``x`` summed over the group (a sequence's log-probability from each rank's share of
        its tokens), on every rank. The gradient goes to each rank's own share unchanged: every
        rank computes the same loss from the sum, and the ranks' gradients are added up later
        by the data-parallel reduction."""
        return _SumOverGroup.apply(x, self.group)

    def attention_inputs(
        self, rope: RotaryEmbedding, local_len: int, doc_ids: Tensor | None
    ) -> tuple[Tensor, Tensor, ShardAttention]:
        """The RoPE tables of this rank's ``local_len`` tokens (at their positions in the whole
        sequence, or in their documents with ``doc_ids``) and the attention every layer runs."""
        seq_len, device = local_len * self.degree, rope.cos.device
        positions = self.positions(seq_len, device)
        starts = None
        if doc_ids is None:
            local = positions[None]
        else:
            padded = F.pad(doc_ids, (0, seq_len - doc_ids.shape[1]), value=-1)
            starts = document_starts(padded)
            index = torch.arange(seq_len, device=device)
            local = (index - starts)[:, positions]
        # Padding tokens may sit past the last RoPE position; nothing real attends to them.
        cos, sin = rope.at(local.clamp(max=rope.max_sequence_length - 1))
        return cos, sin, ShardAttention(self, seq_len, starts, device)


class ShardAttention:
    """One forward's attention for this rank's shard of the sequences: every layer's
    :class:`~olmolike.nn.transformer.Attention` calls it in place of SDPA."""

    def __init__(
        self, cp: ContextParallel, seq_len: int, doc_starts: Tensor | None, device: torch.device
    ) -> None:
        self.group = cp.group
        self.c = seq_len // (2 * cp.degree)
        gathered = torch.cat([cp.positions(seq_len, device, r) for r in range(cp.degree)])
        self.key_order = torch.empty_like(gathered)
        """The gathered keys' indices, in reverse order of position."""
        self.key_order[seq_len - 1 - gathered] = torch.arange(seq_len, device=device)
        self.chunks = [cp.rank, 2 * cp.degree - 1 - cp.rank]
        """The chunks this rank's queries are in: the first ``c`` queries, then the next."""
        self.seq_len, self.doc_starts = seq_len, doc_starts
        self._masks: dict[torch.dtype, list[Tensor]] = {}

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *, enable_gqa: bool) -> Tensor:
        """Attention of ``q`` (B, heads, 2c, head_dim) over the whole sequence's keys, of
        which ``k`` and ``v`` (B, kv heads, 2c, head_dim) are this rank's."""
        local = torch.stack((k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3)), dim=1)
        gathered = _GatherSequence.apply(local, self.group)  # (T, 2, B, kv heads, head_dim)
        keys, values = gathered.index_select(0, self.key_order).permute(1, 2, 3, 0, 4).unbind(0)
        c, outputs = self.c, []
        for i, (chunk, mask) in enumerate(zip(self.chunks, self._masks_for(q), strict=True)):
            visible = (chunk + 1) * c  # the keys up to the chunk's end: a suffix, reversed
            outputs.append(
                F.scaled_dot_product_attention(
                    q[:, :, i * c : (i + 1) * c],
                    keys[:, :, -visible:],
                    values[:, :, -visible:],
                    attn_mask=mask,
                    enable_gqa=enable_gqa,
                )
            )
        return torch.cat(outputs, dim=2)

    def _masks_for(self, q: Tensor) -> list[Tensor]:
        """Additive masks in ``q``'s dtype (SDPA would turn boolean ones into a new float
        tensor in every layer), one per query chunk, made once per forward and dtype."""
        masks = self._masks.get(q.dtype)
        if masks is None:
            masks = self._masks[q.dtype] = self._build_masks(q.dtype, q.device)
        return masks

    def _build_masks(self, dtype: torch.dtype, device: torch.device) -> list[Tensor]:
        c, seq_len = self.c, self.seq_len
        if self.doc_starts is None:
            line = torch.zeros(c + seq_len - 1, dtype=dtype, device=device)
            line[: c - 1] = float("-inf")
            return [line.as_strided((1, 1, c, (k + 1) * c), (0, 0, 1, 1)) for k in self.chunks]
        masks = []
        i = torch.arange(c, device=device)
        for chunk in self.chunks:
            visible = (chunk + 1) * c
            query_docs = self.doc_starts[:, chunk * c : visible]
            key_docs = self.doc_starts[:, :visible].flip(-1)
            causal = i[:, None] + torch.arange(visible, device=device)[None] >= c - 1
            allowed = (query_docs[:, :, None] == key_docs[:, None, :]) & causal
            mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
            masks.append(mask.masked_fill_(~allowed, float("-inf")).unsqueeze(1))
        return masks


class _GatherSequence(torch.autograd.Function):
    """All-gather along dimension 0 over ``group``; the backward reduce-scatters (sums) the
    gradient, so each rank gets the gradient of its own piece from every rank's use of it."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        out = local.new_empty((size * local.shape[0], *local.shape[1:]))
        dist.all_gather_single(out, local.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        size = dist.get_world_size(ctx.group)
        local = grad.new_empty((grad.shape[0] // size, *grad.shape[1:]))
        dist.reduce_scatter_single(local, grad.contiguous(), group=ctx.group)
        return local, None


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) over ``group``; the gradient passes through unchanged (see
    :meth:`ContextParallel.sum`)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        total = x.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None
