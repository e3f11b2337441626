"""The transformer: shapes, causality, GQA, weight tying, meta init, sizes, FLOPs, configs."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from olmolike.config import Config
from olmolike.exceptions import ConfigurationError
from olmolike.nn import Transformer, TransformerConfig, TransformerPreset
from olmolike.nn.rope import apply_rotary

VOCAB = 97


def micro(**overrides: object) -> TransformerConfig:
    """A model small enough that a forward pass takes about a millisecond."""
    fields: dict[str, object] = dict(
        vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, max_sequence_length=64
    )
    return TransformerConfig(**{**fields, **overrides})  # type: ignore[arg-type]


def random_ids(batch: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


def test_forward_shape_and_dtype() -> None:
    model = micro().build(seed=0)
    logits = model(random_ids(3, 11))
    assert logits.shape == (3, 11, VOCAB)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("overrides", [{}, {"n_kv_heads": 2, "qk_norm": True}])
def test_causal(overrides: dict[str, object]) -> None:
    model = micro(**overrides).build(seed=0)
    ids = random_ids(2, 16)
    changed = ids.clone()
    changed[:, 9] = (changed[:, 9] + 1) % VOCAB
    before, after = model(ids), model(changed)
    torch.testing.assert_close(before[:, :9], after[:, :9], rtol=0, atol=0)
    assert not torch.allclose(before[:, 9:], after[:, 9:])


def test_gqa_shapes() -> None:
    model = micro(n_heads=4, n_kv_heads=2).build(seed=0)
    attention = model.blocks[0].attention
    assert attention.w_q.weight.shape == (32, 32)
    assert attention.w_k.weight.shape == (16, 32)
    assert attention.w_v.weight.shape == (16, 32)
    assert model(random_ids(2, 5)).shape == (2, 5, VOCAB)


def test_gqa_equals_attention_with_repeated_kv_heads() -> None:
    """Query head h must read kv head h // group, the grouping Llama checkpoints assume."""
    gqa = micro(n_heads=4, n_kv_heads=2).build(seed=0)
    mha = micro(n_heads=4).build(seed=1)
    state = gqa.state_dict()
    for name, tensor in list(state.items()):
        if name.endswith(("w_k.weight", "w_v.weight")):
            heads = tensor.view(2, 8, 32)  # (kv_heads, head_dim, d_model)
            state[name] = heads.repeat_interleave(2, dim=0).reshape(32, 32)
    mha.load_state_dict(state)
    ids = random_ids(2, 12)
    torch.testing.assert_close(gqa(ids), mha(ids))


def test_kv_heads_equal_to_heads_is_plain_attention() -> None:
    ids = random_ids(2, 8)
    plain = micro().build(seed=3)
    explicit = micro(n_kv_heads=4).build(seed=3)
    torch.testing.assert_close(plain(ids), explicit(ids), rtol=0, atol=0)


def test_rope_matches_complex_rotation() -> None:
    """Rotate-half RoPE: feature pair (i, i + d/2) turns by position * theta^(-2i/d)."""
    model = micro(rope_theta=100.0).build(seed=0)
    head_dim, seq_len = 8, 5
    cos, sin = model.rope(seq_len)
    x = torch.randn(seq_len, head_dim)
    angles = torch.arange(seq_len)[:, None] * 100.0 ** (-torch.arange(0, head_dim, 2) / head_dim)
    as_complex = torch.complex(x[:, : head_dim // 2], x[:, head_dim // 2 :]) * torch.polar(
        torch.ones_like(angles), angles
    )
    expected = torch.cat((as_complex.real, as_complex.imag), dim=-1)
    torch.testing.assert_close(apply_rotary(x, cos, sin), expected)


def test_tied_weights_share_storage() -> None:
    model = micro(tie_weights=True).build(seed=0)
    assert model.lm_head.weight is model.embeddings.weight
    assert model.lm_head.weight.data_ptr() == model.embeddings.weight.data_ptr()


def test_meta_build_allocates_nothing_then_materializes_like_a_direct_build() -> None:
    for tie in (False, True):
        config = micro(tie_weights=tie, qk_norm=True, n_kv_heads=2)
        meta = config.build(init_device="meta")
        tensors = [*meta.parameters(), *meta.buffers()]
        assert all(t.device.type == "meta" for t in tensors)
        meta.materialize("cpu", seed=7)
        direct = config.build(seed=7)
        assert meta.state_dict().keys() == direct.state_dict().keys()
        for name, tensor in direct.state_dict().items():
            torch.testing.assert_close(meta.state_dict()[name], tensor, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(meta.rope.cos, direct.rope.cos, rtol=0, atol=0)
        if tie:
            assert meta.lm_head.weight is meta.embeddings.weight
        ids = random_ids(1, 6)
        torch.testing.assert_close(meta(ids), direct(ids), rtol=0, atol=0)


def test_init_is_seeded_and_leaves_global_rng_alone() -> None:
    state = torch.get_rng_state()
    a, b = micro().build(seed=1), micro().build(seed=1)
    assert torch.equal(torch.get_rng_state(), state)
    c = micro().build(seed=2)
    assert torch.equal(a.blocks[0].attention.w_q.weight, b.blocks[0].attention.w_q.weight)
    assert not torch.equal(a.blocks[0].attention.w_q.weight, c.blocks[0].attention.w_q.weight)


def test_init_scales_output_projections() -> None:
    config = micro(d_model=256, n_heads=4, n_layers=3, mlp_hidden_size=512, vocab_size=512)
    model = config.build(seed=0)
    out_std = config.init_std / math.sqrt(2 * config.n_layers)
    block = model.blocks[0]
    assert block.attention.w_q.weight.std().item() == pytest.approx(config.init_std, rel=0.05)
    assert block.attention.w_out.weight.std().item() == pytest.approx(out_std, rel=0.05)
    assert block.feed_forward.w_down.weight.std().item() == pytest.approx(out_std, rel=0.05)
    assert model.lm_head.weight.std().item() == pytest.approx(config.init_std, rel=0.05)
    assert (block.attention.w_q.weight.abs() <= 3 * config.init_std).all()
    assert torch.equal(block.attention_norm.weight, torch.ones(256))


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"tie_weights": True},
        {"n_kv_heads": 1, "qk_norm": True},
        {"n_kv_heads": 2, "mlp_hidden_size": 48, "tie_weights": True, "qk_norm": True},
        {"mlp_multiple_of": 7},
    ],
)
def test_num_params_counts_each_parameter_once(overrides: dict[str, object]) -> None:
    config = micro(**overrides)
    model = config.build(init_device="meta")
    assert config.num_params() == sum(p.numel() for p in model.parameters())
    embeddings = VOCAB * 32 * (1 if config.tie_weights else 2)
    assert config.num_non_embedding_params() == config.num_params() - embeddings


