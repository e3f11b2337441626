"""Mixture-of-experts feed-forward layers (OLMoE's token-choice top-k routing), dropless.

A :class:`MoEFeedForward` replaces a block's dense SwiGLU MLP. Each token is routed to the
``top_k`` experts with the highest router probability (a softmax over ``num_experts`` scores,
as OLMoE and Switch do) and its output is the sum of those experts' outputs weighted by their
probabilities (renormalised over the ``top_k`` only if ``normalize_top_k``, off in OLMoE). No
token is ever dropped: every routed copy is computed, however unbalanced the routing.

One forward is three steps, so that expert parallelism can replace the middle of it:

1. **dispatch** (:class:`TokenDispatcher`): the routed copies of the tokens, grouped by
   expert, and how many each expert got. Here a stable sort by expert; under expert
   parallelism an ``all_to_all`` to the ranks that hold the experts.
2. **experts** (:class:`Experts`): every expert's SwiGLU on its group. The weights are
   stacked tensors ``[num_experts, ...]`` (shardable on dim 0); one grouped matmul
   (``torch._grouped_mm``) per projection on CUDA, a loop over the experts elsewhere, with the
   same results.
3. **combine**: the results back in token order (the inverse of the dispatch), weighted and
   summed over each token's ``top_k`` experts in a fixed order.

Ties between router probabilities go to the lower expert index (a stable sort, not
``torch.topk``, whose choice among equal values is unspecified), so the routing does not
depend on the device or the parallel layout.

**Auxiliary losses.** In training (grad enabled), each layer computes the load-balancing loss
(``num_experts x sum_e f_e x P_e``: ``f_e`` the fraction of tokens routed to expert ``e``
(over all ``top_k`` choices, so the ``f_e`` sum to ``top_k``), ``P_e`` its mean router
probability; ``top_k`` when perfectly balanced) and the router z-loss (the mean squared
log-sum-exp of the router logits), and attaches ``coefficient x loss`` to the autograd graph
of its output (:class:`_AttachAuxLoss`): whatever loss is backpropagated through the layer's
output also backpropagates the auxiliary loss, with gradient weight :func:`aux_loss_weight`
(1 by default: a model used in a plain loop adds ``coefficient x aux`` to a mean loss, as
Hugging Face does). A pipeline stage's blocks therefore get their auxiliary gradients from
the stage's own backward, and activation checkpointing keeps them. The losses are averaged
over the MoE layers (each layer's coefficient is divided by their number).

**Statistics.** In training each layer also adds, on the device (no host sync), the tokens
each expert received, its weighted losses and the dropped routed copies (0: dropless) to
the layer's ``stats`` (:class:`RoutingStats`); a train module takes them
(:meth:`RoutingStats.take_losses` every step, :meth:`RoutingStats.take_load` at the
metrics' collect interval). A forward that autograd re-runs to recompute checkpointed
activations adds nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor

from ..config import Config, StrEnum

if TYPE_CHECKING:
    from .transformer_config import TransformerConfig

__all__ = [
    "ExpertCompute",
    "Experts",
    "MoEConfig",
    "MoEFeedForward",
    "Router",
    "Routing",
    "RoutingStats",
    "TokenDispatcher",
    "aux_loss_weight",
    "grouped_mm_supported",
    "load_balancing_loss",
    "moe_layers",
    "router_z_loss",
]


class ExpertCompute(StrEnum):
    """How the experts' matmuls run."""

    auto = "auto"
    """``grouped_mm`` where the device has it (CUDA, bfloat16), ``loop`` elsewhere."""
    grouped_mm = "grouped_mm"
    """One ``torch._grouped_mm`` per projection over all experts' token groups."""
    loop = "loop"
    """One matmul per expert and projection, over its group of tokens."""


