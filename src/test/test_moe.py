"""Mixture-of-experts blocks: routing, dropless compute (loop and grouped matmul alike), the
auxiliary losses and their gradients, routing statistics, per-layer choice, sizes, init."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from olmolike.exceptions import ConfigurationError
from olmolike.nn import TransformerConfig
from olmolike.nn.moe import (
    ExpertCompute,
    MoEConfig,
    MoEFeedForward,
    Router,
    aux_loss_weight,
    load_balancing_loss,
    moe_layers,
    router_z_loss,
)
from olmolike.nn.transformer import FeedForward
from olmolike.nn.transformer_stage import TransformerParts, TransformerStage

VOCAB = 61


def moe_config(**moe: object) -> TransformerConfig:
    """Sizes are multiples of 4 floats (16 bytes), as torch._grouped_mm needs on the CPU."""
    fields: dict[str, object] = dict(num_experts=4, top_k=2, hidden_size=24)
    return TransformerConfig.moe_tiny(
        VOCAB, d_model=32, n_layers=2, max_sequence_length=64, moe=MoEConfig(**{**fields, **moe})
    )


def ids(batch: int = 2, seq: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def reference_moe(layer: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """The layer's output computed token by token from its weights (no grouping at all)."""
    flat = x.reshape(-1, x.shape[-1])
    probs = F.linear(flat, layer.router.weight).softmax(-1)
    experts = layer.experts
    rows = []
    for t in range(flat.shape[0]):
        top = torch.sort(probs[t], descending=True, stable=True).indices[: layer.top_k]
        out = torch.zeros_like(flat[t])
        for e in top.tolist():
            hidden = F.silu(flat[t] @ experts.w_gate[e]) * (flat[t] @ experts.w_up[e])
            out = out + probs[t, e] * (hidden @ experts.w_down[e])
        if layer.shared_expert is not None:
            out = out + layer.shared_expert(flat[t])
        rows.append(out)
    return torch.stack(rows).view_as(x)


@pytest.mark.parametrize("shared", [None, 20])
def test_every_routed_token_is_computed_as_one_token_alone(shared: int | None) -> None:
    config = moe_config(shared_expert_hidden_size=shared)
    layer = config.build(seed=1).blocks[0].feed_forward
    assert isinstance(layer, MoEFeedForward)
    x = torch.randn(3, 7, 32, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(layer(x), reference_moe(layer, x), rtol=1e-5, atol=1e-6)


def test_dropless_when_every_token_picks_the_same_experts() -> None:
    """However unbalanced the routing, no routed copy is dropped."""
    model = moe_config(num_experts=8, top_k=2).build(seed=0)
    layer = model.blocks[0].feed_forward
    assert isinstance(layer, MoEFeedForward)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[5] = 1.0  # expert 5 first for every token with a positive sum
    x = torch.randn(4, 9, 32).abs()
    with torch.no_grad():
        torch.testing.assert_close(layer(x), reference_moe(layer, x), rtol=1e-5, atol=1e-6)
    layer.train()
    layer(x).sum().backward()
    counts, dropped = layer.stats.take_load()
    assert counts is not None and dropped is not None
    assert counts.tolist() == [36, 0, 0, 0, 0, 36, 0, 0] and dropped.item() == 0


def test_ties_go_to_the_lower_expert_index() -> None:
    router = Router(d_model=8, num_experts=6, top_k=3, normalize=False)
    with torch.no_grad():
        router.weight.zero_()  # every probability 1/6: a six-way tie
        router.weight[4] = 1.0
    x = torch.ones(5, 8)
    routing = router(x)
    assert routing.experts.tolist() == [[4, 0, 1]] * 5
    assert routing.probs.dtype == torch.float32
    torch.testing.assert_close(routing.probs.sum(-1), torch.ones(5))


def test_normalized_top_k_weights_sum_to_one() -> None:
    router = Router(d_model=8, num_experts=6, top_k=3, normalize=True)
    torch.nn.init.normal_(router.weight)
    routing = router(torch.randn(10, 8))
    torch.testing.assert_close(routing.weights.sum(-1), torch.ones(10))
    unnormalized = Router(d_model=8, num_experts=6, top_k=3, normalize=False)
    unnormalized.load_state_dict(router.state_dict())
    assert (unnormalized(torch.randn(10, 8)).weights.sum(-1) < 1).all()


def test_grouped_matmul_gives_the_loops_results_and_gradients() -> None:
    """torch._grouped_mm (forced here on the CPU) and the per-expert loop agree."""
    results = {}
    for compute in (ExpertCompute.loop, ExpertCompute.grouped_mm):
        model = moe_config(expert_compute=compute).build(seed=4)
        model.train()
        logits = model(ids())
        logits.square().mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[compute] = logits.detach(), grads
    (a, grads_a), (b, grads_b) = results.values()
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-4, atol=1e-7)


