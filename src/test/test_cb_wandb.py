"""WandBCallback in offline mode: a run directory with the logged metrics, and tag-based cancel."""

from __future__ import annotations

import json
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from testutils import build_trainer, patient, preloaded_sinks

from olmolike.exceptions import ConfigurationError
from olmolike.train import Duration, Trainer
from olmolike.train.callbacks import Callback, CheckpointerCallback
from olmolike.train.callbacks.metric_saver import MetricSaverCallback
from olmolike.train.callbacks.sink_process import SinkError
from olmolike.train.callbacks.wandb import WandBCallback, WandBSink

wandb = pytest.importorskip("wandb", reason="needs the wandb extra")


@pytest.fixture(autouse=True)
def quiet_offline_wandb(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Keep W&B off the network and out of the user's home folder."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.delenv("WANDB_MODE", raising=False)


@pytest.fixture(autouse=True)
def forked_sinks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The W&B sinks run forked from the preloaded server, not in a fresh interpreter."""
    preloaded_sinks(monkeypatch)


def train(save: Path, steps: int, callback: WandBCallback, **kwargs: Any) -> Trainer:
    trainer = build_trainer(
        save,
        max_duration=Duration.steps(steps),
        metrics_collect_interval=1,
        callbacks={"wandb": callback, "metric_saver": MetricSaverCallback(), **kwargs},
    )
    trainer.fit()
    return trainer


def run_files(wandb_dir: Path) -> list[Path]:
    return sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb"))


@pytest.mark.timeout(600)  # a hang guard: W&B starts slowly on a busy machine
def test_offline_run_records_every_logged_metric(tmp_path: Path) -> None:
    callback = WandBCallback(mode="offline", project="olmolike-test", run_name="tiny")
    train(tmp_path, 3, callback, checkpointer=CheckpointerCallback(enabled=False))
    wandb.teardown()  # the W&B service writes the run file in the background: let it finish
    (data_file,) = run_files(tmp_path)  # work_dir is the save folder for a local run
    data = data_file.read_bytes()
    logged = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(logged) == 3
    for record in logged:
        loss = record["metrics"]["train/CE loss"]
        # W&B stores each value as its JSON text beside the metric name.
        assert json.dumps(loss).encode() in data
    assert b"train/CE loss" in data and b"olmolike-test" in data


class RecordingSink(WandBSink):
    """Appends "pid step" to ``steps.txt`` in the callback's ``dir`` for every step it logs."""

    def log(self, values: dict[str, float], step: int) -> None:
        with open(Path(self.run.dir).parents[2] / "steps.txt", "a") as f:
            f.write(f"{os.getpid()} {step}\n")
        super().log(values, step)


class FailingSink(WandBSink):
    def log(self, values: dict[str, float], step: int) -> None:
        if step == 2:
            raise RuntimeError("W&B refused the metrics")
        super().log(values, step)


@pytest.mark.timeout(600)  # a hang guard: W&B starts slowly on a busy machine
def test_logging_runs_in_a_sink_process_in_step_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(WandBCallback, "sink_class", RecordingSink)
    callback = WandBCallback(mode="offline", cancel_tag=None, dir=str(tmp_path / "wb"))
    train(tmp_path / "save", 5, callback)
    lines = [line.split() for line in (tmp_path / "wb" / "steps.txt").read_text().splitlines()]
    assert [int(step) for _, step in lines] == [1, 2, 3, 4, 5]
    assert {pid for pid, _ in lines} != {str(os.getpid())} and len({p for p, _ in lines}) == 1


@pytest.mark.timeout(600)  # a hang guard: W&B starts slowly on a busy machine
def test_a_failing_wandb_log_stops_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(WandBCallback, "sink_class", FailingSink)
    callback = WandBCallback(mode="offline", cancel_tag=None)
    with pytest.raises(SinkError, match="W&B refused the metrics"):
        train(tmp_path, 8, callback)


@pytest.mark.timeout(600)  # a hang guard: W&B starts slowly on a busy machine
def test_a_resumed_run_continues_the_same_wandb_run(tmp_path: Path) -> None:
    checkpoints = CheckpointerCallback(save_interval=2, pre_train_checkpoint=False)
    first = WandBCallback(mode="offline", dir=str(tmp_path / "wb"))
    train(tmp_path / "save", 2, first, checkpointer=checkpoints)
    second = WandBCallback(mode="offline", dir=str(tmp_path / "wb"))
    train(tmp_path / "save", 3, second, checkpointer=CheckpointerCallback(save_interval=2))
    runs = run_files(tmp_path / "wb")
    assert len(runs) == 2
    assert runs[0].name == runs[1].name  # run-<id>.wandb: the same id twice


@dataclass
class LookupsAnswerInTime(Callback):
    """Waits in ``post_step`` (before W&B's) for a tag lookup in flight: as if the W&B API
    always answered within a lookup interval, however late the lookup thread gets a core."""

    wandb: WandBCallback | None = None

    def post_step(self) -> None:
        assert self.wandb is not None
        if self.wandb._tag_lookup is not None:
            self.wandb._tag_lookup.result(timeout=patient(60))


@pytest.mark.timeout(600)  # a hang guard: W&B starts slowly on a busy machine
def test_cancel_tag_stops_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lookups: list[str] = []

    def fetch_tags(self: WandBCallback) -> list[str]:
        # Runs on the lookup thread: the training loop never waits for the W&B API.
        lookups.append(threading.current_thread().name)
        return ["baseline", "cancel"] if len(lookups) >= 2 else ["baseline"]

    monkeypatch.setattr(WandBCallback, "fetch_tags", fetch_tags)
    callback = WandBCallback(mode="offline", cancel_check_interval=2)
    trainer = build_trainer(
        tmp_path,
        max_duration=Duration.steps(8),
        cancel_check_interval=1,
        no_checkpoints=True,
        callbacks={"wandb": callback, "in_time": LookupsAnswerInTime(callback)},
    )
    trainer.fit()
    # Lookups start at steps 2 and 4; the second sees the tag, read at the next lookup step.
    assert lookups == ["wandb-tags-0", "wandb-tags-0"]
    assert trainer.is_canceled and trainer.global_step == 6


def test_offline_tags_are_the_configured_ones(tmp_path: Path) -> None:
    assert WandBCallback(mode="offline", tags=["cancel"]).fetch_tags() == ["cancel"]


def test_disabled_and_other_ranks_create_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    train(tmp_path / "a", 1, WandBCallback(mode="disabled"))
    train(tmp_path / "b", 1, WandBCallback(mode="offline", enabled=False))
    monkeypatch.setattr("olmolike.train.callbacks.wandb.get_rank", lambda: 1)
    train(tmp_path / "c", 1, WandBCallback(mode="offline"))
    for name in "abc":
        assert not (tmp_path / name / "wandb").exists()


def test_missing_package_fails_when_the_trainer_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigurationError, match=r"pip install 'olmolike\[wandb\]'"):
        build_trainer(tmp_path, callbacks={"wandb": WandBCallback(mode="offline")})


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"mode": "dryrun"}, "mode"),
        ({"cancel_check_interval": 0}, "cancel_check_interval"),
        ({"cancel_tag": ""}, "cancel_tag"),
    ],
)
def test_settings_are_checked(settings: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigurationError, match=field):
        WandBCallback(**settings)
