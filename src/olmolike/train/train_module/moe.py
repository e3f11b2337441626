"""The metrics of a mixture-of-experts model's routing, recorded by its train module.

The MoE layers add their statistics up on the device as they run
(:class:`~olmolike.nn.moe.RoutingStats`); after every step the train module takes them:

- every step, ``train/load balancing loss`` and ``train/router z-loss``: the step's losses,
  averaged over its tokens and the model's MoE layers (unscaled by their coefficients: a
  perfectly balanced layer's load-balancing loss is its ``top_k``);
- at each metrics collection (and the last step), per layer, the tokens each expert
  received since the previous collection (``moe/layer {i}/expert {e} tokens``, from which
  :class:`~olmolike.train.callbacks.moe_load.MoELoadCallback` derives the max/mean
  imbalance) and ``moe/dropped tokens`` (0: the layers are dropless).

All are device tensors recorded with ``sum`` over the ranks, each already divided by the
ranks that route the same tokens (tensor-parallel ranks compute every token's routing), so
the sums count each token once; recording never syncs with the device.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ...nn.moe import MoEFeedForward, moe_layers
from ..common import ReduceType
from .train_module import TrainModule

__all__ = ["DROPPED_TOKENS", "EXPERT_TOKENS", "MoEMetrics"]

EXPERT_TOKENS = "moe/layer {layer}/expert {expert} tokens"
"""Tokens routed to an expert (over all ranks) since the previous metrics collection."""
DROPPED_TOKENS = "moe/dropped tokens"
"""Routed token copies that no expert computed, every layer together (0: dropless)."""


class MoEMetrics:
    """Takes the routing statistics of a model's MoE layers and records them."""

    def __init__(self, layers: dict[int, MoEFeedForward], n_moe_layers: int, replicas: int):
        self.layers = layers
        self.n_moe_layers = n_moe_layers
        """MoE layers of the whole model (a pipeline rank holds some of them)."""
        self.replicas = replicas
        """Ranks that route the same tokens (the tensor-parallel degree)."""

    @classmethod
    def of(cls, model: nn.Module, replicas: int) -> MoEMetrics | None:
        """For the MoE layers ``model`` holds; ``None`` if it holds none (a dense model, or a
        pipeline rank whose stages are dense)."""
        layers = moe_layers(model)
        if not layers:
            return None
        config = getattr(model, "config", None)
        moe = getattr(config, "moe", None)
        n_layers = getattr(config, "n_layers", None)
        total = len(layers) if moe is None or n_layers is None else moe.num_moe_layers(n_layers)
        return cls(layers, total, replicas)

    def record(self, module: TrainModule, *, weight_sum: int, collect: bool, dry_run: bool) -> None:
        """Take the statistics of the step that ran (always: they must not leak into the
        next step) and, unless ``dry_run``, record them (the loads only if ``collect``).

        The layers' losses were weighted by each micro-batch's share of the step times the
        data-parallel world size (:func:`~olmolike.nn.moe.aux_loss_weight`), weights that
        add up to ``weight_sum`` over the data-parallel ranks."""
        lb_total: torch.Tensor | None = None
        z_total: torch.Tensor | None = None
        for layer in self.layers.values():
            lb, z = layer.stats.take_losses()
            if lb is not None and z is not None:
                lb_total = lb if lb_total is None else lb_total + lb
                z_total = z if z_total is None else z_total + z
        loads = {i: layer.stats.take_load() for i, layer in self.layers.items()} if collect else {}
        if dry_run:
            return
        divisor = self.n_moe_layers * weight_sum * self.replicas
        if lb_total is not None and z_total is not None:
            module.record_metric("load balancing loss", lb_total / divisor, ReduceType.sum, "train")
            module.record_metric("router z-loss", z_total / divisor, ReduceType.sum, "train")
        dropped_total: torch.Tensor | None = None
        for index, (counts, dropped) in loads.items():
            if counts is None or dropped is None:
                continue
            tokens = counts.float() / self.replicas
            for expert in range(tokens.shape[0]):
                name = EXPERT_TOKENS.format(layer=index, expert=expert)
                module.record_metric(name, tokens[expert], ReduceType.sum)
            dropped_total = dropped if dropped_total is None else dropped_total + dropped
        if dropped_total is not None:
            module.record_metric(
                DROPPED_TOKENS, dropped_total.float() / self.replicas, ReduceType.sum
            )
