"""EarlyStoppingCallback: stops after `patience` evaluations without improvement, across resume."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from testutils import build_trainer

from olmolike.exceptions import ConfigurationError
from olmolike.train import Callback, Duration
from olmolike.train.callbacks.early_stopping import EarlyStoppingCallback, EarlyStoppingMode


@dataclass
class FakeEval(Callback):
    """Records ``values[step - 1]`` as the eval loss of each step (a stand-in for an evaluator)."""

    values: list[float] = field(default_factory=list)

    def post_step(self) -> None:
        step = self.trainer.global_step
        if step <= len(self.values):
            self.trainer.record_metric("lm/CE loss", self.values[step - 1], namespace="eval")


def fit(folder: Path, values: list[float], stopper: EarlyStoppingCallback, **kwargs: Any) -> Any:
    kwargs.setdefault("max_duration", Duration.steps(len(values)))
    kwargs.setdefault("no_checkpoints", True)  # saving costs time; only the resume test needs it
    trainer = build_trainer(
        folder,
        num_instances=16,
        instances_per_batch=2,
        metrics_collect_interval=1,
        callbacks={"fake_eval": FakeEval(values=values), "early_stopping": stopper},
        **kwargs,
    )
    trainer.fit()
    return trainer


def test_stops_after_patience_evaluations_without_improvement(tmp_path: Path) -> None:
    stopper = EarlyStoppingCallback(patience=3)
    trainer = fit(tmp_path, [5.0, 4.0, 4.5, 4.0, 4.2, 4.3, 1.0], stopper)
    # Best 4.0 at step 2; 4.5, 4.0 (not strictly better) and 4.2 exhaust the patience. Step
    # 5's metrics reach the callbacks at the end of step 6 (the agreed delivery step).
    assert trainer.global_step == 6 and trainer.is_canceled
    assert stopper.best == 4.0
    assert "early stopping" in (trainer._cancel.reason or "")


def test_improvement_resets_the_count(tmp_path: Path) -> None:
    stopper = EarlyStoppingCallback(patience=2)
    trainer = fit(tmp_path, [5.0, 5.1, 4.0, 4.1, 3.0, 3.5, 2.0], stopper)
    assert trainer.global_step == 7 and not trainer.is_canceled
    assert stopper.best == 2.0 and stopper.evals_without_improvement == 0


def test_min_delta_ignores_tiny_improvements(tmp_path: Path) -> None:
    stopper = EarlyStoppingCallback(patience=2, min_delta=0.1)
    trainer = fit(tmp_path, [5.0, 4.95, 4.92, 1.0, 1.0], stopper)
    assert trainer.global_step == 4 and trainer.is_canceled


def test_max_mode_and_a_custom_metric(tmp_path: Path) -> None:
    stopper = EarlyStoppingCallback(
        metric="eval/lm/CE loss", mode=EarlyStoppingMode.max, patience=1
    )
    trainer = fit(tmp_path, [1.0, 2.0, 1.5, 1.0, 3.0], stopper)
    assert trainer.global_step == 4 and stopper.best == 2.0


def test_nan_never_counts_as_an_improvement(tmp_path: Path) -> None:
    stopper = EarlyStoppingCallback(patience=2)
    trainer = fit(tmp_path, [float("nan"), 3.0, float("nan"), float("nan"), 4.0, 1.0], stopper)
    assert trainer.global_step == 5 and stopper.best == 3.0


def test_other_metrics_and_disabled_do_nothing(tmp_path: Path) -> None:
    watching_other = EarlyStoppingCallback(metric="eval/other/CE loss", patience=1)
    assert fit(tmp_path / "a", [3.0, 4.0, 5.0], watching_other).global_step == 3
    disabled = EarlyStoppingCallback(patience=1, enabled=False)
    assert fit(tmp_path / "b", [3.0, 4.0, 5.0], disabled).global_step == 3


def test_patience_survives_a_resume_from_checkpoint(tmp_path: Path) -> None:
    values = [5.0, 4.0, 4.5, 4.6, 4.7, 4.8, 1.0]
    # The first run ends at step 4 (hard stop) with 2 of 3 evaluations used; the final
    # checkpoint carries that count, so the resumed run stops after step 5's evaluation (at the
    # end of step 6, where step 5's metrics are delivered), not at step 7.
    first = fit(
        tmp_path,
        values,
        EarlyStoppingCallback(patience=3),
        hard_stop=Duration.steps(4),
        no_checkpoints=False,
    )
    assert first.global_step == 4 and not first.is_canceled
    resumed_stopper = EarlyStoppingCallback(patience=3)
    resumed = fit(tmp_path, values, resumed_stopper, no_checkpoints=False)
    assert resumed.checkpoint_loaded
    assert resumed.global_step == 6 and resumed.is_canceled
    assert resumed_stopper.best == 4.0


@pytest.mark.parametrize(
    ("kwargs", "path"),
    [
        ({"patience": 0}, "patience"),
        ({"min_delta": -1.0}, "min_delta"),
        ({"min_delta": float("nan")}, "min_delta"),
        ({"metric": ""}, "metric"),
    ],
)
def test_bad_settings_are_rejected_at_construction(kwargs: dict[str, Any], path: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        EarlyStoppingCallback(**kwargs)
    assert info.value.path == path


def test_unknown_mode_is_rejected() -> None:
    with pytest.raises(ValueError, match="sideways"):
        EarlyStoppingCallback(mode="sideways")  # type: ignore[arg-type]
