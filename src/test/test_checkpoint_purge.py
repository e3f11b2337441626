"""Purging old checkpoints never holds up training: the marker goes at once, the files later."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from testutils import build_trainer, patient

from olmolike import io
from olmolike.train import Callback, Checkpointer, Duration
from olmolike.train.callbacks import CheckpointerCallback


@dataclass
class ReleaseAtEnd(Callback):
    """Lets a blocked purge finish once training is over, noting whether it was still running."""

    future: Future[None] | None = None
    release: threading.Event | None = None
    purge_was_running: bool = False

    def post_train(self) -> None:
        assert self.future is not None and self.release is not None
        self.purge_was_running = not self.future.done()
        self.release.set()


def test_a_slow_purge_does_not_hold_up_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = build_trainer(
        tmp_path,
        max_duration=Duration.steps(2),
        callbacks={"checkpointer": CheckpointerCallback(save_interval=1)},
    )
    trainer.fit()
    original = io.remove
    started, release = threading.Event(), threading.Event()

    def slow_remove(path: Any, *, recursive: bool = False) -> None:
        if recursive:  # the files of a checkpoint: blocked until the test lets it go
            started.set()
            assert release.wait(timeout=patient(60))
        original(path, recursive=recursive)

    monkeypatch.setattr(io, "remove", slow_remove)
    step1 = str(tmp_path / "step1")
    future = Checkpointer.purge_checkpoint(step1)
    assert started.wait(timeout=patient(60))
    # The removal is stuck, yet the checkpoint is gone for every reader at once...
    assert not Checkpointer.dir_is_checkpoint(step1)
    assert [step for step, _ in Checkpointer.find_checkpoints(tmp_path)] == [0, 2]
    assert Checkpointer.remove_abandoned(str(tmp_path)) == []  # not its business
    # ...and training goes on (a run resumed from step 2): a step, and a save of its own.
    at_end = ReleaseAtEnd(future, release)
    resumed = build_trainer(
        tmp_path,
        max_duration=Duration.steps(3),
        callbacks={"checkpointer": CheckpointerCallback(save_interval=1), "release": at_end},
    )
    resumed.fit()  # it waits for the purge only when it gives up the folder, after post_train
    assert at_end.purge_was_running
    assert Checkpointer.dir_is_checkpoint(tmp_path / "step3")
    future.result(timeout=patient(60))
    assert not Path(step1).exists()
    assert not list(tmp_path.glob(".purging-*"))


def test_the_run_waits_for_its_purges_when_it_gives_up_the_folder(tmp_path: Path) -> None:
    trainer = build_trainer(
        tmp_path,
        max_duration=Duration.steps(2),
        callbacks={"checkpointer": CheckpointerCallback(save_interval=1)},
    )
    trainer.fit()
    trainer.checkpointer.acquire_lease(str(tmp_path))
    future = Checkpointer.purge_checkpoint(str(tmp_path / "step1"))
    trainer.checkpointer.release_lease()
    assert future.done()
    assert not list(tmp_path.glob("*step1*"))


def test_a_half_removed_purge_is_cleaned_up_by_the_next(tmp_path: Path) -> None:
    trainer = build_trainer(
        tmp_path,
        max_duration=Duration.steps(2),
        callbacks={"checkpointer": CheckpointerCallback(save_interval=1)},
    )
    trainer.fit()
    leftover = tmp_path / ".purging-step0-killed"  # a process died while purging step0
    (tmp_path / "step0").rename(leftover)
    Checkpointer.purge_checkpoint(str(tmp_path / "step1")).result(timeout=patient(60))
    assert not leftover.exists()
    assert [step for step, _ in Checkpointer.find_checkpoints(tmp_path)] == [2]
