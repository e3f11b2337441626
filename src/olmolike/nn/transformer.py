"""A decoder-only language model in the OLMo-2 / Llama family.

Token embedding, residual blocks of attention and a SwiGLU MLP, a final RMSNorm and a linear
head. A block normalises each sublayer's input (pre-norm, as Llama) or, with
``block_type="reordered_norm"``, each sublayer's output before it joins the residual (as
OLMo-2). Attention uses rotary position embeddings in the rotate-half convention of GPT-NeoX
and Hugging Face, so a checkpoint maps onto ``LlamaForCausalLM`` or ``Olmo2ForCausalLM`` by
renaming tensors alone (see :mod:`olmolike.nn.hf_export` and :mod:`olmolike.nn.hf_import`).

Models are always constructed on the ``meta`` device and then materialised: that makes a
direct build and the FSDP path (shard on meta, then materialise each shard) run the same
initialisation code, and it never spends time on PyTorch's default initialisation that would be
overwritten anyway. Its shape, the presets and ``build`` are in
:mod:`olmolike.nn.transformer_config`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor

from ..config import StrEnum
from .context_parallel import ContextParallel, ShardAttention
from .kv_cache import KVCache, LayerKVCache
from .moe import MoEFeedForward
from .rope import RotaryEmbedding, apply_rotary, document_attention

if TYPE_CHECKING:
    from .transformer_config import TransformerConfig

__all__ = [
    "Attention",
    "FeedForward",
    "RMSNorm",
    "Transformer",
    "TransformerBlock",
    "TransformerBlockType",
]


class TransformerBlockType(StrEnum):
    """Where a block's RMSNorms sit."""

    default = "default"
    """Pre-norm, as Llama: ``h = x + attention(norm(x))``, ``out = h + mlp(norm(h))``."""
    reordered_norm = "reordered_norm"
    """As OLMo-2: ``h = x + norm(attention(x))``, ``out = h + norm(mlp(h))``. The residual
    stream is never normalised, only what each sublayer adds to it, which OLMo-2 found keeps
    large runs stable."""


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale, computed in float32 for bf16 stability."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


