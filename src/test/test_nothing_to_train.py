"""A resumed run with no step left says so, naming the field to change."""

from __future__ import annotations

from pathlib import Path

import pytest
from testutils import build_trainer

from olmolike.train import Duration


def finished_run(folder: Path) -> None:
    build_trainer(folder, max_duration=Duration.steps(3)).fit()


def test_resuming_a_finished_run_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    finished_run(tmp_path / "run")
    trainer = build_trainer(tmp_path / "run", max_duration=Duration.steps(2))
    trainer.fit()
    assert trainer.global_step == 3
    warnings = [r.getMessage() for r in caplog.records if "Nothing to train" in r.getMessage()]
    assert len(warnings) == 1
    assert "at step 3" in warnings[0] and "max_duration ends it at step 2" in warnings[0]
    assert "--trainer.max_duration.value=" in warnings[0] and str(tmp_path / "run") in warnings[0]


def test_hard_stop_below_the_loaded_step_names_hard_stop(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    finished_run(tmp_path / "run")
    trainer = build_trainer(
        tmp_path / "run", max_duration=Duration.steps(10), hard_stop=Duration.steps(2)
    )
    caplog.clear()
    trainer.fit()
    messages = [r.getMessage() for r in caplog.records]
    assert any("hard_stop ends it at step 2" in m for m in messages)
    # No "Training from step 3 to step 2" first: there is nothing to train.
    assert not any(m.startswith("Training from step") for m in messages), messages


def test_a_run_with_steps_left_does_not_warn(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    finished_run(tmp_path / "run")
    build_trainer(tmp_path / "run", max_duration=Duration.steps(4)).fit()
    assert not any("Nothing to train" in r.getMessage() for r in caplog.records)
    assert any(r.getMessage().startswith("Training from step") for r in caplog.records)
