"""DPO's reference model by config: an HF folder or an olmolike checkpoint, local or remote."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hf_models import VOCAB, hf_logits, save_hf_model, token_ids
from remote_servers import RemoteStore

from olmolike import io
from olmolike.data import TokenTensorDataLoader
from olmolike.data.preference import PreferenceDataLoader
from olmolike.exceptions import CheckpointError, ConfigurationError
from olmolike.nn import TransformerConfig
from olmolike.nn.hf_import import read_hf_config, transformer_config_from_hf
from olmolike.optim import AdamWConfig
from olmolike.testing import random_token_instances
from olmolike.train import Duration, TrainerConfig
from olmolike.train.train_module import TransformerTrainModuleConfig
from olmolike.train.train_module.dpo import DPOTrainModule, DPOTrainModuleConfig

pytest.importorskip("transformers")

SEQ = 12


def config_of(hf_dir: Path) -> TransformerConfig:
    return transformer_config_from_hf(read_hf_config(hf_dir))


def dpo(policy: torch.nn.Module, **fields: Any) -> DPOTrainModule:
    return DPOTrainModuleConfig(rank_microbatch_size=4 * SEQ, **fields).build(policy)


def reference_logits(module: DPOTrainModule) -> torch.Tensor:
    return module.reference.logits(token_ids(SEQ))


def test_reference_from_an_hf_folder_is_frozen_and_outside_the_optimizer(tmp_path: Path) -> None:
    theirs = save_hf_model(tmp_path / "hf", "llama")
    module = dpo(config_of(tmp_path / "hf").build(seed=0), reference=str(tmp_path / "hf"))
    assert (reference_logits(module) - hf_logits(theirs, token_ids(SEQ))).abs().max() <= 1e-5
    assert module.reference.identity()["source"] == str(tmp_path / "hf")
    trained = {id(p) for group in module.optim.param_groups for p in group["params"]}
    assert not trained & {id(p) for p in module.reference.model.parameters()}
    # The policy keeps its own (random) weights: only the reference came from the folder.
    policy_logits = module.model(token_ids(SEQ)).detach()
    assert not torch.allclose(policy_logits, reference_logits(module))


def test_reference_and_precompute_are_command_line_overrides() -> None:
    config = DPOTrainModuleConfig(rank_microbatch_size=SEQ).merge(
        ["reference=gs://bucket/hf-model", "precompute_reference_logps=true"]
    )
    assert config.reference == "gs://bucket/hf-model" and config.precompute_reference_logps
    assert DPOTrainModuleConfig.from_dict(config.as_config_dict()) == config


def test_the_default_reference_is_the_init_weights_not_the_random_policy(tmp_path: Path) -> None:
    theirs = save_hf_model(tmp_path / "hf", "olmo2")
    module = dpo(config_of(tmp_path / "hf").build(seed=0), init_weights=str(tmp_path / "hf"))
    assert (reference_logits(module) - hf_logits(theirs, token_ids(SEQ))).abs().max() <= 1e-5


def test_a_reference_of_another_shape_names_the_fix(tmp_path: Path) -> None:
    save_hf_model(tmp_path / "hf", "llama", hidden_size=48)
    policy = config_of(tmp_path / "hf").replace(d_model=32).build(seed=0)
    with pytest.raises(ConfigurationError, match=r"^reference: the reference model must have") as e:
        dpo(policy, reference=str(tmp_path / "hf"))
    assert "d_model: 32 vs 48" in str(e.value) and "point the reference at" in str(e.value)


def _pretrain(folder: Path, config: TransformerConfig) -> torch.nn.Module:
    module = TransformerTrainModuleConfig(
        rank_microbatch_size=4 * SEQ, optim=AdamWConfig(lr=1e-2)
    ).build(config.build(seed=0))
    loader = TokenTensorDataLoader(
        random_token_instances(16, SEQ, config.vocab_size, seed=1), global_batch_size=4 * SEQ
    )
    TrainerConfig(save_folder=str(folder), max_duration=Duration.steps(2), device="cpu").build(
        module, loader
    ).fit()
    return module.model


def _pairs(count: int, vocab: int) -> torch.Tensor:
    """Random pair rows (chosen ids | labels | rejected ids | labels), 4 prompt tokens."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(count):
        sides = []
        for _ in range(2):
            ids = torch.randint(0, vocab, (SEQ + 1,), generator=g)
            labels = ids[1:].clone()
            labels[:3] = -100
            sides += [ids[:-1], labels]
        rows.append(torch.cat(sides))
    return torch.stack(rows)