class Attention(nn.Module):
    """Causal self-attention with optional grouped-query attention and QK-norm."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = (
            config.n_heads, config.kv_heads, config.head_dim,
        )  # fmt: skip
        d, kv_dim = config.d_model, config.kv_heads * config.head_dim
        self.w_q = nn.Linear(d, d, bias=False)
        self.w_k = nn.Linear(d, kv_dim, bias=False)
        self.w_v = nn.Linear(d, kv_dim, bias=False)
        self.w_out = nn.Linear(d, d, bias=False)
        self.q_norm = RMSNorm(d, config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(kv_dim, config.norm_eps) if config.qk_norm else None

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | ShardAttention | None = None,
        cache: LayerKVCache | None = None,
    ) -> Tensor:
        """``mask`` (B, 1, T, keys), True where attention is allowed, replaces the causal mask;
        with a ``cache``, the keys are every cached one followed by this call's. Under context
        parallelism ``mask`` is the attention of this rank's shard of the sequence, which
        brings in the other ranks' keys (:mod:`olmolike.nn.context_parallel`)."""
        batch, seq_len, _ = x.shape
        q, k, v = self.w_q(x), self.w_k(x), self.w_v(x)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # (B, T, heads * head_dim) -> (B, heads, T, head_dim), the layout SDPA expects. The
        # head counts come from the projections' widths: under tensor parallelism a rank
        # holds only some of the heads (see olmolike.nn.parallel_plan).
        q = q.view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # With enable_gqa, query head h reads key/value head h // (n_heads / n_kv_heads), the
        # same grouping as Hugging Face's repeat_kv, without materialising repeated k and v.
        if cache is not None:
            k, v = cache.update(k, v)
        if isinstance(mask, ShardAttention):
            y = mask(q, k, v, enable_gqa=self.n_kv_heads != self.n_heads)
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None,
                enable_gqa=self.n_kv_heads != self.n_heads,
            )  # fmt: skip
        return self.w_out(y.transpose(1, 2).reshape(batch, seq_len, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w_down(silu(w_gate(x)) * w_up(x))``."""

    def __init__(self, d_model: int, hidden_size: int) -> None:
        super().__init__()
        self.w_gate = nn.Linear(d_model, hidden_size, bias=False)
        self.w_up = nn.Linear(d_model, hidden_size, bias=False)
        self.w_down = nn.Linear(hidden_size, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class TransformerBlock(nn.Module):
    """A residual block: attention, then the MLP, each with its RMSNorm (see ``block_type``).
    The MLP of layer ``index`` is a mixture of experts if ``config.moe`` says so."""

    def __init__(self, config: TransformerConfig, index: int = 0) -> None:
        super().__init__()
        self.reordered_norm = config.block_type == TransformerBlockType.reordered_norm
        self.attention_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attention = Attention(config)
        self.feed_forward_norm = RMSNorm(config.d_model, config.norm_eps)
        self.feed_forward: FeedForward | MoEFeedForward
        if config.is_moe_layer(index):
            shared = config.moe.shared_expert_hidden_size if config.moe else None
            shared_expert = FeedForward(config.d_model, shared) if shared else None
            self.feed_forward = MoEFeedForward(config, index, shared_expert)
        else:
            self.feed_forward = FeedForward(config.d_model, config.hidden_size)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | ShardAttention | None = None,
        cache: LayerKVCache | None = None,
    ) -> Tensor:
        if self.reordered_norm:
            h = x + self.attention_norm(self.attention(x, cos, sin, mask, cache))
            return h + self.feed_forward_norm(self.feed_forward(h))
        h = x + self.attention(self.attention_norm(x), cos, sin, mask, cache)
        return h + self.feed_forward(self.feed_forward_norm(h))


def _init_trunc_normal(weight: Tensor, std: float, generator: torch.Generator | None) -> None:
    """Truncated normal at 3 std; a sharded weight gets its slice of the full tensor's draw.

    Each rank draws the whole tensor and keeps its shard. DTensor's own random ops would need
    one RNG stream per shard (supported on CUDA only), and on CPU every rank would draw the
    same values for its shard, repeating rows across ranks.
    """
    if not isinstance(weight, DTensor):
        nn.init.trunc_normal_(weight, 0.0, std, -3 * std, 3 * std, generator=generator)
        return
    full = torch.empty(weight.shape, dtype=weight.dtype, device=weight.to_local().device)
    nn.init.trunc_normal_(full, 0.0, std, -3 * std, 3 * std, generator=generator)
    # src_data_rank=None: every rank holds the full draw, so each slices locally (no scatter).
    shard = distribute_tensor(full, weight.device_mesh, weight.placements, src_data_rank=None)
    weight.to_local().copy_(shard.to_local())


class Transformer(nn.Module):
    """The language model: token ids (B, T) in, next-token logits (B, T, vocab) out."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = nn.Embedding(config.vocab_size, config.d_model)
        self.rope = RotaryEmbedding(
            config.head_dim, config.max_sequence_length, config.rope_theta, config.rope_scaling
        )
        self.blocks = nn.ModuleList(TransformerBlock(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.embeddings.weight
        self.context_parallel: ContextParallel | None = None
        """Set by :func:`~olmolike.nn.context_parallel.apply_context_parallel`: each rank then
        computes its shard of every sequence, and returns the logits of its tokens only."""

    def forward(
        self, input_ids: Tensor, doc_ids: Tensor | None = None, *, cache: KVCache | None = None
    ) -> Tensor:
        """Logits of ``input_ids``.

        With ``doc_ids`` (B, T), each packed document is computed alone (no attention across
        documents, positions restarting per document). With a ``cache``, the logits extend the
        sequences cached so far (see :mod:`olmolike.nn.kv_cache`). Under context parallelism
        the logits are those of this rank's tokens (:meth:`ContextParallel.shard`).
        """
        if input_ids.dim() != 2:
            raise ValueError(
                f"input_ids must have shape (batch, seq_len), got {tuple(input_ids.shape)}; "
                "add a batch dimension with input_ids.unsqueeze(0)"
            )
        seq_len = input_ids.shape[1]
        if seq_len > self.config.max_sequence_length:
            raise ValueError(
                f"input_ids has {seq_len} tokens but the model's max_sequence_length is "
                f"{self.config.max_sequence_length}; crop the input or build the model with "
                f"max_sequence_length >= {seq_len}"
            )
        if cache is not None and doc_ids is not None:
            raise ValueError("pass doc_ids or a KV cache, not both: decoding packs no documents")
        if cache is not None and cache.capacity > self.config.max_sequence_length:
            raise ValueError(
                f"the KV cache has {cache.capacity} slots but the model has rotary positions "
                f"for {self.config.max_sequence_length} only; build a smaller cache"
            )
        cp = self.context_parallel
        if cp is not None and cache is not None:
            raise ValueError(
                "a KV cache decodes on one rank: generate with a model without context "
                "parallelism (it splits the sequences of training steps over ranks)"
            )
        h = self.embeddings(input_ids if cp is None else cp.shard(input_ids))
        mask: Tensor | ShardAttention | None = None
        if cache is not None:
            cos, sin = self.rope.at(cache.begin(input_ids))
            mask = cache.mask
        elif cp is not None:
            cos, sin, mask = cp.attention_inputs(self.rope, h.shape[1], doc_ids)
        elif doc_ids is not None:
            positions, mask = document_attention(doc_ids)
            cos, sin = self.rope.at(positions)
        else:
            cos, sin = self.rope(seq_len)
        for i, block in enumerate(self.blocks):
            h = block(h, cos, sin, mask, None if cache is None else cache.layer(i))
        if cache is not None:
            cache.end()
        return self.lm_head(self.norm(h))

    @torch.no_grad()
    def init_weights(self, *, seed: int | None = None, device: torch.device | None = None) -> None:
        """(Re)initialise every parameter and the RoPE tables, in place.

        Truncated normal (at 3 std) with ``init_std`` everywhere, and ``init_std /
        sqrt(2 * n_layers)`` for the projections that write into the residual stream, so the
        residual's variance does not grow with depth. A ``seed`` draws from a private
        generator: the same weights every time, the global RNG untouched, and for a model
        sharded with FSDP the same weights as an unsharded build.
        """
        device = self.embeddings.weight.device if device is None else torch.device(device)
        if device.type == "meta":
            return
        init_parameters(self, self.config, seed=seed, device=device)
        self.rope.reset_buffers(device)

    def materialize(self, device: str | torch.device, *, seed: int | None = None) -> Transformer:
        """Allocate a meta-built model on ``device`` and initialise it; returns ``self``."""
        device = torch.device(device)
        self.to_empty(device=device)
        # to_empty replaces each module's parameter separately, which unties a shared weight.
        if self.config.tie_weights and self.lm_head.weight is not self.embeddings.weight:
            self.lm_head.weight = self.embeddings.weight
        self.init_weights(seed=seed, device=device)
        return self

    def num_flops_per_token(self, seq_len: int) -> int:
        return self.config.num_flops_per_token(seq_len)


def init_draws(config: TransformerConfig) -> Iterator[tuple[str, float]]:
    """The truncated-normal draws that initialise a :class:`Transformer`, in the order they are
    taken from the random stream: ``(parameter name, std)``.

    The order is part of the weights' identity: a pipeline stage that holds only some of the
    parameters walks the same order, drawing (and dropping) the ones it does not hold, so every
    layout starts from exactly the weights of the unsplit model with the same seed.
    """
    std = config.init_std
    out_std = std / math.sqrt(2 * config.n_layers)
    yield "embeddings.weight", std
    for i in range(config.n_layers):
        prefix = f"blocks.{i}"
        for name in ("w_q", "w_k", "w_v"):
            yield f"{prefix}.attention.{name}.weight", std
        yield f"{prefix}.attention.w_out.weight", out_std
        mlps = [f"{prefix}.feed_forward"]
        if config.is_moe_layer(i):  # the router, every expert at once, the shared expert
            yield f"{prefix}.feed_forward.router.weight", std
            yield f"{prefix}.feed_forward.experts.w_gate", std
            yield f"{prefix}.feed_forward.experts.w_up", std
            yield f"{prefix}.feed_forward.experts.w_down", out_std
            mlps = [f"{prefix}.feed_forward.shared_expert"] if config.has_shared_expert else []
        for mlp in mlps:
            yield f"{mlp}.w_gate.weight", std
            yield f"{mlp}.w_up.weight", std
            yield f"{mlp}.w_down.weight", out_std
    if not config.tie_weights:
        yield "lm_head.weight", std


@torch.no_grad()
def init_parameters(
    module: nn.Module, config: TransformerConfig, *, seed: int | None, device: torch.device
) -> None:
    """Initialise the parameters ``module`` holds, named as in a :class:`Transformer`, exactly
    as the whole model's :meth:`Transformer.init_weights` would: draws for parameters it does
    not hold are taken into a scratch tensor and dropped, so the random stream stays aligned.
    RMSNorm scales are reset to one; RoPE tables are left to the caller."""
    generator = None if seed is None else torch.Generator(device).manual_seed(seed)
    held: dict[str, Tensor] = dict(module.named_parameters())
    shapes: dict[str, torch.Size] | None = None
    for name, std in init_draws(config):
        weight = held.get(name)
        if weight is None:
            if generator is None:
                continue  # the global stream: nothing to keep aligned with
            if shapes is None:
                with torch.device("meta"):
                    shapes = {n: p.shape for n, p in Transformer(config).named_parameters()}
            weight = torch.empty(shapes[name], device=device)
        _init_trunc_normal(weight, std, generator)
    for submodule in module.modules():
        if isinstance(submodule, RMSNorm):
            submodule.reset_parameters()
