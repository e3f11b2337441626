"""ModelMergeCallback: averaged weights over a window, saved as a model-only checkpoint."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from testutils import SEQ_LEN, VOCAB, build_trainer, full_params

from olmolike.distributed.checkpoint import load_model_and_optim_state
from olmolike.exceptions import ConfigurationError
from olmolike.testing import TinyCausalLM
from olmolike.train import Callback, Checkpointer, Duration
from olmolike.train.callbacks import (
    CheckpointerCallback,
    EvaluatorCallback,
    ModelMergeCallback,
    compute_merge_steps_from_decay_schedule,
    compute_merge_window_starts,
)
from olmolike.train.callbacks.evaluator import Evaluator


def test_merge_steps_from_a_decay_schedule() -> None:
    assert compute_merge_steps_from_decay_schedule([1000, 2000], 10, decay=200) == [80, 280]
    assert compute_merge_steps_from_decay_schedule([1000, 2000], 10, decay_fraction=0.1) == [
        90,
        280,
    ]
    with pytest.raises(ValueError, match="Either decay or decay_fraction"):
        compute_merge_steps_from_decay_schedule([1000], 10)


def test_merge_window_starts_group_overlapping_windows() -> None:
    assert compute_merge_window_starts([400, 100, 150], 100) == [1, 301]
    assert compute_merge_window_starts([500, 550, 1000], 100) == [401, 901]
    assert compute_merge_window_starts([50], 100) == [0]
    assert compute_merge_window_starts([], 10) == []


@dataclass
class WeightLog(Callback):
    """The full weights after each step, and the steps of completed checkpoint saves."""

    weights: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    saved: list[str] = field(default_factory=list)
    metrics: dict[int, dict[str, float]] = field(default_factory=dict)

    def post_step(self) -> None:
        self.weights[self.step] = full_params(self.trainer)

    def post_checkpoint_saved(self, path: str) -> None:
        self.saved.append(Path(path).name)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.metrics[step] = metrics


class NormProbe(Evaluator):
    """The sum of the model's weights: tells averaged weights from trained ones."""

    def __init__(self) -> None:
        super().__init__("probe")

    def evaluate(self, train_module: Any) -> dict[str, torch.Tensor]:
        total = sum(p.detach().double().sum() for p in train_module.model.parameters())
        return {"sum": torch.as_tensor(total)}


def merged_weights(path: Path) -> list[torch.Tensor]:
    torch.manual_seed(123)
    model = TinyCausalLM(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2, max_seq_len=SEQ_LEN)
    load_model_and_optim_state(path / "model_and_optim", model)
    return [p.detach() for p in model.parameters()]


def test_merged_checkpoint_is_the_mean_of_the_window(tmp_path: Path) -> None:
    log = WeightLog()
    merge = ModelMergeCallback(enabled=True, merge_step=4, merge_last_n_steps=3)
    evaluator = EvaluatorCallback(evaluators=[NormProbe()], eval_interval=None)
    trainer = build_trainer(
        tmp_path,
        max_duration=Duration.steps(6),
        metrics_collect_interval=1,
        callbacks={
            "merge": merge,
            "log": log,
            "eval": evaluator,
            "checkpointer": CheckpointerCallback(save_interval=100, ephemeral_save_interval=1),
        },
    )
    trainer.fit()
    merged_dir = tmp_path / "step4-merged"
    assert Checkpointer.dir_is_checkpoint(merged_dir)
    found = [Path(path).name for _, path in Checkpointer.find_checkpoints(tmp_path)]
    assert found == ["step0", "step6"]  # never taken for a training checkpoint
    want = [sum(ws) / 3 for ws in zip(*(log.weights[s] for s in (2, 3, 4)))]
    for got, expected in zip(merged_weights(merged_dir), want):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    # Training went on from the trained weights, not the average.
    assert not torch.equal(log.weights[4][0], want[0])
    # The averaged weights were evaluated, under eval/merged.
    merged_sum = sum(w.double().sum() for w in want)
    assert log.metrics[4]["eval/merged/probe/sum"] == pytest.approx(merged_sum.item(), rel=1e-6)
    # No ephemeral checkpoint inside the window (steps 2 and 3).
    assert "step2" not in log.saved and "step3" not in log.saved
    assert {"step1", "step4", "step5"} <= set(log.saved)
    assert not trainer.block_ephemeral_checkpoints


def _merge(merge_step: int = 5) -> ModelMergeCallback:
    return ModelMergeCallback(enabled=True, merge_step=merge_step, merge_last_n_steps=3)


