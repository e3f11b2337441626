"""TensorBoardCallback: every logged metric as a scalar at its step, read back from the events."""

from __future__ import annotations

import json
import struct
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from remote_servers import RemoteStore
from testutils import build_trainer

from olmolike.exceptions import ConfigurationError
from olmolike.train import Callback, Duration
from olmolike.train.callbacks import CheckpointerCallback
from olmolike.train.callbacks.metric_saver import MetricSaverCallback
from olmolike.train.callbacks.tensorboard import TensorBoardCallback, scalar_event

pytest.importorskip("tensorboard", reason="needs the tensorboard extra")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {
        tag: [(event.step, event.value) for event in acc.Scalars(tag)]
        for tag in acc.Tags()["scalars"]
    }


def assert_scalars_match(scalars: dict[str, list[tuple[int, float]]], metrics_jsonl: str) -> None:
    """``scalars`` hold every metric of every line of a metrics file, at its step."""
    logged = [json.loads(x) for x in metrics_jsonl.splitlines()]
    assert set(scalars) == set(logged[0]["metrics"])
    assert "train/CE loss" in scalars
    for name, points in scalars.items():
        expected = [(r["step"], r["metrics"][name]) for r in logged]
        assert [step for step, _ in points] == [step for step, _ in expected]
        assert [value for _, value in points] == pytest.approx([v for _, v in expected], rel=1e-6)


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
    assert_scalars_match(scalars, (tmp_path / "metrics.jsonl").read_text())


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
    def fit(folder: Path) -> None:
        build_trainer(
            folder,
            max_duration=Duration.steps(1),
            no_checkpoints=True,
            callbacks={"tensorboard": TensorBoardCallback()},
        ).fit()

    fit(tmp_path / "rank0")
    assert any((tmp_path / "rank0" / "tensorboard").glob("events.out.tfevents.*"))
    monkeypatch.setattr("olmolike.train.callbacks.tensorboard.get_rank", lambda: 1)
    fit(tmp_path / "rank1")
    assert not (tmp_path / "rank1" / "tensorboard").exists()


def download(store: RemoteStore, remote_dir: str, local_dir: Path) -> list[str]:
    """Copy every object under ``store.url(remote_dir)`` into ``local_dir``; their names."""
    names = store.objects(remote_dir)
    for name in names:
        (local_dir / name).parent.mkdir(parents=True, exist_ok=True)
        store.fs.get_file(store.url(remote_dir, name), str(local_dir / name))
    return names


@dataclass
class RemoteEventsAtStep(Callback):
    """Downloads the save folder's event files at the start of ``at_step``, and reads them."""

    store: RemoteStore | None = None
    at_step: int = 0
    into: Path = Path()
    scalars: dict[str, list[tuple[int, float]]] = field(default_factory=dict)

    def pre_step(self, batch: dict[str, Any]) -> None:
        del batch
        if self.step == self.at_step and self.store is not None:
            assert len(download(self.store, "run/tensorboard", self.into)) == 1
            self.scalars = read_scalars(self.into)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("bucket", ["gcs_bucket", "s3_bucket"])
def test_remote_save_folder_gets_the_event_files(
    bucket: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    store: RemoteStore = request.getfixturevalue(bucket)
    at_checkpoint = RemoteEventsAtStep(store=store, at_step=4, into=tmp_path / "at-checkpoint")
    build_trainer(
        store.url("run"),
        max_duration=Duration.steps(6),
        metrics_collect_interval=1,
        async_bookkeeping=False,  # the same steps on a GPU (no CPU group) as on CPU
        work_dir=str(tmp_path / "work"),
        callbacks={
            "tensorboard": TensorBoardCallback(),
            "metric_saver": MetricSaverCallback(),
            "checkpointer": CheckpointerCallback(save_interval=3, pre_train_checkpoint=False),
            "at_checkpoint": at_checkpoint,
        },
    ).fit()
    # The copy made at the step-3 checkpoint: step s's metrics reach callbacks at the end of
    # step s + 1 (an agreed step), after that step's checkpoint, so it holds step 1's only.
    assert [step for step, _ in at_checkpoint.scalars["train/CE loss"]] == [1]

    # At the end: the same event file as the local one, byte for byte.
    remote = store.objects("run", "tensorboard")
    assert len(remote) == 1 and "tfevents" in remote[0]
    local = tmp_path / "work" / "tensorboard"
    assert [p.name for p in local.iterdir()] == remote
    store.fs.invalidate_cache()
    assert (
        store.fs.cat_file(store.url("run", "tensorboard", remote[0]))
        == (local / remote[0]).read_bytes()
    )
    # Downloaded, it holds every logged metric at its step (the remote metrics file's).
    downloaded = tmp_path / "downloaded"
    assert download(store, "run/tensorboard", downloaded) == remote
    metrics_jsonl = store.fs.cat_file(store.url("run", "metrics.jsonl")).decode()
    assert [json.loads(x)["step"] for x in metrics_jsonl.splitlines()] == [1, 2, 3, 4, 5, 6]
    assert_scalars_match(read_scalars(downloaded), metrics_jsonl)


@pytest.mark.parametrize("module", ["tensorboard.compat.proto.event_pb2", "google_crc32c"])
def test_missing_package_fails_when_the_trainer_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str
) -> None:
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ConfigurationError, match=r"pip install 'olmolike\[tensorboard\]'"):
        build_trainer(tmp_path, callbacks={"tensorboard": TensorBoardCallback()})


