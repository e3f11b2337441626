"""OLMo-core 3.0's checkpoint evaluation: checkpoints_to_eval, Trainer.eval_checkpoints(),
build(eval_only=True), and TrainerConfig.with_recommended_evals."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from testutils import SEQ_LEN, VOCAB, build_trainer, full_params

from olmolike.data import TokenTensorDataLoader
from olmolike.exceptions import ConfigurationError
from olmolike.testing import TinyCausalLM, random_token_instances
from olmolike.train import BasicTrainModule, Callback, Checkpointer, Duration, TrainerConfig
from olmolike.train.callbacks import (
    CheckpointerCallback,
    EvaluatorCallback,
    LMEvaluatorCallbackConfig,
)
from olmolike.train.callbacks.evaluator import Evaluator


class WeightSum(Evaluator):
    def __init__(self) -> None:
        super().__init__("probe")

    def evaluate(self, train_module: Any) -> dict[str, torch.Tensor]:
        total = sum(p.detach().double().sum() for p in train_module.model.parameters())
        return {"sum": torch.as_tensor(total)}


@dataclass
class Log(Callback):
    metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    weights: dict[int, float] = field(default_factory=dict)
    hooks: list[str] = field(default_factory=list)

    def pre_train(self) -> None:
        self.hooks.append("pre_train")

    def post_step(self) -> None:
        self.weights[self.step] = sum(p.double().sum().item() for p in full_params(self.trainer))

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.metrics.setdefault(step, {}).update(metrics)

    def post_train(self) -> None:
        self.hooks.append("post_train")


def eval_trainer(save: Path, config: TrainerConfig) -> Any:
    torch.manual_seed(5)  # other initial weights: only loading can make the sums match
    model = TinyCausalLM(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2, max_seq_len=SEQ_LEN)
    module = BasicTrainModule(model, torch.optim.AdamW(model.parameters()), 8 * SEQ_LEN)
    loader = TokenTensorDataLoader(
        random_token_instances(16, SEQ_LEN, VOCAB), global_batch_size=8 * SEQ_LEN
    )
    return config.build(module, loader, eval_only=True)


def test_eval_checkpoints_logs_each_checkpoint_at_its_step(tmp_path: Path) -> None:
    run = Log()
    build_trainer(
        tmp_path / "run",
        max_duration=Duration.steps(4),
        callbacks={"log": run, "checkpointer": CheckpointerCallback(save_interval=2)},
    ).fit()
    log = Log()
    config = TrainerConfig(
        save_folder=str(tmp_path / "eval"),
        checkpoints_to_eval=[str(tmp_path / "run" / "step2"), str(tmp_path / "run")],
        callbacks={
            "eval": EvaluatorCallback(evaluators=[WeightSum()], eval_interval=None),
            "log": log,
        },
    )
    trainer = eval_trainer(tmp_path / "eval", config)
    trainer.eval_checkpoints()
    assert sorted(log.metrics) == [2, 4]
    for step in (2, 4):
        assert log.metrics[step]["eval/probe/sum"] == pytest.approx(run.weights[step], rel=1e-6)
    assert log.hooks == ["pre_train", "post_train"]
    assert not Checkpointer.contains_checkpoint(tmp_path / "eval")  # eval_only saves nothing


def test_eval_checkpoints_needs_checkpoints_and_an_evaluator(tmp_path: Path) -> None:
    no_list = eval_trainer(tmp_path, TrainerConfig(save_folder=str(tmp_path / "a")))
    with pytest.raises(ConfigurationError, match="checkpoints_to_eval"):
        no_list.eval_checkpoints()
    no_eval = eval_trainer(tmp_path, TrainerConfig(save_folder=str(tmp_path / "b")))
    with pytest.raises(ConfigurationError, match="evaluator"):
        no_eval.eval_checkpoints([str(tmp_path)])


def test_checkpoints_to_eval_round_trips_and_eval_only_resumes_nothing(tmp_path: Path) -> None:
    config = TrainerConfig(save_folder="/s", checkpoints_to_eval=["gs://b/run/step100"])
    assert TrainerConfig.from_dict(config.as_config_dict()) == config
    build_trainer(tmp_path, max_duration=Duration.steps(2)).fit()
    trainer = eval_trainer(tmp_path, TrainerConfig(save_folder=str(tmp_path)))
    assert trainer.no_checkpoints and trainer.load_strategy == "never"


def test_with_recommended_evals() -> None:
    base = TrainerConfig(save_folder="/s")
    config = base.with_recommended_evals(None, 128, eval_data=["data/val.npy"], eval_interval=500)
    evaluator = config.callbacks["lm_evaluator"]
    assert isinstance(evaluator, LMEvaluatorCallbackConfig)
    assert (evaluator.eval_interval, evaluator.eval_on_finish) == (500, True)
    assert evaluator.eval_dataset is not None and evaluator.eval_dataset.sequence_length == 128
    assert "lm_evaluator" not in base.callbacks
    with pytest.raises(ConfigurationError, match="eval_data"):
        base.with_recommended_evals(None, 128, "some-cluster")
    with pytest.raises(ConfigurationError, match="eval_data"):
        base.with_recommended_evals(None, 128)
