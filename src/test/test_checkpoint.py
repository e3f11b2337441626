"""Checkpoints in one process: format, commit protocol, load strategies, exact resume."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from testutils import build_trainer

from olmolike.exceptions import CheckpointError, ConfigurationError
from olmolike.train import Callback, Duration, LoadStrategy
from olmolike.train.callbacks import CheckpointerCallback
from olmolike.train.checkpoint import MARKER, Checkpointer


@dataclass
class Losses(Callback):
    by_step: dict[int, float] = field(default_factory=dict)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if "train/CE loss" in metrics:
            self.by_step[step] = metrics["train/CE loss"]


@dataclass
class CancelAt(Callback):
    step_to_cancel: int = 0

    def post_step(self) -> None:
        if self.trainer.global_step == self.step_to_cancel:
            self.trainer.cancel_run("interrupted for the test")


def train(save: Path | str, *callbacks: Callback, **kwargs: Any) -> Any:
    losses = Losses()
    trainer = build_trainer(save, num_instances=48, **kwargs)
    trainer.add_callback("losses", losses)
    for i, cb in enumerate(callbacks):
        trainer.add_callback(f"cb{i}", cb)
    trainer.fit()
    return trainer, losses.by_step


def params(trainer: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.train_module.model.parameters()]


def checkpointer_cb(**kwargs: Any) -> dict[str, Any]:
    return {"callbacks": {"checkpointer": CheckpointerCallback(**kwargs)}}


# -- format and discovery ----------------------------------------------------------------------


def test_layout_and_marker(tmp_path: Path) -> None:
    train(tmp_path, max_duration=Duration.steps(3), **checkpointer_cb(save_interval=2))
    assert [s for s, _ in Checkpointer.find_checkpoints(tmp_path)] == [0, 2, 3]
    step2 = tmp_path / "step2"
    assert sorted(p.name for p in step2.iterdir()) == [MARKER, "model_and_optim", "train"]
    assert (step2 / "train" / "rank0.pt").exists() and (
        step2 / "model_and_optim" / ".metadata"
    ).exists()
    marker = json.loads((step2 / MARKER).read_text())
    assert marker["step"] == 2 and marker["ephemeral"] is False and marker["world_size"] == 1
    assert not list(tmp_path.glob(".*.tmp"))  # staging folders are renamed away
    assert Checkpointer.latest_checkpoint(tmp_path) == str(step2.parent / "step3")


@pytest.mark.parametrize("save_async", [False, True])
def test_added_files_are_part_of_every_checkpoint(tmp_path: Path, save_async: bool) -> None:
    trainer = build_trainer(
        tmp_path,
        max_duration=Duration.steps(3),
        **checkpointer_cb(save_interval=2, save_async=save_async),
    )
    trainer.add_checkpoint_file("notes.txt", "first")
    trainer.add_checkpoint_file("blob.bin", b"\x00\x01")

    @dataclass
    class ChangeNotes(Callback):
        def post_step(self) -> None:
            if self.trainer.global_step == 2:
                self.trainer.add_checkpoint_file("notes.txt", "second")

    trainer.add_callback("change", ChangeNotes())
    trainer.fit()
    # The pre-train and step-2 saves come before the change (the checkpointer runs first).
    notes = {step: (tmp_path / f"step{step}" / "notes.txt").read_text() for step in (0, 2, 3)}
    assert notes == {0: "first", 2: "first", 3: "second"}
    assert (tmp_path / "step3" / "blob.bin").read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in (tmp_path / "step3").iterdir()) == sorted(
        [MARKER, "blob.bin", "model_and_optim", "notes.txt", "train"]
    )


@pytest.mark.parametrize("name", ["", "a/b", "..", "train", "model_and_optim", MARKER])
def test_a_checkpoint_file_must_have_a_plain_unreserved_name(tmp_path: Path, name: str) -> None:
    trainer = build_trainer(tmp_path, max_duration=Duration.steps(1))
    with pytest.raises(CheckpointError, match="plain file name"):
        trainer.add_checkpoint_file(name, "x")


def test_incomplete_checkpoints_are_invisible(tmp_path: Path) -> None:
    train(tmp_path, max_duration=Duration.steps(2), **checkpointer_cb(save_interval=1))
    (tmp_path / "step2" / MARKER).unlink()  # as if the save had died before its marker
    (tmp_path / "step9").mkdir()
    (tmp_path / ".step3.tmp").mkdir()
    assert [s for s, _ in Checkpointer.find_checkpoints(tmp_path)] == [0, 1]
    assert not Checkpointer.dir_is_checkpoint(tmp_path / "step2")
    assert Checkpointer.latest_checkpoint(tmp_path).endswith("step1")
    with pytest.raises(CheckpointError, match=r"not a complete checkpoint .* holds none"):
        build_trainer(tmp_path / "other", max_duration=Duration.steps(1)).load_checkpoint(
            tmp_path / "step2"
        )
    with pytest.raises(FileNotFoundError):
        Checkpointer.latest_checkpoint(tmp_path / "nowhere")


def test_removal_deletes_the_marker_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from olmolike import io

    train(tmp_path, max_duration=Duration.steps(1))
    original = io.remove

    def remove_marker_then_crash(path: Any, *, recursive: bool = False) -> None:
        if recursive:
            raise OSError("crashed mid-removal")
        original(path, recursive=recursive)

    monkeypatch.setattr(io, "remove", remove_marker_then_crash)
    with pytest.raises(OSError):
        Checkpointer.remove_checkpoint(str(tmp_path / "step1"))
    assert (tmp_path / "step1" / "model_and_optim").exists()
    assert not Checkpointer.dir_is_checkpoint(tmp_path / "step1")


def test_existing_checkpoint_is_never_overwritten_without_save_overwrite(tmp_path: Path) -> None:
    trainer, _ = train(tmp_path, max_duration=Duration.steps(2))
    before = (tmp_path / "step2" / MARKER).read_text()
    with pytest.raises(CheckpointError, match="save_overwrite"):
        trainer.save_checkpoint()
    assert (tmp_path / "step2" / MARKER).read_text() == before
    trainer.checkpointer.save_overwrite = True
    trainer.save_checkpoint()
    assert Checkpointer.dir_is_checkpoint(tmp_path / "step2")


def test_folder_of_another_run_is_refused_at_build_time(tmp_path: Path) -> None:
    train(tmp_path, max_duration=Duration.steps(1))
    with pytest.raises(ConfigurationError, match=r"save_folder: .*already holds checkpoints"):
        build_trainer(tmp_path, max_duration=Duration.steps(1), load_strategy=LoadStrategy.never)
    build_trainer(
        tmp_path,
        max_duration=Duration.steps(1),
        load_strategy=LoadStrategy.never,
        save_overwrite=True,
    )


# -- callback ----------------------------------------------------------------------------------


def test_ephemeral_checkpoints_keep_only_the_newest(tmp_path: Path) -> None:
    train(
        tmp_path,
        max_duration=Duration.steps(9),
        **checkpointer_cb(save_interval=4, ephemeral_save_interval=3, pre_train_checkpoint=False),
    )
    # step3 (ephemeral) went when step4 was done; step6 when step8 was; step9 is the final one.
    assert [s for s, _ in Checkpointer.find_checkpoints(tmp_path)] == [4, 8, 9]
    assert list(Checkpointer.find_checkpoints(tmp_path, ephemeral=True)) == []


def test_max_checkpoints_keeps_the_newest_permanent_ones(tmp_path: Path) -> None:
    train(
        tmp_path,
        max_duration=Duration.steps(7),
        **checkpointer_cb(save_interval=2, max_checkpoints=2),
    )
    assert [s for s, _ in Checkpointer.find_checkpoints(tmp_path)] == [6, 7]


@pytest.mark.parametrize("settings", [{"no_checkpoints": True}, checkpointer_cb(enabled=False)])
def test_disabled_checkpointing_saves_nothing(tmp_path: Path, settings: dict[str, Any]) -> None:
    train(tmp_path, max_duration=Duration.steps(3), **settings)
    assert list(Checkpointer.find_checkpoints(tmp_path)) == []


def test_restarting_a_finished_run_saves_nothing_new(tmp_path: Path) -> None:
    train(tmp_path, max_duration=Duration.steps(3))
    marker = (tmp_path / "step3" / MARKER).read_text()
    trainer, losses = train(tmp_path, max_duration=Duration.steps(3))
    assert trainer.checkpoint_loaded and trainer.global_step == 3 and losses == {}
    assert (tmp_path / "step3" / MARKER).read_text() == marker


def test_async_save_completes_and_is_loadable(tmp_path: Path) -> None:
    reference, _ = train(tmp_path / "sync", max_duration=Duration.steps(4))
    train(
        tmp_path / "async",
        max_duration=Duration.steps(4),
        **checkpointer_cb(save_async=True, save_interval=2),
    )
    assert [s for s, _ in Checkpointer.find_checkpoints(tmp_path / "async")] == [0, 2, 4]
    resumed = build_trainer(tmp_path / "async", num_instances=48, max_duration=Duration.steps(4))
    resumed.load_checkpoint(tmp_path / "async" / "step4")
    assert all(torch.equal(a, b) for a, b in zip(params(resumed), params(reference)))


# -- load strategies ---------------------------------------------------------------------------


def test_load_strategy_always_without_checkpoint_fails(tmp_path: Path) -> None:
    trainer = build_trainer(
        tmp_path, max_duration=Duration.steps(2), load_strategy=LoadStrategy.always
    )
    with pytest.raises(CheckpointError, match="always"):
        trainer.fit()


def test_save_folder_wins_over_load_path(tmp_path: Path) -> None:
    train(tmp_path / "other", max_duration=Duration.steps(2))
    train(tmp_path / "mine", max_duration=Duration.steps(3))
    trainer = build_trainer(
        tmp_path / "mine",
        num_instances=48,
        max_duration=Duration.steps(3),
        load_path=str(tmp_path / "other"),
    )
    assert trainer.maybe_load_checkpoint() and trainer.global_step == 3
    fresh = build_trainer(
        tmp_path / "new",
        num_instances=48,
        max_duration=Duration.steps(2),
        load_path=str(tmp_path / "other"),
    )
    fresh.fit()
    assert fresh.checkpoint_loaded and fresh.global_step == 2


def test_fine_tune_from_weights_only(tmp_path: Path) -> None:
    source, _ = train(tmp_path / "pretrain", max_duration=Duration.steps(3))
    trainer = build_trainer(
        tmp_path / "finetune",
        num_instances=48,
        max_duration=Duration.steps(2),
        load_path=str(tmp_path / "pretrain" / "step3"),
        load_trainer_state=False,
        load_optim_state=False,
    )
    trainer._checkpoints.resume(trainer.load_checkpoint)
    assert trainer.checkpoint_loaded and trainer.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(params(trainer), params(source)))
    assert trainer.train_module.optim.state == {}  # type: ignore[attr-defined]


# -- exact resume ------------------------------------------------------------------------------


def test_cancel_then_resume_reproduces_the_uninterrupted_run(tmp_path: Path) -> None:
    full, full_losses = train(tmp_path / "full", max_duration=Duration.steps(12))
    _, first = train(
        tmp_path / "split", CancelAt(step_to_cancel=5), max_duration=Duration.steps(12)
    )
    assert max(first) == 5 and Checkpointer.latest_checkpoint(tmp_path / "split").endswith("step5")
    torch.manual_seed(999)  # the resumed run must not depend on the process's RNG
    resumed, second = train(tmp_path / "split", max_duration=Duration.steps(12))
    assert resumed.checkpoint_loaded and sorted(second) == list(range(6, 13))
    assert {**first, **second} == full_losses  # bit for bit, every step
    assert all(torch.equal(a, b) for a, b in zip(params(resumed), params(full)))


def test_a_pre_train_checkpoint_does_not_change_training(tmp_path: Path) -> None:
    _, with_it = train(
        tmp_path / "a", max_duration=Duration.steps(4), **checkpointer_cb(pre_train_checkpoint=True)
    )
    _, without = train(
        tmp_path / "b",
        max_duration=Duration.steps(4),
        **checkpointer_cb(pre_train_checkpoint=False),
    )
    assert Checkpointer.dir_is_checkpoint(tmp_path / "a" / "step0")
    assert with_it == without


@pytest.mark.timeout(120)
def test_load_path_over_http_as_an_archive(tmp_path: Path) -> None:
    import functools
    import http.server
    import shutil
    import threading

    source, _ = train(tmp_path / "run", max_duration=Duration.steps(3))
    served = tmp_path / "served"
    served.mkdir()
    shutil.make_archive(str(served / "step3"), "gztar", root_dir=tmp_path / "run", base_dir="step3")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/step3.tar.gz"
        trainer = build_trainer(
            tmp_path / "new", num_instances=48, max_duration=Duration.steps(3), load_path=url
        )
        trainer._checkpoints.resume(trainer.load_checkpoint)
    finally:
        server.shutdown()
        server.server_close()
    assert trainer.checkpoint_loaded and trainer.global_step == 3
    assert all(torch.equal(a, b) for a, b in zip(params(trainer), params(source)))


def test_checkpointer_write_file_is_olmo_cores_and_respects_save_overwrite(
    tmp_path: Path,
) -> None:
    checkpointer = Checkpointer(work_dir=tmp_path / "work")
    path = checkpointer.write_file(str(tmp_path), "notes.txt", "one")
    assert Path(path).read_text() == "one"
    with pytest.raises(FileExistsError):
        checkpointer.write_file(str(tmp_path), "notes.txt", "two")
    Checkpointer(work_dir=tmp_path / "work", save_overwrite=True).write_file(
        str(tmp_path), "notes.txt", b"two"
    )
    assert Path(path).read_text() == "two"


def test_model_and_optim_helpers_round_trip(tmp_path: Path) -> None:
    from olmolike.distributed.checkpoint import (
        load_model_and_optim_state,
        save_model_and_optim_state,
    )

    source, _ = train(tmp_path / "run", max_duration=Duration.steps(2))
    module = source.train_module
    save_model_and_optim_state(tmp_path / "dcp", module.model, module.optim)
    fresh = build_trainer(
        tmp_path / "fresh", num_instances=48, seed=5, max_duration=Duration.steps(1)
    )
    load_model_and_optim_state(tmp_path / "dcp", fresh.train_module.model, fresh.train_module.optim)
    assert all(torch.equal(a, b) for a, b in zip(params(fresh), params(source)))
    loaded, saved = fresh.train_module.optim.state_dict(), module.optim.state_dict()
    assert all(
        torch.equal(loaded["state"][i]["exp_avg"], saved["state"][i]["exp_avg"])
        for i in saved["state"]
    )
    save_model_and_optim_state(tmp_path / "weights", module.model)
    with pytest.raises(CheckpointError, match="no optimizer state"):
        load_model_and_optim_state(
            tmp_path / "weights", fresh.train_module.model, fresh.train_module.optim
        )
