"""OLMoE and Hugging Face: a tiny random ``OlmoeForCausalLM`` that transformers builds, imported
here (logits, load-balancing loss, routing), exported back, and greedy generation from an
olmolike MoE checkpoint compared with transformers' ``generate``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch
from hf_models import VOCAB, hf_model, token_ids

from olmolike.cli import main
from olmolike.data import TokenTensorDataLoader
from olmolike.data.tokenizer import ByteTokenizer, TokenizerConfig
from olmolike.exceptions import ConfigurationError
from olmolike.inference import load_checkpoint_model
from olmolike.nn import (
    TransformerConfig,
    export_hf,
    generate,
    load_hf_model,
    transformer_config_from_hf,
)
from olmolike.nn.moe import MoEConfig, aux_loss_weight, moe_layers, router_z_loss
from olmolike.optim import AdamWConfig
from olmolike.testing import random_token_instances
from olmolike.train import Duration, TrainerConfig
from olmolike.train.callbacks import CheckpointerCallback, ConfigSaverCallback
from olmolike.train.train_module import TransformerTrainModuleConfig

transformers = pytest.importorskip("transformers")
olmoe = pytest.importorskip("transformers.models.olmoe.modeling_olmoe")


@pytest.fixture(scope="module")
def theirs() -> torch.nn.Module:
    return hf_model("olmoe", seed=11)


@pytest.fixture(scope="module")
def folder(theirs: torch.nn.Module, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("olmoe")
    theirs.save_pretrained(path)
    return path


def test_imported_olmoe_reproduces_the_logits(theirs: torch.nn.Module, folder: Path) -> None:
    ours = load_hf_model(folder).eval()
    config = ours.config
    assert config.moe is not None
    assert (config.moe.num_experts, config.moe.top_k, config.expert_hidden_size) == (8, 2, 16)
    assert not config.moe.normalize_top_k and config.qk_norm and config.block_type == "default"
    ids = token_ids()
    with torch.no_grad():
        want = theirs(ids).logits
        got = ours(ids)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_the_routing_and_load_balancing_loss_equal_transformers(
    theirs: torch.nn.Module, folder: Path
) -> None:
    """Per layer, our load-balancing loss is transformers' ``load_balancing_loss_func`` of
    that layer's router logits, and the routers choose the same experts; the model's loss is
    their mean over the layers (transformers' own pools the layers, equal for one layer)."""
    ours = load_hf_model(folder).train()
    ids = token_ids()
    captured = []
    for block in ours.blocks:
        block.feed_forward.router.register_forward_hook(lambda m, a, out: captured.append(out))
    with torch.no_grad():
        out = theirs(ids, output_router_logits=True)
    with aux_loss_weight(1.0):
        ours(ids).sum().backward()
    per_layer = []
    for index, layer in moe_layers(ours).items():
        theirs_logits = out.router_logits[index]
        torch.testing.assert_close(captured[index].logits, theirs_logits, rtol=0, atol=1e-6)
        want_experts = theirs_logits.softmax(-1).topk(2, dim=-1).indices
        assert torch.equal(captured[index].experts, want_experts)
        lb, z = layer.stats.take_losses()
        want = olmoe.load_balancing_loss_func((theirs_logits,), 8, 2)
        torch.testing.assert_close(lb, want, rtol=1e-6, atol=0)
        torch.testing.assert_close(z, router_z_loss(theirs_logits), rtol=1e-6, atol=0)
        per_layer.append(want)

    one_layer = hf_model("olmoe", seed=12, num_hidden_layers=1)
    with torch.no_grad():
        want_one = one_layer(ids, output_router_logits=True).aux_loss
    folder_one = folder.parent / "one_layer"
    one_layer.save_pretrained(folder_one)
    model_one = load_hf_model(folder_one).train()
    model_one(ids).sum().backward()
    ((lb_one, _),) = (layer.stats.take_losses() for layer in moe_layers(model_one).values())
    torch.testing.assert_close(lb_one, want_one, rtol=1e-6, atol=0)


def test_export_then_import_is_exact_and_transformers_agrees(tmp_path: Path) -> None:
    config = TransformerConfig.olmoe_1B_7B(
        VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_sequence_length=64,
        moe=MoEConfig(num_experts=4, top_k=2, hidden_size=24, normalize_top_k=True),
    )  # fmt: skip
    ours = config.build(seed=3).eval()
    out = export_hf(ours.state_dict(), config, tmp_path / "hf")
    hf = json.loads((out / "config.json").read_text())
    assert hf["architectures"] == ["OlmoeForCausalLM"]
    assert (hf["num_experts"], hf["num_experts_per_tok"], hf["norm_topk_prob"]) == (4, 2, True)
    again = load_hf_model(out)
    assert again.config.moe == config.moe
    mine, back = ours.state_dict(), again.state_dict()
    assert mine.keys() == back.keys()
    for name, tensor in mine.items():
        assert torch.equal(tensor, back[name]), name
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = token_ids()
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids), rtol=0, atol=1e-5)


