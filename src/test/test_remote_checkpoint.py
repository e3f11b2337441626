"""Checkpoints on object stores, against real servers on 127.0.0.1 (GCS emulator, moto S3).

What is checked, for ``gs://`` and ``s3://`` alike: saving (pre-train, interval and final
checkpoints) and finding them; resuming in a new trainer, with losses equal bit for bit to an
uninterrupted run; loading from ``load_path``; a store that goes away in the middle of a save
(the save fails clearly and leaves no marker, and the next one succeeds); removal that deletes
the marker first; and retries ending in ``NetworkError``.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from remote_servers import (
    RemoteStore,
    ServerProcess,
    ServerStartError,
    dead_endpoint,
    fast_client_retries,
    free_port,
)
from testutils import build_trainer, dcp_shards

import olmolike.io
from olmolike.exceptions import CheckpointError, NetworkError
from olmolike.train import Callback, CheckpointerConfig, Duration, Trainer
from olmolike.train.callbacks import CheckpointerCallback
from olmolike.train.checkpoint import MARKER, Checkpointer

pytestmark = pytest.mark.slow

try:
    from botocore.exceptions import EndpointConnectionError

    S3_UNREACHABLE: tuple[type[BaseException], ...] = (EndpointConnectionError,)
except ImportError:  # without botocore (s3fs) the s3 cases are skipped anyway
    S3_UNREACHABLE = (Exception,)

PROTOCOLS = ["gs", "s3"]
BUCKET_FIXTURE = {"gs": "gcs_bucket", "s3": "s3_bucket"}

# What one complete single-rank checkpoint holds, relative to its step folder.
CHECKPOINT_FILES = [
    MARKER,
    "model_and_optim/.metadata",
    *dcp_shards(prefix="model_and_optim/"),
    "train/rank0.pt",
]
# The same, written with one thread (one shard file, uploads one after another).
ONE_THREAD_FILES = [
    MARKER,
    "model_and_optim/.metadata",
    "model_and_optim/__0_0.distcp",
    "train/rank0.pt",
]
ONE_THREAD = CheckpointerConfig(save_thread_count=1)


@pytest.fixture(params=PROTOCOLS)
def store(request: pytest.FixtureRequest) -> RemoteStore:
    """A bucket on the session's GCS emulator or moto S3 server, by parameter."""
    bucket: RemoteStore = request.getfixturevalue(BUCKET_FIXTURE[request.param])
    return bucket


@dataclass
class LossRecorder(Callback):
    """Records the step training starts from and each step's training loss."""

    start_step: int | None = None
    losses: dict[int, float] = field(default_factory=dict)

    def pre_train(self) -> None:
        self.start_step = self.trainer.global_step

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.losses[step] = metrics["train/CE loss"]


def train(
    save_folder: str | Path,
    work_dir: Path,
    *,
    steps: int,
    save_interval: int = 250,
    max_checkpoints: int | None = None,
    **config: Any,
) -> tuple[Trainer, LossRecorder]:
    """Fit a tiny trainer for ``steps`` steps (in total, counting a resumed checkpoint's)."""
    recorder = LossRecorder()
    trainer = build_trainer(
        save_folder,
        work_dir=str(work_dir),
        max_duration=Duration.steps(steps),
        callbacks={
            "checkpointer": CheckpointerCallback(
                save_interval=save_interval, max_checkpoints=max_checkpoints
            ),
            "losses": recorder,
        },
        **config,
    )
    trainer.fit()
    return trainer, recorder


def reference_run(tmp_path: Path, steps: int) -> tuple[Trainer, dict[int, float]]:
    """An uninterrupted run with a local save folder: what every resumed run must reproduce."""
    trainer, recorder = train(tmp_path / "reference", tmp_path / "reference", steps=steps)
    assert sorted(recorder.losses) == list(range(1, steps + 1))
    return trainer, recorder.losses


def steps_found(folder: str) -> list[int]:
    return [step for step, _ in Checkpointer.find_checkpoints(folder)]


def assert_same_weights(a: Trainer, b: Trainer) -> None:
    state_a = a.train_module.model.state_dict()  # type: ignore[attr-defined]
    state_b = b.train_module.model.state_dict()  # type: ignore[attr-defined]
    assert state_a.keys() == state_b.keys()
    for name, tensor in state_a.items():
        assert torch.equal(tensor, state_b[name]), f"{name} differs"