def _dpo_run(folder: Path, config: TransformerConfig, reference: str, steps: int = 2) -> Any:
    module = dpo(config.build(seed=0), reference=reference, optim=AdamWConfig(lr=1e-3))
    loader = PreferenceDataLoader(
        _pairs(16, config.vocab_size), global_batch_size=4 * 4 * SEQ, seed=0
    )
    return TrainerConfig(
        save_folder=str(folder), max_duration=Duration.steps(steps), device="cpu"
    ).build(module, loader)


def test_reference_from_a_checkpoint_and_a_resume_against_another(tmp_path: Path) -> None:
    config = TransformerConfig(
        vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2, max_sequence_length=SEQ
    )
    base = _pretrain(tmp_path / "base", config)
    run = _dpo_run(tmp_path / "dpo", config, str(tmp_path / "base"))
    for name, tensor in base.state_dict().items():
        assert torch.equal(run.train_module.reference.model.state_dict()[name], tensor), name
    run.fit()
    assert run.train_module.reference.identity()["source"] == str(tmp_path / "base")
    # The checkpoint holds the reference's identity only, not its weights.
    saved = (tmp_path / "dpo" / "step2" / "train").iterdir()
    assert not any("reference" in p.name for p in saved)
    # Resuming the run with another reference is refused with both fingerprints named.
    _pretrain(tmp_path / "other", config.replace(init_std=0.05))
    again = _dpo_run(tmp_path / "dpo", config, str(tmp_path / "other"), steps=3)
    with pytest.raises(CheckpointError, match="point the reference at the same weights"):
        again.fit()


@pytest.mark.timeout(180)
def test_remote_reference(tmp_path: Path, s3_bucket: RemoteStore) -> None:
    theirs = save_hf_model(tmp_path / "hf", "olmo2")
    io.persist(tmp_path, s3_bucket.url(), "hf")
    module = dpo(config_of(tmp_path / "hf").build(seed=0), reference=s3_bucket.url("hf"))
    assert (reference_logits(module) - hf_logits(theirs, token_ids(SEQ))).abs().max() <= 1e-5


def test_an_hf_folder_of_an_unsupported_architecture_names_it(tmp_path: Path) -> None:
    import transformers

    gpt2 = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=VOCAB)
    transformers.GPT2LMHeadModel(gpt2).save_pretrained(tmp_path / "gpt2")
    policy = TransformerConfig(vocab_size=VOCAB, d_model=32, n_layers=1, n_heads=2).build(seed=0)
    with pytest.raises(ConfigurationError, match=r"^reference: .*unsupported Hugging Face arch"):
        dpo(policy, reference=str(tmp_path / "gpt2"))


def _reference_on_ranks(hf_dir: str) -> tuple[torch.Tensor, bool]:
    from torch.distributed.tensor import DTensor

    from olmolike.distributed.parallel import DataParallelConfig

    module = dpo(
        config_of(Path(hf_dir)).build(seed=0),
        reference=hf_dir,
        dp_config=DataParallelConfig.from_dict({"name": "fsdp"}),
    )
    sharded = all(isinstance(p, DTensor) for p in module.reference.model.parameters())
    return reference_logits(module), sharded


@pytest.mark.timeout(200)
def test_reference_from_an_hf_folder_is_sharded_like_the_policy_on_two_ranks(
    tmp_path: Path,
) -> None:
    from testutils import run_distributed_test

    theirs = save_hf_model(tmp_path / "hf", "llama")
    want = hf_logits(theirs, token_ids(SEQ))
    for logits, sharded in run_distributed_test(
        _reference_on_ranks, 2, args=(str(tmp_path / "hf"),), timeout=180
    ):
        assert (logits - want).abs().max() <= 1e-5
        assert sharded