def test_fused_expert_tensors_import_as_well(theirs: torch.nn.Module, tmp_path: Path) -> None:
    """transformers 5 holds the experts fused (``gate_up_proj``); a folder may too."""
    state = {k: v.contiguous() for k, v in theirs.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    safetensors.torch.save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(theirs.config.to_dict()))
    ours = load_hf_model(tmp_path).eval()
    ids = token_ids()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("moe", "match"),
    [
        ({"layers": [1]}, "dense layers among the MoE ones"),
        ({"shared_expert_hidden_size": 8}, "OLMoE has none"),
    ],
)
def test_moe_without_a_hf_class_is_refused(moe: dict[str, object], match: str) -> None:
    config = TransformerConfig.olmoe_1B_7B(
        VOCAB, d_model=32, n_layers=2, n_heads=4, moe=MoEConfig(num_experts=4, **moe)
    )
    model = config.build(seed=0)
    with pytest.raises(ConfigurationError, match=match):
        export_hf(model.state_dict(), config, "/nonexistent/never/written")


def test_clip_qkv_is_refused(theirs: torch.nn.Module) -> None:
    hf = {**theirs.config.to_dict(), "clip_qkv": 8.0}
    with pytest.raises(ConfigurationError, match=r"clip_qkv=8\.0"):
        transformer_config_from_hf(hf)


def test_raw_config_defaults_follow_olmoe_config() -> None:
    minimal = dict(
        vocab_size=10, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
        num_attention_heads=2, model_type="olmoe",
    )  # fmt: skip
    config = transformer_config_from_hf(minimal)
    defaults = transformers.OlmoeConfig(**minimal)
    assert config.moe is not None
    assert config.moe.num_experts == defaults.num_experts == 64
    assert config.moe.top_k == defaults.num_experts_per_tok == 8
    assert config.moe.normalize_top_k is defaults.norm_topk_prob is False
    assert config.moe.load_balancing_loss_coefficient == defaults.router_aux_loss_coef
    assert (config.norm_eps, config.max_sequence_length) == (1e-5, 4096)
    assert config.qk_norm and config.expert_hidden_size == 24


def test_generate_on_an_moe_checkpoint_equals_transformers_greedy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Train an MoE two steps, then: ``olmolike generate`` prints the same with and without
    the KV cache, and greedy decoding of the checkpoint (cached and not) gives the tokens
    transformers' ``generate`` gives on its ``export-hf``."""
    seq = 16
    model = TransformerConfig.moe_tiny(
        384, d_model=32, n_layers=2, n_heads=4, qk_norm=True, max_sequence_length=64,
        moe=MoEConfig(num_experts=4, top_k=2, hidden_size=16),
    )  # fmt: skip
    module = TransformerTrainModuleConfig(
        rank_microbatch_size=4 * seq, optim=AdamWConfig(lr=1e-2)
    ).build(model.build(init_device="meta"))
    loader = TokenTensorDataLoader(
        random_token_instances(16, seq, ByteTokenizer.VOCAB_SIZE, seed=1),
        global_batch_size=4 * seq,
    )
    config = {"model": model.as_config_dict(), "tokenizer": TokenizerConfig().as_config_dict()}
    TrainerConfig(
        save_folder=str(tmp_path / "run"),
        device="cpu",
        max_duration=Duration.steps(2),
        callbacks={
            "checkpointer": CheckpointerCallback(save_interval=2, pre_train_checkpoint=False),
            "config_saver": ConfigSaverCallback(config=config),
        },
    ).build(module, loader).fit()

    args = ["generate", str(tmp_path / "run"), "--prompt", "def ", "--max-new-tokens", "12"]
    assert main([*args, "--temperature", "0"]) == 0
    cached = capsys.readouterr().out
    assert main([*args, "--temperature", "0", "--no-kv-cache"]) == 0
    assert capsys.readouterr().out == cached

    assert main(["export-hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    prompt = torch.tensor([ByteTokenizer().encode("def "), ByteTokenizer().encode("clas")])
    with torch.no_grad():
        hf = theirs.generate(
            input_ids=prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False,
            pad_token_id=0, eos_token_id=None,
        )  # fmt: skip
    loaded = load_checkpoint_model(str(tmp_path / "run"))
    for use_cache in (True, False):
        ours = generate(loaded.model, prompt, max_new_tokens=20, temperature=0, use_cache=use_cache)
        assert torch.equal(ours, hf)


def test_training_starts_from_olmoe_weights_and_refuses_other_routing(
    theirs: torch.nn.Module, folder: Path
) -> None:
    from olmolike.train.weights import load_pretrained_weights

    config = transformer_config_from_hf(theirs.config.to_dict())
    model = config.build(seed=5).eval()
    load_pretrained_weights(model, str(folder))
    with torch.no_grad():
        torch.testing.assert_close(
            model(token_ids()), theirs(token_ids()).logits, rtol=0, atol=1e-5
        )
    assert config.moe is not None
    other = config.replace(moe=config.moe.replace(top_k=1, load_balancing_loss_coefficient=0.5))
    with pytest.raises(ConfigurationError, match=r"moe\.top_k: 1 vs 2.*--model\.moe\.top_k=2"):
        load_pretrained_weights(other.build(seed=5), str(folder))
    dense = config.replace(moe=None)
    with pytest.raises(
        ConfigurationError,
        match=r"moe: None vs .*--model\.moe\.num_experts=8 --model\.moe\.top_k=2",
    ):
        load_pretrained_weights(dense.build(seed=5), str(folder))