def test_auto_compute_loops_on_the_cpu() -> None:
    model = moe_config().build(seed=0)
    layer = model.blocks[0].feed_forward
    assert isinstance(layer, MoEFeedForward)
    assert not layer.experts._grouped(torch.zeros(2, 32))


def test_aux_losses_are_backpropagated_as_if_added_to_the_loss() -> None:
    """The attached auxiliary loss gets exactly the gradient of ``loss + weight x aux``,
    averaged over the MoE layers, with the configured coefficients."""
    config = moe_config(load_balancing_loss_coefficient=0.3, router_z_loss_coefficient=0.05)
    attached = config.build(seed=5)
    explicit = config.build(seed=5)
    attached.train()
    with aux_loss_weight(0.7):
        attached(ids()).square().mean().backward()

    # The same forward with the auxiliary losses computed by hand and added to the loss.
    explicit.eval()  # no attached losses
    captured: list[torch.Tensor] = []
    for block in explicit.blocks:
        block.feed_forward.router.register_forward_hook(
            lambda module, args, out: captured.append(out)
        )
    loss = explicit(ids()).square().mean()
    aux = sum(
        0.3 * load_balancing_loss(r.probs, torch.bincount(r.experts.flatten(), minlength=4))
        + 0.05 * router_z_loss(r.logits)
        for r in captured
    )
    (loss + 0.7 * aux / len(captured)).backward()
    for (name, a), b in zip(attached.named_parameters(), explicit.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-8, msg=name)