@dataclass
class MoEConfig(Config):
    """The mixture-of-experts feed-forward of a :class:`~olmolike.nn.TransformerConfig`
    (its ``moe`` field); the presets ``olmoe_1B_7B`` and ``moe_*`` set one."""

    num_experts: int = 8
    """Routed experts per MoE layer."""
    top_k: int = 2
    """Experts each token is routed to."""
    hidden_size: int | None = None
    """Each expert's SwiGLU width; ``None``: the dense MLP's (``TransformerConfig.hidden_size``)."""
    shared_expert_hidden_size: int | None = None
    """Width of a shared expert (a dense SwiGLU every token goes through, added to the routed
    experts' output, as in DeepSeek-MoE); ``None``: none (OLMoE has none)."""
    normalize_top_k: bool = False
    """Rescale each token's ``top_k`` router probabilities to sum to 1 (Hugging Face's
    ``norm_topk_prob``); off in OLMoE, where the weights are the softmax probabilities."""
    load_balancing_loss_coefficient: float = 0.01
    """Weight of the load-balancing loss in the training loss (OLMoE: 0.01); 0 turns its
    gradient off (it is still computed and logged)."""
    router_z_loss_coefficient: float = 0.001
    """Weight of the router z-loss, which keeps router logits small (OLMoE: 0.001)."""
    layers: list[int] | None = None
    """Indices of the layers whose feed-forward is MoE; the others keep the dense MLP.
    ``None``: every layer."""
    expert_compute: ExpertCompute = ExpertCompute.auto
    """How the experts' matmuls run (:class:`ExpertCompute`); the results are the same."""

    def validate(self) -> None:
        if self.num_experts < 1:
            raise self._invalid("num_experts", f"must be >= 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise self._invalid(
                "top_k", f"must be between 1 and num_experts={self.num_experts}, got {self.top_k}"
            )
        for name in ("hidden_size", "shared_expert_hidden_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise self._invalid(name, f"must be positive (or null), got {value}")
        for name in ("load_balancing_loss_coefficient", "router_z_loss_coefficient"):
            if not getattr(self, name) >= 0:
                raise self._invalid(name, f"must be >= 0, got {getattr(self, name)}")
        if self.layers is not None and len(set(self.layers)) != len(self.layers):
            raise self._invalid("layers", f"lists a layer twice: {self.layers}")

    def check_layers(self, n_layers: int) -> None:
        """Every listed layer must exist (called by the model config, which knows the depth)."""
        bad = [i for i in self.layers or [] if not 0 <= i < n_layers]
        if bad:
            raise self._invalid(
                "layers", f"{bad} are not layers of a {n_layers}-layer model (0 to {n_layers - 1})"
            )

    def is_moe_layer(self, index: int) -> bool:
        return self.layers is None or index in self.layers

    def num_moe_layers(self, n_layers: int) -> int:
        return sum(self.is_moe_layer(i) for i in range(n_layers))


# -- routing -----------------------------------------------------------------------------------


@dataclass
class Routing:
    """A router's decision for ``T`` tokens."""

    logits: Tensor
    """``(T, num_experts)`` router logits, in the input's dtype (as Hugging Face's)."""
    probs: Tensor
    """``(T, num_experts)`` softmax of the logits, in float32."""
    weights: Tensor
    """``(T, top_k)`` the chosen experts' weights, in the logits' dtype."""
    experts: Tensor
    """``(T, top_k)`` the chosen experts, highest probability first (ties: lower index)."""


class Router(nn.Module):
    """Token-choice top-k: a linear score per expert, softmax, the ``top_k`` most probable."""

    def __init__(self, d_model: int, num_experts: int, top_k: int, normalize: bool) -> None:
        super().__init__()
        self.top_k, self.normalize = top_k, normalize
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))

    def forward(self, x: Tensor) -> Routing:
        logits = F.linear(x, local(self.weight))
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        # A stable sort: equal probabilities keep expert order, so the lower index wins a tie
        # on every device and layout (torch.topk leaves the choice among equals open).
        experts = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, : self.top_k]
        weights = probs.gather(-1, experts)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(logits, probs, weights.to(logits.dtype), experts)


def load_balancing_loss(probs: Tensor, tokens_per_expert: Tensor) -> Tensor:
    """``num_experts x sum_e f_e x P_e`` of one layer: ``f_e`` the routed copies expert ``e``
    got per token (summing to ``top_k`` over the experts), ``P_e`` its mean probability.

    Equal to Hugging Face's ``load_balancing_loss_func`` given this layer's router logits
    alone; with several layers theirs pools the layers' counts and probabilities before the
    product, this is per layer (models average it over their MoE layers, as OLMoE's training
    code did)."""
    tokens, num_experts = probs.shape
    fraction = tokens_per_expert.float() / max(tokens, 1)
    return num_experts * (fraction * probs.float().mean(dim=0)).sum()