# -- the servers themselves --------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_server_that_exits_while_starting_is_a_clear_error(tmp_path: Path) -> None:
    script = "import sys; print('cannot bind, giving up'); sys.exit(3)"
    server = ServerProcess(
        "doomed", [sys.executable, "-c", script], free_port(), log_path=tmp_path / "doomed.log"
    )
    with pytest.raises(ServerStartError, match=r"(?s)exited with code 3.*cannot bind"):
        server.start()
    assert not server.running


@pytest.mark.timeout(30)
def test_server_that_never_answers_times_out_and_is_terminated(tmp_path: Path) -> None:
    server = ServerProcess(
        "silent",
        [sys.executable, "-c", "import time; time.sleep(60)"],
        free_port(),
        log_path=tmp_path / "silent.log",
        startup_timeout=1.0,
    )
    with pytest.raises(ServerStartError, match=r"did not answer .* within 1s"):
        server.start()  # the test's timeout: it did not wait for the 60 s sleep
    assert not server.running


# -- saving and finding ------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_checkpoints_are_saved_to_and_found_on_the_store(
    store: RemoteStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = store.url("run-x")
    assert steps_found(folder) == []
    assert not Checkpointer.contains_checkpoint(folder)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        Checkpointer.latest_checkpoint(folder)

    # Uploads write each object once: a server-side copy or move (the fallback for a rename,
    # ~33 s per save on the emulator) must never happen. Count them on the real client.
    copies: list[tuple[str, str]] = []
    fs_class = type(store.fs)
    real_cp_file = fs_class._cp_file

    async def counted_cp_file(self: Any, path1: str, path2: str, **kwargs: Any) -> Any:
        copies.append((path1, path2))
        return await real_cp_file(self, path1, path2, **kwargs)

    monkeypatch.setattr(fs_class, "_cp_file", counted_cp_file)
    # 5 steps, every 2: pre-train (0), interval (2, 4), final (5).
    train(folder, tmp_path / "work", steps=5, save_interval=2)

    assert steps_found(folder) == [0, 2, 4, 5]
    assert [path for _, path in Checkpointer.find_checkpoints(folder)] == [
        store.url("run-x", f"step{step}") for step in (0, 2, 4, 5)
    ]
    assert Checkpointer.latest_checkpoint(folder) == store.url("run-x", "step5")
    assert Checkpointer.dir_is_checkpoint(store.url("run-x", "step5"))
    assert not Checkpointer.dir_is_checkpoint(folder)
    assert Checkpointer.contains_checkpoint(folder)
    metadata = Checkpointer.checkpoint_metadata(store.url("run-x", "step5"))
    assert metadata["step"] == 5 and metadata["ephemeral"] is False
    # Exactly the files of the format, nothing left over from a rename (".metadata.tmp").
    for step in (0, 2, 4, 5):
        assert store.objects("run-x", f"step{step}") == CHECKPOINT_FILES
    # Staged files are removed once uploaded.
    assert not (tmp_path / "work" / "checkpoint-staging" / "step5").exists()
    assert copies == [], f"server-side copies during saves: {copies}"