def test_hidden_size_default_is_eight_thirds_rounded_up() -> None:
    assert micro(d_model=96, mlp_multiple_of=64).hidden_size == 256  # 8/3 * 96 = 256 exactly
    assert micro(d_model=128, mlp_multiple_of=256).hidden_size == 512  # 341.3 -> 512
    assert micro(mlp_hidden_size=40).hidden_size == 40


def test_num_flops_per_token_matches_a_hand_count() -> None:
    config = micro(n_kv_heads=2, tie_weights=True)  # d=32, 2 layers, 4 heads of 8, vocab 97
    seq_len = 50
    hidden = 256  # 8/3 * 32 = 85.3 rounded up to a multiple of 256
    # Multiply-adds per token of every matmul, forward only.
    per_layer = 32 * 32 + 32 * 16 + 32 * 16 + 32 * 32 + 3 * 32 * hidden
    per_layer_attention = 2 * seq_len * 32  # q @ k^T and scores @ v over the full sequence
    lm_head = 32 * VOCAB
    norms = 2 * 2 * 32 + 32  # counted like weights by the 6N convention
    forward_macs = 2 * (per_layer + per_layer_attention) + lm_head + norms
    # 2 FLOPs per multiply-add, and the backward pass costs twice the forward.
    assert config.num_flops_per_token(seq_len) == 3 * 2 * forward_macs
    assert config.build(init_device="meta").num_flops_per_token(seq_len) == 3 * 2 * forward_macs


@pytest.mark.parametrize(
    ("preset", "vocab", "expected"),
    [
        (TransformerPreset.olmo2_1B, 100_352, 1_484_916_736),  # OLMo-2-0425-1B on the HF hub
        (TransformerPreset.olmo2_7B, 100_352, 7_298_617_344),  # OLMo-2-1124-7B
        (TransformerPreset.llama2_7B, 32_000, 6_738_415_616),  # Llama-2-7b-hf
        (TransformerPreset.llama3_8B, 128_256, 8_030_261_248),  # Meta-Llama-3-8B
    ],
)
def test_published_presets_have_published_sizes(
    preset: TransformerPreset, vocab: int, expected: int
) -> None:
    config = TransformerConfig.from_preset(preset, vocab)
    assert config.num_params() == expected
    model = config.build(init_device="meta")
    assert sum(p.numel() for p in model.parameters()) == expected


def test_every_preset_builds_on_meta_with_its_nominal_size() -> None:
    nominal = {"olmo2_30M": 30e6, "olmo2_190M": 190e6}
    for preset in TransformerPreset:
        config = getattr(TransformerConfig, preset.value)(260)
        assert config == TransformerConfig.from_preset(preset.value, 260)
        model = config.build(init_device="meta")
        assert sum(p.numel() for p in model.parameters()) == config.num_params()
        if preset.value in nominal:
            ratio = config.num_non_embedding_params() / nominal[preset.value]
            assert 0.95 < ratio < 1.05, preset
    assert 0.9e6 < TransformerConfig.tiny(260).num_params() < 1.3e6
    assert TransformerConfig.olmo2_1B(100_352).qk_norm


