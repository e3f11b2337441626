"""Which device the trainer sends batches to: where the train module's model lives.

On a GPU machine a model the script kept on the CPU used to get its batches on the GPU
(the trainer defaulted to this rank's GPU) and failed at the first embedding lookup; these
tests stand a GPU in with the meta device, so they run on any machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from testutils import build_trainer

import olmolike.train.config as trainer_config
from olmolike.exceptions import ConfigurationError
from olmolike.nn import TransformerConfig
from olmolike.optim import AdamWConfig
from olmolike.train.train_module import TransformerTrainModuleConfig

META = torch.device("meta")


def test_a_model_on_the_cpu_trains_on_the_cpu_where_the_default_device_is_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(trainer_config, "get_default_device", lambda: META)
    trainer = build_trainer(tmp_path, no_checkpoints=True)
    assert trainer.device == torch.device("cpu")


def test_the_train_modules_own_device_wins_over_its_parameters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(trainer_config, "get_default_device", lambda: META)
    model = TransformerConfig.from_preset("tiny", 64, max_sequence_length=16).build()
    module = TransformerTrainModuleConfig(
        rank_microbatch_size=64, optim=AdamWConfig(lr=1e-3)
    ).build(model, device=torch.device("cpu"))
    assert trainer_config._model_device(module) == torch.device("cpu")


def test_an_explicit_device_that_is_not_the_models_is_refused_at_build(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"device.*'meta'.*model is on cpu.*unset"):
        build_trainer(tmp_path, no_checkpoints=True, device="meta")


def test_an_explicit_device_equal_to_the_models_is_kept(tmp_path: Path) -> None:
    assert build_trainer(tmp_path, no_checkpoints=True, device="cpu").device == torch.device("cpu")