def test_resuming_at_the_window_start_still_merges_exactly(tmp_path: Path) -> None:
    build_trainer(
        tmp_path / "a", max_duration=Duration.steps(6), callbacks={"merge": _merge()}
    ).fit()
    checkpoints = CheckpointerCallback(save_interval=3)
    build_trainer(
        tmp_path / "b",
        max_duration=Duration.steps(6),
        hard_stop=Duration.steps(3),
        callbacks={"merge": _merge(), "checkpointer": checkpoints},
    ).fit()
    build_trainer(
        tmp_path / "b", max_duration=Duration.steps(6), callbacks={"merge": _merge()}
    ).fit()
    for a, b in zip(
        merged_weights(tmp_path / "a" / "step5-merged"),
        merged_weights(tmp_path / "b" / "step5-merged"),
    ):
        assert torch.equal(a, b)


def test_resuming_inside_a_window_skips_that_merge(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    build_trainer(
        tmp_path,
        max_duration=Duration.steps(6),
        hard_stop=Duration.steps(4),
        callbacks={"checkpointer": CheckpointerCallback(save_interval=4)},
    ).fit()
    build_trainer(tmp_path, max_duration=Duration.steps(6), callbacks={"merge": _merge()}).fit()
    assert not (tmp_path / "step5-merged").exists()
    assert "merge is skipped" in caplog.text


def test_merge_interval(tmp_path: Path) -> None:
    merge = ModelMergeCallback(enabled=True, merge_interval=3, merge_last_n_steps=2)
    build_trainer(tmp_path, max_duration=Duration.steps(6), callbacks={"merge": merge}).fit()
    assert Checkpointer.dir_is_checkpoint(tmp_path / "step3-merged")
    assert Checkpointer.dir_is_checkpoint(tmp_path / "step6-merged")


def test_disabled_by_default_and_settings_checked(tmp_path: Path) -> None:
    build_trainer(
        tmp_path, max_duration=Duration.steps(2), callbacks={"m": ModelMergeCallback(merge_step=1)}
    ).fit()
    assert not list(tmp_path.glob("*-merged"))
    for settings, path in [
        ({}, "merge_step"),
        ({"merge_step": 0}, "merge_step"),
        ({"merge_step": 5, "merge_interval": 5}, "merge_interval"),
        ({"merge_step": 5, "merge_last_n_steps": 0}, "merge_last_n_steps"),
    ]:
        with pytest.raises(ConfigurationError, match=path):
            ModelMergeCallback(enabled=True, **settings)
    with pytest.raises(ConfigurationError, match="merge_last_n_steps"):
        build_trainer(
            tmp_path / "short",
            max_duration=Duration.steps(4),
            callbacks={"m": ModelMergeCallback(enabled=True, merge_step=2, merge_last_n_steps=3)},
        ).fit()


def _at_step(step: int, **settings: Any) -> ModelMergeCallback:
    """A callback whose ``step`` is ``step`` (no trainer)."""
    cb = ModelMergeCallback(enabled=True, **settings)
    cb.__class__ = type("_AtStep", (ModelMergeCallback,), {"step": property(lambda self: step)})
    return cb


def test_windows_and_their_boundaries() -> None:
    assert _at_step(0, merge_step=100, merge_last_n_steps=10)._window_start(100) == 91
    assert _at_step(0, merge_step=5, merge_last_n_steps=100)._window_start(5) == 0
    assert _at_step(90, merge_step=100, merge_last_n_steps=10)._active_windows() == []
    assert _at_step(91, merge_step=100, merge_last_n_steps=10)._active_windows() == [100]
    assert _at_step(100, merge_step=100, merge_last_n_steps=10)._active_windows() == [100]
    assert _at_step(101, merge_step=100, merge_last_n_steps=10)._active_windows() == []
    both = _at_step(98, merge_step=[105, 100], merge_last_n_steps=10)
    assert both._active_windows() == [100, 105]
    both._completed_merges.add(100)
    assert both._active_windows() == [105]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"merge_step": 100, "merge_last_n_steps": 0}, "must be positive"),
        ({"merge_step": [100, -5]}, "must be positive"),
        ({"merge_step": []}, "merge_step or merge_interval must be set"),
        ({"merge_interval": 0}, "merge_interval must be positive"),
        ({"merge_step": 100, "merge_interval": 500}, "Cannot set both"),
    ],
)
def test_messages_as_olmo_core(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        ModelMergeCallback(enabled=True, **settings)
    assert ModelMergeCallback(enabled=True, merge_interval=500)._merge_steps == []
