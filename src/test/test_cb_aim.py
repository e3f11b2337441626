"""AimCallback: the logged metrics, read back from the Aim repository through Aim's own SDK."""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from testutils import Crash, CrashAtStep, build_trainer, preloaded_sinks

from olmolike.exceptions import ConfigurationError
from olmolike.train import Duration, Trainer
from olmolike.train.callbacks import AimCallback, CheckpointerCallback, callback_registry
from olmolike.train.callbacks.metric_saver import MetricSaverCallback

pytest.importorskip("aim", reason="needs the aim extra")
import aim
from aim.sdk.index_manager import RepoIndexManager

pytestmark = pytest.mark.timeout(600)  # a hang guard: Aim starts slowly on a busy machine

Points = list[tuple[int, float]]


@pytest.fixture(autouse=True)
def forked_sinks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Aim sinks run forked from the preloaded server, not in a fresh interpreter."""
    preloaded_sinks(monkeypatch)


@dataclass
class AimRun:
    hash: str
    experiment: str | None
    name: str | None
    hparams: Any
    metrics: dict[str, Points]


def read_runs(repo: Path) -> list[AimRun]:
    """Every run in the Aim repository at ``repo``, with each metric's (step, value) points."""
    chunks = repo / ".aim" / "meta" / "chunks"
    if not chunks.is_dir():
        return []
    # Aim's SDK reads runs through an index that `aim up` (or `aim storage reindex`) builds.
    indexer = RepoIndexManager(aim.Repo(str(repo)))
    try:
        for run_dir in chunks.iterdir():
            indexer.index(run_dir.name)
    finally:
        indexer.stop()
    runs = []
    for run in aim.Repo(str(repo)).iter_runs():
        metrics: dict[str, Points] = {}
        for metric in run.metrics():
            assert metric.context.to_dict() == {}
            steps, (values, *_) = metric.data.items_list()
            metrics[metric.name] = list(zip(steps, values))
        runs.append(AimRun(run.hash, run.experiment, run.name, run.get("hparams"), metrics))
    return runs


def logged_points(metrics_jsonl: Path) -> dict[str, Points]:
    """Each metric's (step, value) points in a metrics file."""
    points: dict[str, Points] = {}
    for line in metrics_jsonl.read_text().splitlines():
        record = json.loads(line)
        for name, value in record["metrics"].items():
            points.setdefault(name, []).append((record["step"], value))
    return points


def assert_same_points(tracked: dict[str, Points], logged: dict[str, Points]) -> None:
    assert set(tracked) == set(logged)
    assert "train/CE loss" in tracked
    for name, points in tracked.items():
        assert [step for step, _ in points] == [step for step, _ in logged[name]]
        expected = [value for _, value in logged[name]]
        assert [value for _, value in points] == pytest.approx(expected, rel=1e-6)


def train(
    save: Path, steps: int, callback: AimCallback, crash_at: int = 0, **config: Any
) -> Trainer:
    """Checkpoints every 4 steps, one metrics line per step."""
    trainer = build_trainer(
        save,
        max_duration=Duration.steps(steps),
        metrics_collect_interval=1,
        callbacks={
            "aim": callback,
            "metric_saver": MetricSaverCallback(),
            "checkpointer": CheckpointerCallback(save_interval=4, pre_train_checkpoint=False),
            "crash": CrashAtStep(step_to_crash=crash_at),
        },
        **config,
    )
    trainer.fit()
    return trainer


@pytest.mark.slow  # Aim sets up a new repository's database in a second or two
def test_every_logged_metric_at_its_step_with_the_config(tmp_path: Path) -> None:
    config = {"lr": 0.01, "model": {"layers": 2, "norm": "rms"}}
    callback = AimCallback(experiment="tiny", run_name="first", config=config)
    trainer = build_trainer(
        tmp_path,
        max_duration=Duration.steps(4),
        metrics_collect_interval=2,  # two steps' metrics arrive together: each at its own step
        no_checkpoints=True,
        callbacks={"aim": callback, "metric_saver": MetricSaverCallback()},
    )
    trainer.fit()
    (run,) = read_runs(tmp_path / "aim")  # the default repo: the (local) save folder's aim/
    assert (run.experiment, run.name, run.hparams) == ("tiny", "first", config)
    assert run.hash == callback.state_dict()["run_hash"]
    assert_same_points(run.metrics, logged_points(tmp_path / "metrics.jsonl"))
    assert [step for step, _ in run.metrics["train/CE loss"]] == [1, 2, 3, 4]


