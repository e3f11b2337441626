"""SFT and DPO from experiment files under TP=2 x FSDP=2, with the layout given as dotted
overrides (``--train_module.tp_config.degree=2``): the losses equal one process's, and the
checkpoint unshards and exports to Hugging Face as one process's does. GRPO refuses tensor
parallelism with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_train_kinds import experiment, metrics, preference_pairs
from testutils import run_distributed_test

from olmolike.cli import main
from olmolike.data import prepare_sft_data
from olmolike.data.sft_dataset import SFTDatasetConfig
from olmolike.exceptions import ConfigurationError
from olmolike.experiment import load_experiment, train
from olmolike.train.train_module import TransformerTrainModuleConfig
from olmolike.train.train_module.dpo import DPOTrainModuleConfig
from olmolike.train.train_module.grpo import GRPOTrainModuleConfig, RewardConfig

SEQ = 64
LAYOUT = ["--train_module.tp_config.degree=2", "--train_module.dp_config.name=fsdp"]


def _experiments(tmp_path: Path) -> dict[str, Path]:
    source = tmp_path / "sft.jsonl"
    lines = (
        json.dumps({"prompt": f"add {i}", "completion": f"{i}" * (1 + i % 3)}) for i in range(40)
    )
    source.write_text("\n".join(lines) + "\n")
    prepare_sft_data([source], tmp_path / "sft", sequence_length=SEQ)
    sft = TransformerTrainModuleConfig(rank_microbatch_size=SEQ, z_loss_multiplier=1e-3)
    (tmp_path / "sft_run").mkdir()
    dpo = DPOTrainModuleConfig(rank_microbatch_size=SEQ, precompute_reference_logps=True)
    (tmp_path / "dpo_run").mkdir()
    return {
        "sft": experiment(
            tmp_path / "sft_run", SFTDatasetConfig(str(tmp_path / "sft")), sft, 8 * SEQ
        ),
        "dpo": experiment(
            tmp_path / "dpo_run",
            _pairs_dataset(tmp_path),
            dpo,
            4 * 4 * SEQ,  # 4 pairs
        ),
    }


def _pairs_dataset(tmp_path: Path) -> object:
    from olmolike.data.post_training_data import PreferenceDatasetConfig

    return PreferenceDatasetConfig(str(preference_pairs(tmp_path)))


def _train_both(paths: dict[str, str], overrides: list[str], folder: str) -> None:
    for name, path in paths.items():
        save = [f"--trainer.save_folder={folder}/{name}", "--trainer.no_checkpoints=false"]
        train(load_experiment(path, [*overrides, *save]))


def _unsharded_and_exported(checkpoint: Path, out: Path) -> tuple[dict, dict]:
    """The model of ``checkpoint`` by ``olmolike unshard`` and by ``olmolike export-hf``."""
    from safetensors.torch import load_file

    assert main(["unshard", str(checkpoint), str(out / "unsharded")]) == 0
    assert main(["export-hf", str(checkpoint), str(out / "hf")]) == 0
    model = torch.load(out / "unsharded" / "model.pt", weights_only=True)
    hf = {}
    for file in sorted((out / "hf").glob("*.safetensors")):
        hf.update(load_file(file))
    return model, hf


@pytest.mark.slow
def test_sft_and_dpo_train_under_tensor_parallel_with_fsdp(tmp_path: Path) -> None:
    paths = {name: str(path) for name, path in _experiments(tmp_path).items()}
    _train_both(paths, [], str(tmp_path / "one"))
    run_distributed_test(_train_both, 4, args=(paths, LAYOUT, str(tmp_path / "tp")), timeout=600)
    for name in paths:
        want, got = metrics(tmp_path / "one" / name), metrics(tmp_path / "tp" / name)
        assert [m["step"] for m in got] == [1, 2]
        for expected, actual in zip(want, got, strict=True):
            loss = "train/DPO loss" if name == "dpo" else "train/CE loss"
            want_loss, got_loss = (m["metrics"][loss] for m in (expected, actual))
            assert got_loss == pytest.approx(want_loss, abs=1e-5), (name, actual)
    # The TP x FSDP checkpoint unshards and exports to the one-process checkpoint's weights.
    one = _unsharded_and_exported(tmp_path / "one" / "sft" / "step2", tmp_path / "one_out")
    tp = _unsharded_and_exported(tmp_path / "tp" / "sft" / "step2", tmp_path / "tp_out")
    for want_weights, got_weights in zip(one, tp, strict=True):
        assert want_weights.keys() == got_weights.keys() and want_weights
        for key, value in want_weights.items():
            torch.testing.assert_close(got_weights[key], value, rtol=0, atol=1e-5, msg=key)


def test_grpo_refuses_tensor_parallelism_with_the_reason() -> None:
    with pytest.raises(ConfigurationError, match="per-rank seed") as info:
        GRPOTrainModuleConfig(
            rank_microbatch_size=SEQ, rewards=[RewardConfig(name="exact_answer")]
        ).merge(["--tp_config.degree=2"])
    assert "tp_config.degree=1" in str(info.value)