def test_zero_coefficients_leave_the_gradients_of_the_loss_alone() -> None:
    config = moe_config(load_balancing_loss_coefficient=0.0, router_z_loss_coefficient=0.0)
    trained, plain = config.build(seed=6), config.build(seed=6)
    trained.train()
    trained(ids()).square().mean().backward()
    plain.eval()
    plain(ids()).square().mean().backward()
    for a, b in zip(trained.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    layer = trained.blocks[0].feed_forward
    assert isinstance(layer, MoEFeedForward)
    lb, z = layer.stats.take_losses()
    assert lb is not None and lb > 0 and z is not None and z > 0  # still measured


def test_load_balancing_loss_is_top_k_when_perfectly_balanced() -> None:
    probs = torch.full((8, 4), 0.25)
    counts = torch.tensor([4, 4, 4, 4])  # 8 tokens x top-2 spread evenly
    torch.testing.assert_close(load_balancing_loss(probs, counts), torch.tensor(2.0))
    skewed = torch.tensor([16, 0, 0, 0])
    assert load_balancing_loss(probs, skewed) == load_balancing_loss(probs, counts)
    peaked = torch.tensor([[0.7, 0.1, 0.1, 0.1]] * 8)
    assert load_balancing_loss(peaked, skewed) > 2 * load_balancing_loss(peaked, counts)


def test_statistics_count_training_forwards_only_and_never_a_recomputation() -> None:
    model = moe_config().build(seed=7)
    layers = moe_layers(model)
    assert sorted(layers) == [0, 1]
    with torch.no_grad():
        model(ids())
    model.eval()
    model(ids()).sum().backward()
    assert layers[0].stats.take_load() == (None, None)

    model.train()
    for block in model.blocks:  # activation checkpointing: the backward re-runs the forwards
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    with aux_loss_weight(0.5):
        model(ids(3, 10)).sum().backward()
    for layer in layers.values():
        counts, dropped = layer.stats.take_load()
        assert counts is not None and counts.sum().item() == 3 * 10 * 2
        assert dropped is not None and dropped.item() == 0
        lb, z = layer.stats.take_losses()
        assert lb is not None and z is not None
        assert layer.stats.take_losses() == (None, None)


def test_layers_choose_dense_or_moe() -> None:
    config = moe_config(layers=[1])
    model = config.build(seed=0)
    assert type(model.blocks[0].feed_forward) is FeedForward
    assert isinstance(model.blocks[1].feed_forward, MoEFeedForward)
    assert list(moe_layers(model)) == [1]
    with pytest.raises(ConfigurationError, match=r"moe\.layers: \[5\] are not layers"):
        moe_config(layers=[5])
    with pytest.raises(ConfigurationError, match="top_k: must be between 1 and num_experts=4"):
        MoEConfig(num_experts=4, top_k=5)


@pytest.mark.parametrize(
    "moe", [{}, {"layers": [0], "shared_expert_hidden_size": 16}, {"num_experts": 1, "top_k": 1}]
)
def test_parameter_counts_total_and_active(moe: dict[str, object]) -> None:
    config = moe_config(**moe)
    model = config.build(init_device="meta")
    assert config.num_params() == sum(p.numel() for p in model.parameters())
    expert = 3 * 32 * 24
    inactive = sum(
        (layer.num_experts - layer.top_k) * expert for layer in moe_layers(model).values()
    )
    assert config.num_active_params() == config.num_params() - inactive
    assert (
        config.num_flops_per_token(16)
        == 6 * (config.num_active_non_embedding_params() + VOCAB * 32) + 12 * 2 * 32 * 16
    )


def test_olmoe_preset_has_the_published_sizes() -> None:
    config = TransformerConfig.olmoe_1B_7B(50304)
    assert round(config.num_params() / 1e9, 2) == 6.92
    assert round(config.num_active_params() / 1e9, 2) == 1.28
    assert config.moe is not None and (config.moe.num_experts, config.moe.top_k) == (64, 8)
    first = TransformerConfig.moe_tiny(256)
    first.moe.top_k = 3  # type: ignore[union-attr]
    assert TransformerConfig.moe_tiny(256).moe.top_k == 2  # type: ignore[union-attr]
    # moe_tiny has the active shape of the dense tiny preset, plus routers and QK-norms.
    assert TransformerConfig.moe_tiny(256).num_active_params() - TransformerConfig.tiny(
        256
    ).num_params() == 4 * (8 * 128 + 2 * 128)


def test_pipeline_stages_start_from_the_whole_models_weights() -> None:
    config = moe_config(layers=[1], shared_expert_hidden_size=16)
    whole = config.build(seed=3)
    merged: dict[str, torch.Tensor] = {}
    for index, span in enumerate([range(0, 1), range(1, 2)]):
        stage = TransformerStage(
            config.build(init_device="meta"), span, first=index == 0, last=index == 1
        )
        parts = TransformerParts([stage])
        parts.materialize("cpu", seed=3)
        merged |= parts.state_dict()
    assert merged.keys() == whole.state_dict().keys()
    for name, tensor in whole.state_dict().items():
        assert torch.equal(merged[name], tensor), name


def test_bfloat16_autocast_trains_with_either_expert_computation() -> None:
    """Under autocast the router's logits are bfloat16 (as Hugging Face's), its softmax float32,
    and both expert computations give the same bfloat16 results."""
    outs = []
    for compute in (ExpertCompute.loop, ExpertCompute.grouped_mm):
        model = moe_config(expert_compute=compute, shared_expert_hidden_size=16).build(seed=8)
        model.train()
        captured: list[torch.Tensor] = []
        model.blocks[0].feed_forward.router.register_forward_hook(
            lambda m, a, out, captured=captured: captured.append(out.logits)
        )
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(ids())
        logits.float().square().mean().backward()
        assert captured[0].dtype == torch.bfloat16
        router_grad = model.blocks[0].feed_forward.router.weight.grad
        assert router_grad is not None and torch.isfinite(router_grad).all()
        outs.append(logits.float())
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-2, atol=2e-2)