@pytest.mark.timeout(120)
def test_added_files_are_uploaded_before_the_marker(store: RemoteStore, tmp_path: Path) -> None:
    folder = store.url("run-files")
    seen_without_file: list[str] = []
    real_write = olmolike.io.write_file

    def check_marker_comes_last(dir: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        if name == MARKER and not olmolike.io.exists(olmolike.io.join_path(dir, "config.json")):
            seen_without_file.append(str(dir))
        return real_write(dir, name, *args, **kwargs)

    trainer = build_trainer(
        folder,
        work_dir=str(tmp_path / "work"),
        max_duration=Duration.steps(2),
        callbacks={"checkpointer": CheckpointerCallback(save_interval=2)},
    )
    trainer.add_checkpoint_file("config.json", '{"run": "files"}')
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(olmolike.io, "write_file", check_marker_comes_last)
        trainer.fit()
    assert steps_found(folder) == [0, 2]
    for step in (0, 2):
        assert store.objects("run-files", f"step{step}") == sorted(
            [*CHECKPOINT_FILES, "config.json"]
        )
    assert store.fs.cat(store.url("run-files", "step2", "config.json")) == b'{"run": "files"}'
    assert seen_without_file == []


# -- resuming and loading ----------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_resume_from_the_store_matches_an_uninterrupted_run(
    store: RemoteStore, tmp_path: Path
) -> None:
    reference, expected = reference_run(tmp_path, steps=6)
    folder = store.url("run-x")

    _, first = train(folder, tmp_path / "work-1", steps=3, save_interval=2)
    assert first.losses == {s: expected[s] for s in (1, 2, 3)}
    assert steps_found(folder) == [0, 2, 3]

    # A new work_dir: nothing staged locally by the first run can be what gets loaded.
    second_trainer, second = train(folder, tmp_path / "work-2", steps=6, save_interval=2)
    assert second_trainer.checkpoint_loaded
    assert second.start_step == 3  # the latest checkpoint, not an earlier one
    assert second_trainer.global_step == 6
    # Bit for bit: ``==`` on floats, not approx.
    assert second.losses == {s: expected[s] for s in (4, 5, 6)}
    assert_same_weights(reference, second_trainer)
    assert steps_found(folder) == [0, 2, 3, 4, 6]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("load_from", "pre_download"),
    [("checkpoint", False), ("folder", True)],
    ids=["checkpoint-streamed", "folder-predownloaded"],
)
def test_load_path_on_the_store_into_a_local_run(
    store: RemoteStore,
    tmp_path: Path,
    load_from: str,
    pre_download: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="olmolike")
    reference, expected = reference_run(tmp_path, steps=6)
    source = store.url("source-run")
    train(source, tmp_path / "source-work", steps=3)
    assert steps_found(source) == [0, 3]

    local = tmp_path / "local-run"
    load_path = store.url("source-run", "step3") if load_from == "checkpoint" else source
    trainer, recorder = train(
        local,
        tmp_path / "work",
        steps=6,
        load_path=load_path,
        checkpointer=CheckpointerConfig(pre_download=pre_download),
    )
    assert trainer.checkpoint_loaded
    assert recorder.start_step == 3
    assert recorder.losses == {s: expected[s] for s in (4, 5, 6)}
    assert_same_weights(reference, trainer)
    # The new run saves locally (no pre-train checkpoint after a load); the source is untouched.
    assert steps_found(str(local)) == [6]
    assert steps_found(source) == [0, 3]
    # Pre-downloaded: copied to the work dir, loaded, and removed again (it is not a cache).
    downloaded = tmp_path / "work" / "checkpoint-download" / "step3"
    assert (f"to {downloaded}" in caplog.text) == pre_download
    assert not downloaded.exists()


# -- a store that goes away mid-save -----------------------------------------------------------


@dataclass
class Outage:
    """Makes ``store`` unreachable (``begin``) and reachable again (``end``)."""

    store: RemoteStore
    active: bool = False
    _stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def begin(self) -> None:
        self.active = True
        if self.store.protocol == "gs":
            # The emulator really dies; it keeps its objects on disk, so a restart on the same
            # port brings back what was uploaded, as a real service after an outage would.
            self.store.server.stop()
        else:
            # moto keeps objects in memory only: restarting it would lose them and prove
            # nothing about what the failed save left behind. Cut the client off instead.
            self._stack.enter_context(dead_endpoint(self.store))

    def end(self) -> None:
        if self.active:
            if self.store.protocol == "gs":
                self.store.server.start()
            self._stack.close()
            self.active = False


@pytest.fixture(params=PROTOCOLS)
def outage(request: pytest.FixtureRequest) -> Iterator[Outage]:
    fixture = "restartable_gcs_bucket" if request.param == "gs" else "s3_bucket"
    outage = Outage(request.getfixturevalue(fixture))
    try:
        yield outage
    finally:
        outage.end()  # never leave the store unreachable for the next test