def router_z_loss(logits: Tensor) -> Tensor:
    """The mean over tokens of ``logsumexp(router logits)^2`` (ST-MoE's router z-loss)."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


# -- dispatch, experts, combine ----------------------------------------------------------------


@dataclass
class Dispatched:
    """The expert inputs of one dispatch and what :meth:`TokenDispatcher.combine` needs."""

    tokens: Tensor
    """``(N, d)`` routed copies of the tokens, grouped by (local) expert in expert order."""
    tokens_per_expert: Tensor
    """``(local experts,)`` int64: how many rows of ``tokens`` each local expert has."""
    order: Tensor
    """``(N,)`` the routed copy (``token * top_k + slot``) each row of ``tokens`` came from."""


class TokenDispatcher:
    """Moves routed token copies to their experts and the results back: all experts are on
    this rank (an expert-parallel dispatcher sends them to other ranks with ``all_to_all``
    and overrides both methods; the layer around it stays the same)."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts

    def dispatch(self, x: Tensor, experts: Tensor, counts: Tensor) -> Dispatched:
        """``x`` (T, d), ``experts`` (T, top_k) and ``counts`` (num_experts,), the copies each
        expert is routed: the ``T x top_k`` copies grouped by expert, tokens in their order
        within a group (a stable sort: deterministic)."""
        order = torch.argsort(experts.reshape(-1), stable=True)
        tokens = x.index_select(0, order // experts.shape[-1])
        return Dispatched(tokens, counts, order)

    def combine(self, expert_out: Tensor, dispatched: Dispatched, shape: torch.Size) -> Tensor:
        """The experts' results of each routed copy, back in ``(T, top_k, d)`` order."""
        slots = expert_out.new_empty(expert_out.shape)
        slots = slots.index_copy(0, dispatched.order, expert_out)
        return slots.view(*shape, expert_out.shape[-1])


def count_tokens(experts: Tensor, num_experts: int) -> Tensor:
    """``(num_experts,)`` int64 counts of ``experts`` (any shape) without a host sync
    (``torch.bincount`` sizes its output from the data on CUDA)."""
    counts = torch.zeros(num_experts, dtype=torch.int64, device=experts.device)
    return counts.scatter_add_(0, experts.reshape(-1), torch.ones_like(experts.reshape(-1)))


def grouped_mm_supported(device: torch.device, dtype: torch.dtype, *sizes: int) -> bool:
    """Whether ``torch._grouped_mm`` runs on ``device`` for ``dtype`` operands with these
    inner sizes: CUDA compute capability 9 (Hopper) or newer, bfloat16, rows aligned to 16
    bytes."""
    if device.type != "cuda" or dtype != torch.bfloat16 or not hasattr(torch, "_grouped_mm"):
        return False
    if torch.cuda.get_device_capability(device) < (9, 0):
        return False
    return all(size % 8 == 0 for size in sizes)


class Experts(nn.Module):
    """``num_experts`` SwiGLU MLPs as stacked weights: ``w_gate``, ``w_up`` ``(E, d, h)`` and
    ``w_down`` ``(E, h, d)``, so ``x @ w[e]`` is expert ``e``'s projection and an
    expert-parallel layout shards all three on dim 0."""

    def __init__(
        self, num_experts: int, d_model: int, hidden_size: int, compute: ExpertCompute
    ) -> None:
        super().__init__()
        self.compute = compute
        self.w_gate = nn.Parameter(torch.empty(num_experts, d_model, hidden_size))
        self.w_up = nn.Parameter(torch.empty(num_experts, d_model, hidden_size))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden_size, d_model))

    def forward(self, x: Tensor, tokens_per_expert: Tensor) -> Tensor:
        """``x`` (N, d) grouped by expert, ``tokens_per_expert`` (E,) summing to N."""
        if self._grouped(x):
            return self._grouped_mm(x, tokens_per_expert)
        return self._loop(x, tokens_per_expert)

    def _grouped(self, x: Tensor) -> bool:
        if self.compute == ExpertCompute.loop:
            return False
        if self.compute == ExpertCompute.grouped_mm:
            return True
        d, h = self.w_gate.shape[1:]
        return grouped_mm_supported(x.device, _compute_dtype(x), d, h)

    def _weights(self) -> tuple[Tensor, Tensor, Tensor]:
        return local(self.w_gate), local(self.w_up), local(self.w_down)

    def _loop(self, x: Tensor, tokens_per_expert: Tensor) -> Tensor:
        counts = tokens_per_expert.tolist()  # the group sizes on the host (a sync on a GPU)
        w_gate, w_up, w_down = self._weights()
        outs = []
        for e, group in enumerate(x.split(counts)):
            hidden = F.silu(group @ w_gate[e]) * (group @ w_up[e])
            outs.append(hidden @ w_down[e])
        return torch.cat(outs) if outs else x.new_zeros(x.shape)

    def _grouped_mm(self, x: Tensor, tokens_per_expert: Tensor) -> Tensor:
        # _grouped_mm is not an autocast op: cast its operands as autocast would.
        dtype = _compute_dtype(x)
        x = x.to(dtype)
        offsets = tokens_per_expert.cumsum(0).to(torch.int32)
        w_gate, w_up, w_down = (w.to(dtype) for w in self._weights())
        hidden = F.silu(torch._grouped_mm(x, w_gate, offs=offsets)) * torch._grouped_mm(
            x, w_up, offs=offsets
        )
        return torch._grouped_mm(hidden, w_down, offs=offsets)


