"""TensorBoardCallback: every logged metric as a scalar at its step, read back from the events."""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import fsspec
import pytest
from testutils import build_trainer

from olmolike.exceptions import ConfigurationError
from olmolike.train import Duration
from olmolike.train.callbacks.metric_saver import MetricSaverCallback
from olmolike.train.callbacks.tensorboard import TensorBoardCallback

pytest.importorskip("tensorboard", reason="needs the tensorboard extra")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {
        tag: [(event.step, event.value) for event in acc.Scalars(tag)]
        for tag in acc.Tags()["scalars"]
    }


def test_scalars_match_the_logged_metrics(tmp_path: Path) -> None:
    trainer = build_trainer(
        tmp_path,
        max_duration=Duration.steps(4),
        metrics_collect_interval=2,
        no_checkpoints=True,
        callbacks={"tensorboard": TensorBoardCallback(), "metric_saver": MetricSaverCallback()},
    )
    trainer.fit()
    scalars = read_scalars(tmp_path / "tensorboard")
    logged = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert set(scalars) == set(logged[0]["metrics"])
    assert "train/CE loss" in scalars
    for name, points in scalars.items():
        expected = [(r["step"], r["metrics"][name]) for r in logged]
        assert [step for step, _ in points] == [step for step, _ in expected]
        assert [value for _, value in points] == pytest.approx([v for _, v in expected], rel=1e-6)


def test_subdir_and_disabled(tmp_path: Path) -> None:
    build_trainer(
        tmp_path / "a",
        max_duration=Duration.steps(1),
        no_checkpoints=True,
        callbacks={"tensorboard": TensorBoardCallback(subdir="logs/tb")},
    ).fit()
    assert "train/CE loss" in read_scalars(tmp_path / "a" / "logs" / "tb")
    build_trainer(
        tmp_path / "b",
        max_duration=Duration.steps(1),
        no_checkpoints=True,
        callbacks={"tensorboard": TensorBoardCallback(enabled=False)},
    ).fit()
    assert not (tmp_path / "b" / "tensorboard").exists()


def test_only_rank_zero_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("olmolike.train.callbacks.tensorboard.get_rank", lambda: 1)
    build_trainer(
        tmp_path,
        max_duration=Duration.steps(1),
        no_checkpoints=True,
        callbacks={"tensorboard": TensorBoardCallback()},
    ).fit()
    assert not (tmp_path / "tensorboard").exists()


def test_remote_save_folder_gets_the_event_files(tmp_path: Path) -> None:
    folder = f"memory://tb-{uuid.uuid4().hex}/run"
    build_trainer(
        folder,
        max_duration=Duration.steps(2),
        work_dir=str(tmp_path / "work"),
        callbacks={"tensorboard": TensorBoardCallback()},
    ).fit()
    fs = fsspec.filesystem("memory")
    remote = fs.ls(folder.removeprefix("memory://") + "/tensorboard", detail=False)
    assert len(remote) == 1 and "tfevents" in remote[0]
    local = tmp_path / "work" / "tensorboard"
    assert fs.cat(remote[0]) == next(local.iterdir()).read_bytes()


def test_missing_package_fails_when_the_trainer_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ConfigurationError, match=r"pip install 'olmolike\[tensorboard\]'"):
        build_trainer(tmp_path, callbacks={"tensorboard": TensorBoardCallback()})


@pytest.mark.parametrize("subdir", ["", "/abs", "../out", "a/../../b"])
def test_subdir_must_stay_inside_the_save_folder(subdir: str) -> None:
    with pytest.raises(ConfigurationError, match="subdir"):
        TensorBoardCallback(subdir=subdir)