def read_records(path: Path) -> list[bytes]:
    """The records of a TFRecord file, each checked against TensorBoard's own CRC32C."""
    data, records, offset = path.read_bytes(), [], 0
    while offset < len(data):
        header = data[offset : offset + 8]
        (length,) = struct.unpack("<Q", header)
        (header_crc,) = struct.unpack("<I", data[offset + 8 : offset + 12])
        assert header_crc == masked_crc32c(header)
        record = data[offset + 12 : offset + 12 + length]
        (record_crc,) = struct.unpack("<I", data[offset + 12 + length : offset + 16 + length])
        assert record_crc == masked_crc32c(record)
        records.append(record)
        offset += 16 + length
    return records


def test_event_files_are_valid_records_with_one_event_per_step(tmp_path: Path) -> None:
    build_trainer(
        tmp_path,
        max_duration=Duration.steps(3),
        no_checkpoints=True,
        callbacks={"tensorboard": TensorBoardCallback()},
    ).fit()
    (path,) = (tmp_path / "tensorboard").iterdir()
    assert path.name.startswith("events.out.tfevents.")
    events = [Event.FromString(record) for record in read_records(path)]
    assert events[0].file_version == "brain.Event:2"
    assert [event.step for event in events[1:]] == [1, 2, 3]
    assert all(len(event.summary.value) > 1 for event in events[1:])


def test_a_second_run_in_the_same_second_gets_its_own_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    frozen = types.SimpleNamespace(time=lambda: 1_700_000_000.0)
    monkeypatch.setattr("olmolike.train.callbacks.tensorboard.time", frozen)
    for _ in range(2):
        build_trainer(
            tmp_path,
            max_duration=Duration.steps(1),
            no_checkpoints=True,
            save_overwrite=True,
            callbacks={"tensorboard": TensorBoardCallback()},
        ).fit()
    files = sorted(p.name for p in (tmp_path / "tensorboard").iterdir())
    assert len(files) == 2 and files[1] == files[0] + ".1"
    for name in files:
        read_records(tmp_path / "tensorboard" / name)


@pytest.mark.parametrize("subdir", ["", "/abs", "../out", "a/../../b"])
def test_subdir_must_stay_inside_the_save_folder(subdir: str) -> None:
    with pytest.raises(ConfigurationError, match="subdir"):
        TensorBoardCallback(subdir=subdir)


@pytest.mark.parametrize(
    ("step", "scalars"),
    [
        (1, {"train/CE loss": 2.5, "optim/LR (group 0)": 3e-4}),
        (7, {"zero": 0.0, "negative": -1.25, "nan": float("nan"), "inf": float("-inf")}),
        (2**40, {"beyond float32": 1e40, "below": -1e40, "tiny": 1e-50}),
        (0, {"": 1.0, "ü" * 100 + "/long tag of more than 127 bytes": 2.0}),
        (3, {}),
    ],
)
def test_scalar_events_are_what_protobuf_serializes(step: int, scalars: dict[str, float]) -> None:
    """The hand-made encoding is byte for byte TensorBoard's own protobuf message."""
    expected = Event(
        wall_time=1_700_000_000.125,
        step=step,
        summary=Summary(
            value=[Summary.Value(tag=name, simple_value=v) for name, v in scalars.items()]
        ),
    ).SerializeToString()
    prefixes: dict[str, bytes] = {}
    assert scalar_event(1_700_000_000.125, step, scalars, prefixes) == expected
    # The second time through, the tags come from the cache.
    assert scalar_event(1_700_000_000.125, step, scalars, prefixes) == expected