def test_presets_take_overrides_and_reject_unknown_names() -> None:
    assert TransformerConfig.tiny(260, n_layers=2, tie_weights=True).n_layers == 2
    with pytest.raises(ConfigurationError, match="choose one of: tiny, small"):
        TransformerConfig.from_preset("olmo2_2B", 260)
    with pytest.raises(ConfigurationError, match="n_layer"):
        TransformerConfig.tiny(260, n_layer=2)


def test_config_round_trip_and_merge() -> None:
    config = micro(n_kv_heads=2, qk_norm=True)
    data = config.as_config_dict()
    assert TransformerConfig.from_dict(data) == config
    merged = config.merge(["--n_layers=3", "--rope_theta=1e4", "--n_kv_heads=null"])
    assert (merged.n_layers, merged.rope_theta, merged.n_kv_heads) == (3, 10_000.0, None)
    with pytest.raises(ConfigurationError, match="n_kv_heads"):
        config.merge(["--n_kv_heads=3"])


def test_a_config_file_written_before_the_config_moved_still_loads() -> None:
    # Checkpoints saved while TransformerConfig lived in olmolike.nn.transformer name it so in
    # their config.json; a section of a larger config resolves that name through the registry.
    @dataclass
    class Experiment(Config):
        model: TransformerConfig

    config = micro()
    data = {
        "model": {**config.as_config_dict(), "_CLASS_": "olmolike.nn.transformer.TransformerConfig"}
    }
    assert Experiment.from_dict(data).model == config


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"d_model": 30}, "n_heads"),
        ({"d_model": 12, "n_heads": 4}, "n_heads"),  # head_dim 3 is odd
        ({"n_kv_heads": 3}, "n_kv_heads"),
        ({"n_kv_heads": 0}, "n_kv_heads"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"n_layers": -1}, "n_layers"),
        ({"max_sequence_length": 0}, "max_sequence_length"),
        ({"mlp_hidden_size": 0}, "mlp_hidden_size"),
        ({"norm_eps": 0.0}, "norm_eps"),
        ({"rope_theta": -1.0}, "rope_theta"),
        ({"init_std": 0.0}, "init_std"),
    ],
)
def test_invalid_config_names_the_field(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        micro(**overrides)
    assert info.value.path == field


def test_too_long_or_unbatched_input_is_a_clear_error() -> None:
    model = micro(max_sequence_length=8).build(seed=0)
    with pytest.raises(ValueError, match="max_sequence_length is 8"):
        model(random_ids(1, 9))
    with pytest.raises(ValueError, match="unsqueeze"):
        model(random_ids(1, 4)[0])


def test_bf16_forward_keeps_rope_in_float32() -> None:
    model = micro().build(seed=0)
    ids = random_ids(2, 16)
    reference = model(ids)
    model = model.to(torch.bfloat16)
    assert model.rope.cos.dtype == torch.float32
    logits = model(ids)
    assert logits.dtype == torch.bfloat16
    torch.testing.assert_close(logits.float(), reference, atol=0.05, rtol=0.05)


def test_loss_falls_when_training_on_a_repeated_sequence() -> None:
    torch.manual_seed(0)
    model = micro(n_kv_heads=2, qk_norm=True).build(seed=0)
    pattern = torch.tensor([5, 17, 3, 42, 8, 91, 23, 60])
    ids = pattern.repeat(4).unsqueeze(0).repeat(2, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] > math.log(VOCAB) - 0.5
    assert losses[-1] < 0.3 * losses[0]


def test_materialize_returns_the_model_on_the_device() -> None:
    model = micro().build(init_device="meta")
    assert isinstance(model.materialize(torch.device("cpu"), seed=0), Transformer)
    assert model.embeddings.weight.device.type == "cpu"
    assert model.rope.sin.device.type == "cpu"


def _fsdp_materialized_weights() -> dict[bool, dict[str, torch.Tensor]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    weights = {}
    for tie in (False, True):
        model = fsdp_config(tie).build(init_device="meta")
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.materialize("cpu", seed=11)
        assert (model.lm_head.weight is model.embeddings.weight) == tie
        model(random_ids(2, 8)).sum().backward()  # the materialised shards train
        weights[tie] = {
            name: tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            for name, tensor in model.state_dict().items()
        }
    return weights


def fsdp_config(tie: bool) -> TransformerConfig:
    # An odd vocabulary and MLP width shard unevenly over two ranks.
    return micro(tie_weights=tie, n_kv_heads=2, qk_norm=True, mlp_hidden_size=41)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_fsdp_sharded_materialize_equals_an_unsharded_build() -> None:
    """Every shard gets its slice of the same draw, so no rows repeat across ranks."""
    from testutils import run_distributed_test

    for per_tie in run_distributed_test(_fsdp_materialized_weights):
        for tie, weights in per_tie.items():
            expected = fsdp_config(tie).build(seed=11).state_dict()
            assert weights.keys() == expected.keys()
            for name, tensor in expected.items():
                torch.testing.assert_close(weights[name], tensor, rtol=0, atol=0, msg=name)