@pytest.mark.timeout(180)
def test_store_outage_mid_save_leaves_no_marker_and_the_next_save_succeeds(
    outage: Outage,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = outage.store
    fast_client_retries(monkeypatch)
    reference, expected = reference_run(tmp_path, steps=6)
    folder = store.url("run-x")
    step4 = store.url("run-x", "step4")

    # The outage starts right after the first file of step 4 is uploaded, so the store holds
    # part of that checkpoint: the case a marker exists for.
    real_persist = olmolike.io.persist
    uploaded_before_outage: list[str] = []

    def persist_then_outage(src_dir: Any, dst_dir: Any, name: Any, **kwargs: Any) -> str:
        target = real_persist(src_dir, dst_dir, name, **kwargs)
        if str(dst_dir) == step4 and not outage.active and not uploaded_before_outage:
            uploaded_before_outage.append(str(name))
            outage.begin()
        return target

    monkeypatch.setattr(olmolike.io, "persist", persist_then_outage)
    with (
        caplog.at_level(logging.INFO, logger="olmolike"),
        pytest.raises(CheckpointError, match=r"saving \S+/step4 failed .* it has no marker"),
    ):
        train(folder, tmp_path / "work-1", steps=6, save_interval=2, checkpointer=ONE_THREAD)
    assert uploaded_before_outage == ["model_and_optim/__0_0.distcp"]
    assert f"Saving this rank's part of {step4} failed" in caplog.text
    # ... because uploading the next file failed (with a NetworkError after retries on gs://).
    assert "step4/model_and_optim/.metadata" in caplog.text
    outage.end()
    monkeypatch.setattr(olmolike.io, "persist", real_persist)

    # Back up: the partial checkpoint is there, but without a marker it is not a checkpoint.
    assert store.objects("run-x", "step4") == ["model_and_optim/__0_0.distcp"]
    assert not Checkpointer.dir_is_checkpoint(step4)
    assert steps_found(folder) == [0, 2]
    assert Checkpointer.latest_checkpoint(folder) == store.url("run-x", "step2")

    # A restarted run resumes from step 2, saves step 4 over the partial one, and finishes
    # exactly as if nothing had happened.
    trainer, recorder = train(
        folder, tmp_path / "work-2", steps=6, save_interval=2, checkpointer=ONE_THREAD
    )
    assert recorder.start_step == 2
    assert recorder.losses == {s: expected[s] for s in (3, 4, 5, 6)}
    assert_same_weights(reference, trainer)
    assert steps_found(folder) == [0, 2, 4, 6]
    assert store.objects("run-x", "step4") == ONE_THREAD_FILES


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "protocol",
    [
        "gs",
        "s3",
    ],
)
def test_unreachable_store_is_retried_then_raises_network_error(
    protocol: str,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    store: RemoteStore = request.getfixturevalue(BUCKET_FIXTURE[protocol])
    fast_client_retries(monkeypatch)
    with (
        caplog.at_level(logging.WARNING, logger="olmolike.io"),
        dead_endpoint(store),
        pytest.raises(NetworkError, match="failed after 5 attempts"),
    ):
        Checkpointer.dir_is_checkpoint(store.url("run-x", "step1"))
    # olmolike's own backoff between its 5 attempts (the clients' sleeps are patched too, so
    # the recorded sleeps would mix in theirs: the log says which are ours).
    retries = [r.getMessage() for r in caplog.records if r.name == "olmolike.io"]
    assert [m.rsplit("retrying in ", 1)[1] for m in retries] == [
        "0.5s (1/5)",
        "1.0s (2/5)",
        "2.0s (3/5)",
        "4.0s (4/5)",
    ]


# -- removing ----------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_remove_checkpoint_deletes_the_marker_first(
    store: RemoteStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = store.url("run-x")
    step1 = store.url("run-x", "step1")
    train(folder, tmp_path / "work", steps=1)
    assert steps_found(folder) == [0, 1]

    # A removal that dies after its first deletion must leave no complete-looking checkpoint.
    real_remove = olmolike.io.remove

    def remove_then_crash(path: Any, *, recursive: bool = False) -> None:
        if recursive:
            raise NetworkError("simulated crash before deleting the files")
        real_remove(path, recursive=recursive)

    monkeypatch.setattr(olmolike.io, "remove", remove_then_crash)
    with pytest.raises(NetworkError, match="simulated crash"):
        Checkpointer.remove_checkpoint(step1)
    assert store.objects("run-x", "step1") == CHECKPOINT_FILES[1:]  # all but the marker
    assert not Checkpointer.dir_is_checkpoint(step1)
    assert steps_found(folder) == [0]
    assert Checkpointer.latest_checkpoint(folder) == store.url("run-x", "step0")

    monkeypatch.setattr(olmolike.io, "remove", real_remove)
    Checkpointer.remove_checkpoint(step1)
    assert store.objects("run-x", "step1") == []
    assert store.objects("run-x", "step0") == CHECKPOINT_FILES


@pytest.mark.timeout(120)
def test_max_checkpoints_prunes_old_checkpoints_on_the_store(
    store: RemoteStore, tmp_path: Path
) -> None:
    folder = store.url("run-x")
    train(folder, tmp_path / "work", steps=4, save_interval=1, max_checkpoints=2)
    assert steps_found(folder) == [3, 4]
    for step in (0, 1, 2):
        assert store.objects("run-x", f"step{step}") == []
