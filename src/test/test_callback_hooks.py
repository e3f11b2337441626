"""OLMo-core's later callback hooks, ephemeral blocking, callback names, training progress,
the attach-time check of hook names, and reset_optimizer_states_on_load."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pytest
from testutils import build_trainer

from olmolike.exceptions import ConfigurationError
from olmolike.train import Callback, Checkpointer, Duration
from olmolike.train.callbacks import CheckpointerCallback, SpeedMonitorCallback
from olmolike.train.checkpoint import CheckpointMetadata


@dataclass
class Recorder(Callback):
    """Records hook calls, the thread they ran on, and edits metrics in pre_log_metrics."""

    events: list[tuple[Any, ...]] = field(default_factory=list)
    threads: set[int] = field(default_factory=set)
    logged: dict[int, dict[str, float]] = field(default_factory=dict)

    def _note(self, *event: Any) -> None:
        self.events.append(event)
        self.threads.add(threading.get_ident())

    def post_checkpoint_loaded(self, path: str) -> None:
        self._note("loaded", path)

    def pre_train(self) -> None:
        self._note("pre_train")

    def pre_log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        metrics["train/doubled"] = 2 * metrics["train/CE loss"]
        metrics.pop("train/CE loss")

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.logged[step] = dict(metrics)

    def post_checkpoint_saved(self, path: str) -> None:
        self._note("saved", Path(path).name)


def fit(tmp_path: Path, steps: int, *callbacks: Callback, **config: Any) -> Any:
    named = {f"cb{i}": cb for i, cb in enumerate(callbacks)}
    trainer = build_trainer(tmp_path, max_duration=Duration.steps(steps), callbacks=named, **config)
    trainer.fit()
    return trainer


@pytest.mark.parametrize("save_async", [False, True])
def test_checkpoint_hooks_fire_on_the_training_thread(tmp_path: Path, save_async: bool) -> None:
    rec = Recorder()
    saver = CheckpointerCallback(save_interval=2, save_async=save_async)
    fit(tmp_path, 4, rec, saver, metrics_collect_interval=1)
    saved = [e[1] for e in rec.events if e[0] == "saved"]
    assert saved == ["step0", "step2", "step4"]
    assert rec.threads == {threading.get_ident()}
    # pre_log_metrics edited the dict that log_metrics received
    assert set(rec.logged) == {1, 2, 3, 4}
    assert all("train/doubled" in m and "train/CE loss" not in m for m in rec.logged.values())

    resumed = Recorder()
    fit(tmp_path, 6, resumed, CheckpointerCallback(save_interval=2))
    assert resumed.events[:2] == [("loaded", str(tmp_path / "step4")), ("pre_train",)]
    assert [e[1] for e in resumed.events if e[0] == "saved"] == ["step6"]


def test_a_method_named_like_an_unknown_hook_is_an_error_at_attach(tmp_path: Path) -> None:
    @dataclass
    class NewerOLMoCoreCallback(Callback):
        def pre_eval(self) -> None:
            raise AssertionError("never called")

    with pytest.raises(ConfigurationError, match=r"pre_eval.*no hook 'pre_eval'.*helper_methods"):
        build_trainer(tmp_path, callbacks={"x": NewerOLMoCoreCallback()})

    @dataclass
    class WithHelper(Callback):
        helper_methods: ClassVar[tuple[str, ...]] = ("post_process",)

        def post_process(self) -> None:
            pass

    trainer = build_trainer(tmp_path, callbacks={"ok": WithHelper()})
    with pytest.raises(ConfigurationError, match="on_eval_done"):

        @dataclass
        class Late(Callback):
            def on_eval_done(self) -> None:
                pass

        trainer.add_callback("late", Late())


@dataclass
class Blocker(Callback):
    """Blocks ephemeral checkpoints for steps [start, stop)."""

    start: int = 3
    stop: int = 6
    names: list[str] = field(default_factory=list)

    def pre_step(self, batch: dict[str, Any]) -> None:
        self.names.append(self.trainer.get_callback_name(self))
        if self.step == self.start:
            self.block_ephemeral_checkpoints()
        if self.step == self.stop:
            self.unblock_ephemeral_checkpoints()


def test_blocked_ephemeral_checkpoints_are_not_saved(tmp_path: Path) -> None:
    rec, blocker = Recorder(), Blocker()
    saver = CheckpointerCallback(save_interval=100, ephemeral_save_interval=1)
    trainer = fit(tmp_path, 7, rec, blocker, saver, metrics_collect_interval=1)
    saved = [e[1] for e in rec.events if e[0] == "saved"]
    assert saved == ["step0", "step1", "step2", "step6", "step7"]
    assert set(blocker.names) == {"cb1"}
    assert not trainer.block_ephemeral_checkpoints
    with pytest.raises(ValueError, match="not attached"):
        trainer.get_callback_name(Recorder())


def test_block_state_is_visible_on_the_trainer(tmp_path: Path) -> None:
    blocker = Blocker(start=1, stop=99)
    trainer = fit(tmp_path, 2, blocker, no_checkpoints=True)
    assert trainer.block_ephemeral_checkpoints
    blocker.unblock_ephemeral_checkpoints()
    blocker.unblock_ephemeral_checkpoints()  # unblocking twice is harmless
    assert not trainer.block_ephemeral_checkpoints


def test_training_progress(tmp_path: Path) -> None:
    trainer = fit(tmp_path, 5, SpeedMonitorCallback(), no_checkpoints=True)
    progress = trainer.training_progress
    assert (progress.current_step, progress.total_steps) == (5, 5)
    assert progress.current_tokens == trainer.global_train_tokens_seen
    assert progress.bps is not None and progress.bps > 0
    assert progress.tps is not None and progress.tps > 0
    assert progress.time_remaining is None  # nothing left
    assert str(progress).startswith("100% complete, step 5/5, ")

    trainer.max_duration = Duration.steps(10_000)
    ahead = trainer.training_progress
    assert ahead.total_steps == 10_000 and ahead.time_remaining is not None
    assert ahead.time_remaining.total_seconds() % 60 == 0

    bare = fit(tmp_path / "b", 2, no_checkpoints=True).training_progress
    assert (bare.bps, bare.tps, bare.mfu, bare.time_remaining) == (None, None, None, None)


def test_reset_optimizer_states_on_load(tmp_path: Path) -> None:
    fit(tmp_path, 2, CheckpointerCallback(save_interval=2))
    step2 = str(tmp_path / "step2")
    assert CheckpointMetadata.read(step2).step == 2

    kept = build_trainer(tmp_path / "x", max_duration=Duration.steps(3))
    kept.load_checkpoint(step2)
    assert kept.train_module.optim.state  # type: ignore[attr-defined]

    rec = Recorder()
    reset = build_trainer(tmp_path / "y", max_duration=Duration.steps(3), callbacks={"r": rec})
    assert reset.maybe_load_checkpoint(tmp_path, reset_optimizer_states_on_load=True)
    assert not reset.train_module.optim.state  # type: ignore[attr-defined]
    assert reset.global_step == 2  # the rest of the checkpoint is loaded
    assert rec.events == [("loaded", step2)]
    assert Checkpointer.dir_is_checkpoint(step2)


def test_checkpointer_olmo_core_names(tmp_path: Path) -> None:
    import torch

    from olmolike.testing import TinyCausalLM
    from olmolike.train import BasicTrainModule

    assert Checkpointer.CHECKPOINT_DIR == "step{step}"
    assert Checkpointer.checkpoint_dirname(10) == "step10"
    folder = tmp_path / "ckpts"
    path = f"{folder}/{Checkpointer.checkpoint_dirname(10)}"
    model = TinyCausalLM(vocab_size=32, d_model=16, n_layers=1, n_heads=2, max_seq_len=8)
    module = BasicTrainModule(model, torch.optim.AdamW(model.parameters()), 64)
    checkpointer = Checkpointer(work_dir=tmp_path / "work")
    checkpointer.save(path, module, {"rank": 0}, ephemeral=True)
    assert (Path(path) / "train" / "rank0.pt").is_file()
    assert any((Path(path) / "model_and_optim").iterdir())
    assert (Path(path) / Checkpointer.METADATA_FNAME).is_file()
    assert list(Checkpointer.find_checkpoints(folder)) == [(10, path)]
    assert Checkpointer.latest_checkpoint(folder) == path
    assert checkpointer.load(path, module) == {"rank": 0}
    meta = CheckpointMetadata.read(path)
    assert (meta.ephemeral, meta.step, meta.world_size) == (True, 10, 1)
