"""Evaluating a checkpoint without training: ``olmolike evaluate`` and a zero-step trainer run."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from olmolike.cli import main
from olmolike.data import TokenTensorDataLoader
from olmolike.data.numpy_dataset import NumpyDatasetConfig
from olmolike.data.tokenizer import TokenizerConfig
from olmolike.exceptions import CheckpointError, ConfigurationError, DataError
from olmolike.inference import evaluate_checkpoint, load_checkpoint_model
from olmolike.nn import TransformerConfig
from olmolike.optim import AdamWConfig
from olmolike.testing import random_token_instances
from olmolike.train import Callback, Duration, Trainer, TrainerConfig
from olmolike.train.callbacks import (
    CheckpointerCallback,
    ConfigSaverCallback,
    LMEvaluatorCallbackConfig,
)
from olmolike.train.train_module import TransformerTrainModuleConfig

SEQ_LEN = 16
VOCAB = 64
MODEL = TransformerConfig(
    vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_sequence_length=32
)


@dataclass
class Runs:
    save: Path
    data: Path
    """Eval tokens: 11 instances of SEQ_LEN in one file, plus a tail that is dropped."""


@dataclass
class MetricLog(Callback):
    metrics: dict[int, dict[str, float]] = field(default_factory=dict)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.metrics.setdefault(step, {}).update(metrics)


def build(save: Path, steps: int, **config: Any) -> Trainer:
    module = TransformerTrainModuleConfig(
        rank_microbatch_size=4 * SEQ_LEN, optim=AdamWConfig(lr=1e-2)
    ).build(MODEL.build(seed=0))
    loader = TokenTensorDataLoader(
        random_token_instances(32, SEQ_LEN, VOCAB, seed=1), global_batch_size=4 * SEQ_LEN
    )
    return TrainerConfig(
        save_folder=str(save), device="cpu", max_duration=Duration.steps(steps), **config
    ).build(module, loader)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    root = tmp_path_factory.mktemp("eval")
    experiment = {
        "model": MODEL.as_config_dict(),
        "tokenizer": TokenizerConfig().as_config_dict(),
        "dataset": {"paths": ["unused"], "sequence_length": SEQ_LEN},
    }
    callbacks = {
        "checkpointer": CheckpointerCallback(save_interval=1, pre_train_checkpoint=False),
        "config_saver": ConfigSaverCallback(config=experiment),
    }
    build(root / "run", 2, callbacks=callbacks).fit()
    data = root / "data"
    data.mkdir()
    tokens = np.random.default_rng(3).integers(0, VOCAB, 11 * SEQ_LEN + 5, dtype=np.uint16)
    np.save(data / "part-0.npy", tokens)
    return Runs(root / "run", data)


def reference_ce(checkpoint: Path, data: Path, instances: int | None = None) -> float:
    """Mean CE over every label of the first ``instances`` whole instances, in one forward."""
    model = load_checkpoint_model(checkpoint).model
    tokens = np.load(data / "part-0.npy").astype(np.int64)
    rows = torch.from_numpy(tokens[: len(tokens) // SEQ_LEN * SEQ_LEN]).reshape(-1, SEQ_LEN)
    rows = rows[:instances]
    with torch.no_grad():
        logits = model(rows).double()
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), rows[:, 1:].reshape(-1)).item()


# -- evaluate_checkpoint ---------------------------------------------------------------------


def test_loss_is_the_mean_ce_over_all_instances(runs: Runs) -> None:
    metrics = evaluate_checkpoint(runs.save / "step2", [str(runs.data)], batch_size=4)
    assert metrics["CE loss"] == pytest.approx(reference_ce(runs.save / "step2", runs.data))
    assert metrics["PPL"] == pytest.approx(np.exp(metrics["CE loss"]), rel=1e-5)


def test_save_folder_means_its_newest_checkpoint(runs: Runs) -> None:
    newest = evaluate_checkpoint(runs.save, [str(runs.data / "*.npy")])
    assert newest == evaluate_checkpoint(runs.save / "step2", [str(runs.data)])
    assert newest != evaluate_checkpoint(runs.save / "step1", [str(runs.data)])


def test_max_batches_limits_the_instances(runs: Runs) -> None:
    metrics = evaluate_checkpoint(runs.save, [str(runs.data)], batch_size=2, max_batches=2)
    assert metrics["CE loss"] == pytest.approx(reference_ce(runs.save / "step2", runs.data, 4))


def test_sequence_length_default_comes_from_the_experiment_config(
    runs: Runs, tmp_path: Path
) -> None:
    shorter = evaluate_checkpoint(runs.save, [str(runs.data)], sequence_length=8)
    assert shorter != evaluate_checkpoint(runs.save, [str(runs.data)])
    shutil.copytree(runs.save / "step2", tmp_path / "run")
    (tmp_path / "run" / "config.json").unlink()  # so the folder's copy, written next, is used
    config = json.loads((runs.save / "config.json").read_text())
    del config["dataset"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigurationError, match=r"sequence_length.*--sequence-length"):
        evaluate_checkpoint(tmp_path / "run", [str(runs.data)])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"max_batches": 0}, "max_batches"),
        ({"sequence_length": 0}, "sequence_length"),
        ({"sequence_length": 64}, "max_sequence_length"),
    ],
)
def test_bad_arguments_are_clear_errors(runs: Runs, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        evaluate_checkpoint(runs.save, [str(runs.data)], **kwargs)


def test_data_shorter_than_one_instance_is_refused(runs: Runs, tmp_path: Path) -> None:
    np.save(tmp_path / "part-0.npy", np.arange(SEQ_LEN - 1, dtype=np.uint16))
    with pytest.raises(DataError, match="lower sequence_length"):
        evaluate_checkpoint(runs.save, [str(tmp_path)])


def test_data_from_a_larger_vocabulary_is_refused(runs: Runs, tmp_path: Path) -> None:
    np.save(tmp_path / "part-0.npy", np.arange(64, dtype=np.uint16))
    (tmp_path / "metadata.json").write_text(json.dumps({"vocab_size": 1000, "eos_token_id": 0}))
    with pytest.raises(DataError, match="another tokenizer"):
        evaluate_checkpoint(runs.save, [str(tmp_path)])


# -- the command line ------------------------------------------------------------------------


def test_cli_prints_loss_and_perplexity(runs: Runs, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["evaluate", str(runs.save), "--data", str(runs.data), "--batch-size", "4"]
    assert main(args) == 0
    expected = evaluate_checkpoint(runs.save, [str(runs.data)], batch_size=4)
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"CE loss: {expected['CE loss']:.6f}", f"PPL: {expected['PPL']:.6f}"]


def test_cli_errors_are_one_line(
    runs: Runs, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["evaluate", str(tmp_path / "nothing"), "--data", str(runs.data)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("error: ")
    assert main(["evaluate", str(runs.save), "--data", str(tmp_path / "none*.npy")]) == 2
    assert capsys.readouterr().err.startswith("error: ")


# -- evaluating in the trainer without training ----------------------------------------------


def eval_only_trainer(runs: Runs, save: Path, **config: Any) -> tuple[Trainer, MetricLog]:
    log = MetricLog()
    evaluator = LMEvaluatorCallbackConfig(
        eval_dataset=NumpyDatasetConfig(paths=[str(runs.data)], sequence_length=SEQ_LEN),
        eval_batch_size=4,
        eval_on_startup=True,
    )
    trainer = build(
        save,
        10,
        load_path=str(runs.save / "step2"),
        hard_stop=Duration.steps(2),
        no_checkpoints=True,
        callbacks={"lm_evaluator": evaluator, "log": log},
        **config,
    )
    return trainer, log


def test_hard_stop_at_the_loaded_step_evaluates_without_training(
    runs: Runs, tmp_path: Path
) -> None:
    trainer, log = eval_only_trainer(runs, tmp_path / "eval")
    trainer.fit()
    assert trainer.global_step == 2
    assert list(log.metrics) == [2]
    assert not any(name.startswith("train/") for name in log.metrics[2])
    expected = evaluate_checkpoint(runs.save / "step2", [str(runs.data)], batch_size=4)
    assert log.metrics[2]["eval/lm/CE loss"] == pytest.approx(expected["CE loss"])
    loaded = load_checkpoint_model(runs.save / "step2").model.state_dict()
    live = trainer.train_module.model.state_dict()  # type: ignore[attr-defined]
    assert all(torch.equal(live[k], v) for k, v in loaded.items())
    assert not list((tmp_path / "eval").glob("step*"))


def test_no_evals_still_disables_the_startup_evaluation(runs: Runs, tmp_path: Path) -> None:
    trainer, log = eval_only_trainer(runs, tmp_path / "eval", no_evals=True)
    trainer.fit()
    assert not any(name.startswith("eval/") for m in log.metrics.values() for name in m)


def test_missing_checkpoint_to_evaluate_is_an_error(runs: Runs, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="neither a complete checkpoint"):
        evaluate_checkpoint(tmp_path / "missing", [str(runs.data)])
