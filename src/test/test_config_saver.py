"""ConfigSaverCallback: the run's config beside its checkpoints, kept on record across resumes."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from testutils import build_trainer

from olmolike.exceptions import ConfigurationError
from olmolike.inference import find_experiment_config
from olmolike.train import Callback, Duration, Trainer
from olmolike.train.callbacks import CheckpointerCallback, ConfigSaverCallback

CONFIG_A: dict[str, Any] = {"run": "a", "model": {"width": 32, "depth": 2}, "lr": 0.01}
CONFIG_B: dict[str, Any] = {**CONFIG_A, "run": "b", "lr": 0.02}
CONFIG_C: dict[str, Any] = {**CONFIG_A, "run": "c", "lr": 0.03}


@dataclass
class SeenBeforeFirstStep(Callback):
    """Records whether ``config.json`` already existed when the first step began."""

    existed: list[bool] = field(default_factory=list)

    def pre_step(self, batch: dict[str, Any]) -> None:
        del batch
        if not self.existed:
            self.existed.append((Path(self.trainer.save_folder) / "config.json").is_file())


def run(save: Path, config: dict[str, Any] | None, steps: int, **kwargs: Any) -> Trainer:
    """Train ``steps`` steps (resuming from ``save`` if it holds a checkpoint), saving at step 2."""
    callbacks = {
        "config_saver": ConfigSaverCallback(config=config, **kwargs),
        "checkpointer": CheckpointerCallback(save_interval=2, pre_train_checkpoint=False),
        "probe": SeenBeforeFirstStep(),
    }
    trainer = build_trainer(
        save,
        num_instances=32,
        max_duration=Duration.steps(steps),
        callbacks=callbacks,
    )
    trainer.fit()
    return trainer


def expected_text(config: dict[str, Any]) -> str:
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


def test_writes_sorted_json_before_the_first_step(tmp_path: Path) -> None:
    unsorted = {"zeta": 1, "alpha": {"y": 2, "b": [3, 1]}}
    trainer = run(tmp_path, unsorted, 1)
    text = (tmp_path / "config.json").read_text()
    assert text == expected_text(unsorted)
    assert list(json.loads(text)) == ["alpha", "zeta"]
    assert json.loads(text) == unsorted
    probe = trainer.callbacks["probe"]
    assert isinstance(probe, SeenBeforeFirstStep) and probe.existed == [True]


def test_each_checkpoint_holds_the_config_that_trained_it(tmp_path: Path) -> None:
    run(tmp_path, CONFIG_A, 2)  # saves step 2
    run(tmp_path, CONFIG_B, 4)  # resumes at 2, saves steps 4 (interval) and 4 is also final
    assert (tmp_path / "step2" / "config.json").read_text() == expected_text(CONFIG_A)
    assert (tmp_path / "step4" / "config.json").read_text() == expected_text(CONFIG_B)
    # Its own config wins over the save folder's (now B), and a checkpoint copied on its own
    # still tells olmolike how it was trained.
    assert find_experiment_config(str(tmp_path / "step2")) == CONFIG_A
    copied = tmp_path / "elsewhere" / "step2"
    shutil.copytree(tmp_path / "step2", copied)
    assert find_experiment_config(str(copied)) == CONFIG_A


def test_nothing_is_written_before_fit(tmp_path: Path) -> None:
    build_trainer(tmp_path, callbacks={"config_saver": ConfigSaverCallback(config=CONFIG_A)})
    assert not (tmp_path / "config.json").exists()


def test_custom_file_name(tmp_path: Path) -> None:
    run(tmp_path, CONFIG_A, 1, fname="experiment.json")
    assert (tmp_path / "experiment.json").read_text() == expected_text(CONFIG_A)
    assert not (tmp_path / "config.json").exists()


def test_only_rank_zero_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run(tmp_path / "rank0", CONFIG_A, 1)
    assert (tmp_path / "rank0" / "config.json").read_text() == expected_text(CONFIG_A)
    monkeypatch.setattr("olmolike.train.callbacks.config_saver.get_rank", lambda: 1)
    run(tmp_path / "rank1", CONFIG_A, 1)
    assert not (tmp_path / "rank1" / "config.json").exists()


def test_no_config_writes_nothing(tmp_path: Path) -> None:
    run(tmp_path, None, 1)
    assert not (tmp_path / "config.json").exists()


def test_same_config_on_resume_leaves_the_file_untouched(tmp_path: Path) -> None:
    run(tmp_path, CONFIG_A, 2)
    before = (tmp_path / "config.json").stat()
    resumed = run(tmp_path, dict(CONFIG_A), 3)
    assert resumed.global_step == 3 and resumed.checkpoint_loaded
    after = (tmp_path / "config.json").stat()
    # A rewrite replaces the file (new inode) even when the bytes and mtime happen to match.
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert sorted(p.name for p in tmp_path.glob("config*.json")) == ["config.json"]


def test_changed_config_on_resume_keeps_the_old_one(tmp_path: Path) -> None:
    run(tmp_path, CONFIG_A, 2)
    resumed = run(tmp_path, CONFIG_B, 3)
    assert resumed.checkpoint_loaded
    assert (tmp_path / "config.json").read_text() == expected_text(CONFIG_B)
    assert (tmp_path / "config-before-step2.json").read_text() == expected_text(CONFIG_A)


def test_a_second_change_at_the_same_step_keeps_the_config_that_made_the_checkpoints(
    tmp_path: Path,
) -> None:
    # B resumes at step 2 and stops without a checkpoint; C then resumes at step 2 again.
    # Checkpoint step2 was made with A, so A must stay on record, not B.
    run(tmp_path, CONFIG_A, 2)
    run(tmp_path, CONFIG_B, 2)
    run(tmp_path, CONFIG_C, 2)
    assert (tmp_path / "config.json").read_text() == expected_text(CONFIG_C)
    assert (tmp_path / "config-before-step2.json").read_text() == expected_text(CONFIG_A)


@pytest.mark.parametrize("fname", ["", "runs/config.json", ".", ".."])
def test_bad_file_name_is_a_configuration_error(fname: str) -> None:
    with pytest.raises(ConfigurationError, match="fname"):
        ConfigSaverCallback(config=CONFIG_A, fname=fname)


def test_config_that_is_not_json_fails_at_construction() -> None:
    with pytest.raises(ConfigurationError, match="config"):
        ConfigSaverCallback(config={"path": Path("/tmp")})