@pytest.mark.slow  # Aim sets up a new repository's database in a second or two
def test_a_resumed_run_continues_the_same_aim_run(tmp_path: Path) -> None:
    first = AimCallback(experiment="tiny", config={"lr": 0.01})
    with pytest.raises(Crash):
        train(tmp_path, 8, first, crash_at=7)  # steps 5 and 6 are trained again on resume
    (crashed,) = read_runs(tmp_path / "aim")
    # Step s's metrics reach callbacks at the end of step s + 1: step 6's never did.
    assert [step for step, _ in crashed.metrics["train/CE loss"]] == [1, 2, 3, 4, 5]

    second = AimCallback(config={"lr": 0.01})
    train(tmp_path, 8, second)  # resumes from the step-4 checkpoint
    (run,) = read_runs(tmp_path / "aim")
    assert run.hash == crashed.hash == second.state_dict()["run_hash"]
    assert (run.experiment, run.hparams) == ("tiny", {"lr": 0.01})  # kept: not set again
    # Each step once, with the values of the resumed run's metrics file.
    logged = logged_points(tmp_path / "metrics.jsonl")
    assert [step for step, _ in logged["train/CE loss"]] == list(range(1, 9))
    assert_same_points(run.metrics, logged)


@pytest.mark.slow  # Aim sets up a new repository's database in a second or two
def test_a_repo_without_the_checkpointed_run_gets_a_new_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # As when a remote save folder is resumed on a machine with a new work_dir.
    train(tmp_path / "save", 4, AimCallback(repo=str(tmp_path / "old")))
    (old,) = read_runs(tmp_path / "old")
    with caplog.at_level(logging.WARNING):
        train(tmp_path / "save", 6, AimCallback(repo=str(tmp_path / "new")))
    assert f"Aim run {old.hash} is not in" in caplog.text
    (new,) = read_runs(tmp_path / "new")
    assert new.hash != old.hash
    assert [step for step, _ in new.metrics["train/CE loss"]] == [5, 6]


def test_disabled_and_other_ranks_write_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disabled = AimCallback(enabled=False)
    train(tmp_path / "a", 1, disabled)
    assert disabled.state_dict() == {}
    monkeypatch.setattr("olmolike.train.callbacks.aim.get_rank", lambda: 1)
    other_rank = AimCallback()
    train(tmp_path / "b", 1, other_rank)
    assert other_rank.state_dict() == {}
    for name in "ab":
        assert (tmp_path / name / "metrics.jsonl").exists()
        assert not (tmp_path / name / "aim").exists()


def test_missing_package_fails_when_the_trainer_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "aim", None)
    with pytest.raises(ConfigurationError, match=r"pip install 'olmolike\[aim\]'"):
        build_trainer(tmp_path, callbacks={"aim": AimCallback()})
    # Disabled, it needs nothing.
    build_trainer(tmp_path, callbacks={"aim": AimCallback(enabled=False)})


@pytest.mark.parametrize(
    ("save_folder", "repo", "expected"),
    [
        ("/runs/r1", None, "/runs/r1/aim"),
        ("file:///runs/r1", None, "/runs/r1/aim"),
        ("gs://bucket/r1", None, "/scratch/work/aim"),  # an Aim repo cannot live in a bucket
        ("s3://bucket/r1", "/shared/aim", "/shared/aim"),
        ("/runs/r1", "file:///shared/aim", "/shared/aim"),
        ("/runs/r1", "aim://tracking:53800", "aim://tracking:53800"),
    ],
)
def test_repo_path(save_folder: str, repo: str | None, expected: str) -> None:
    callback = AimCallback(repo=repo)
    callback.trainer = SimpleNamespace(save_folder=save_folder, work_dir=Path("/scratch/work"))  # type: ignore[assignment]
    assert callback.repo_path == expected


@pytest.mark.parametrize("repo", ["", "gs://bucket/aim", "s3://bucket/aim"])
def test_repo_must_be_a_folder_or_an_aim_server(repo: str) -> None:
    with pytest.raises(ConfigurationError, match="repo"):
        AimCallback(repo=repo)


def test_registered_for_config_files() -> None:
    assert callback_registry["aim"] is AimCallback