def local(weight: Tensor) -> Tensor:
    """This rank's part of a parameter as a plain tensor: a layer's computation runs on
    plain tensors whatever its parameters are (replicated DTensors under tensor parallelism,
    whose gradients are then the same on every rank; sharded experts under expert
    parallelism)."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


def _compute_dtype(x: Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


# -- the layer ---------------------------------------------------------------------------------

_AUX_LOSS_WEIGHT: contextvars.ContextVar[float] = contextvars.ContextVar(
    "olmolike_moe_aux_loss_weight", default=1.0
)


@contextlib.contextmanager
def aux_loss_weight(weight: float) -> Iterator[None]:
    """The gradient weight of the auxiliary losses of MoE forwards run inside (default 1).

    A train module that normalises its loss over a whole step sets each micro-batch's share
    of the step here (times the data-parallel world size where gradients are averaged), so
    the auxiliary losses are averaged over the step's tokens as the main loss is. Weight 0
    marks forwards that train nothing (a padding micro-batch, a pipeline's shape inference):
    they attach no auxiliary loss and count no routing. The weight is taken when the forward
    runs: a later backward (a pipeline schedule's, a recomputation under activation
    checkpointing) uses it too."""
    token = _AUX_LOSS_WEIGHT.set(float(weight))
    try:
        yield
    finally:
        _AUX_LOSS_WEIGHT.reset(token)


class _AttachAuxLoss(torch.autograd.Function):
    """Returns ``out`` unchanged; its backward also gives ``aux`` the gradient ``weight``, so
    ``aux`` is backpropagated with whatever loss reaches ``out`` (Megatron-LM's trick)."""

    @staticmethod
    def forward(ctx: Any, out: Tensor, aux: Tensor, weight: float) -> Tensor:
        ctx.weight = weight
        ctx.aux_dtype = aux.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, Tensor, None]:
        grad_aux = torch.full((), ctx.weight, dtype=ctx.aux_dtype, device=grad_out.device)
        return grad_out, grad_aux, None


@dataclass
class RoutingStats:
    """One layer's routing since its statistics were last taken, as device tensors (summed
    with ``+``: no host sync). ``None`` until a training forward adds to them."""

    tokens_per_expert: Tensor | None = None
    """``(num_experts,)`` routed copies each expert received."""
    dropped: Tensor | None = None
    """Routed copies that no expert computed (always 0: the layer is dropless)."""
    load_balancing_loss: Tensor | None = None
    """The layer's load-balancing loss, each forward's times its :func:`aux_loss_weight`."""
    z_loss: Tensor | None = None
    """The router z-loss, weighted the same way."""

    def add(self, tokens_per_expert: Tensor, dropped: Tensor, lb: Tensor, z: Tensor) -> None:
        self.tokens_per_expert = _plus(self.tokens_per_expert, tokens_per_expert)
        self.dropped = _plus(self.dropped, dropped)
        self.load_balancing_loss = _plus(self.load_balancing_loss, lb)
        self.z_loss = _plus(self.z_loss, z)

    def take_losses(self) -> tuple[Tensor | None, Tensor | None]:
        """The weighted losses so far, reset (fresh tensors follow: a taken one is never
        changed in place, so it can be recorded as a metric)."""
        losses = self.load_balancing_loss, self.z_loss
        self.load_balancing_loss = self.z_loss = None
        return losses

    def take_load(self) -> tuple[Tensor | None, Tensor | None]:
        """Tokens per expert and dropped copies so far, reset."""
        load = self.tokens_per_expert, self.dropped
        self.tokens_per_expert = self.dropped = None
        return load


def _plus(total: Tensor | None, value: Tensor) -> Tensor:
    return value if total is None else total + value


class MoEFeedForward(nn.Module):
    """The routed experts (and an optional shared expert) of one block; see the module doc."""

    def __init__(
        self, config: TransformerConfig, layer_index: int, shared_expert: nn.Module | None = None
    ) -> None:
        """``shared_expert``: the dense MLP every token also goes through, if the model has one."""
        super().__init__()
        moe = config.moe
        assert moe is not None
        self.layer_index = layer_index
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        d, hidden = config.d_model, config.expert_hidden_size
        self.router = Router(d, moe.num_experts, moe.top_k, moe.normalize_top_k)
        self.experts = Experts(moe.num_experts, d, hidden, moe.expert_compute)
        self.shared_expert = shared_expert
        # Each layer's share of the model's average over its MoE layers.
        n_moe = moe.num_moe_layers(config.n_layers)
        self.lb_coefficient = moe.load_balancing_loss_coefficient / n_moe
        self.z_coefficient = moe.router_z_loss_coefficient / n_moe
        self.dispatcher = TokenDispatcher(moe.num_experts)
        self.stats = RoutingStats()

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        routing = self.router(flat)
        counts = count_tokens(routing.experts, self.num_experts)
        dispatched = self.dispatcher.dispatch(flat, routing.experts, counts)
        expert_out = self.experts(dispatched.tokens, dispatched.tokens_per_expert)
        slots = self.dispatcher.combine(expert_out, dispatched, routing.experts.shape)
        weights = routing.weights.to(slots.dtype).unsqueeze(-1)
        out = (slots * weights).sum(dim=1)
        if self.shared_expert is not None:
            out = out + _swiglu(self.shared_expert, flat)
        weight = _AUX_LOSS_WEIGHT.get()
        if self.training and torch.is_grad_enabled() and weight != 0:
            # The copies sent to an expert and combined back (under expert parallelism
            # expert_out holds the copies other ranks sent here instead).
            computed = dispatched.order.numel()
            out = self._with_aux_losses(out, routing, counts, computed, weight)
        return out.view(*shape[:-1], out.shape[-1])

    def _with_aux_losses(
        self, out: Tensor, routing: Routing, counts: Tensor, computed: int, weight: float
    ) -> Tensor:
        lb = load_balancing_loss(routing.probs, counts)
        z = router_z_loss(routing.logits)
        out = _AttachAuxLoss.apply(out, self.lb_coefficient * lb + self.z_coefficient * z, weight)
        # Autograd re-running this forward (activation checkpointing) must not count twice.
        if torch._C._current_graph_task_id() == -1:
            dropped = routing.experts.numel() - computed  # a host number: no sync
            self.stats.add(
                counts, counts.new_full((), dropped), lb.detach() * weight, z.detach() * weight
            )
        return out


def _swiglu(mlp: nn.Module, x: Tensor) -> Tensor:
    """A dense SwiGLU MLP (``w_gate``, ``w_up``, ``w_down`` linear layers) on plain weights."""
    gate, up, down = (local(getattr(mlp, name).weight) for name in ("w_gate", "w_up", "w_down"))
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def moe_layers(model: nn.Module) -> dict[int, MoEFeedForward]:
    """The MoE layers ``model`` holds (all of a model, or a pipeline rank's stages), by layer."""
    return {m.layer_index: m for m in model.modules() if isinstance(m, MoEFeedForward)}
