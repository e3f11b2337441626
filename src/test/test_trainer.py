"""The trainer loop in one process: hooks, durations, skipping, metrics, cancel, errors, state."""

from __future__ import annotations

import copy
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from testutils import SEQ_LEN, build_trainer

from olmolike.data import TokenTensorDataLoader
from olmolike.exceptions import ConfigurationError, DataError, MetricError
from olmolike.train import Callback, Duration, MetricMergeStrategy, ReduceType, StepSkipRange
from olmolike.train.metrics import MetricBuffer

LOOP_HOOKS = ["pre_load_batch", "pre_step", "pre_optim_step", "post_train_batch", "post_step"]


@dataclass
class Recorder(Callback):
    """Records every hook call, and the metrics logged for each step."""

    calls: list[str] = field(default_factory=list)
    logged: dict[int, dict[str, float]] = field(default_factory=dict)
    batches: list[torch.Tensor] = field(default_factory=list)

    def post_attach(self) -> None:
        self.calls.append("post_attach")

    def pre_train(self) -> None:
        self.calls.append("pre_train")

    def pre_epoch(self) -> None:
        self.calls.append("pre_epoch")

    def pre_load_batch(self) -> None:
        self.calls.append("pre_load_batch")

    def pre_step(self, batch: dict[str, Any]) -> None:
        self.calls.append("pre_step")
        self.batches.append(batch["input_ids"].clone())

    def pre_optim_step(self) -> None:
        self.calls.append("pre_optim_step")

    def post_train_batch(self) -> None:
        self.calls.append("post_train_batch")

    def post_step(self) -> None:
        self.calls.append("post_step")

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.calls.append("log_metrics")
        assert step not in self.logged, f"step {step} logged twice"
        self.logged[step] = metrics

    def post_log_metrics(self) -> None:
        self.calls.append("post_log_metrics")

    def post_epoch(self) -> None:
        self.calls.append("post_epoch")

    def post_train(self) -> None:
        self.calls.append("post_train")

    def on_error(self, exc: BaseException) -> None:
        self.calls.append(f"on_error:{type(exc).__name__}")

    def close(self) -> None:
        self.calls.append("close")

    def losses(self) -> list[float]:
        return [self.logged[s]["train/CE loss"] for s in sorted(self.logged)]


@dataclass
class AtStep(Callback):
    """Runs ``action(trainer)`` in ``pre_step`` of the given step."""

    step_to_act: int = 1
    action: Any = None

    def pre_step(self, batch: dict[str, Any]) -> None:
        if self.trainer.global_step == self.step_to_act:
            self.action(self.trainer)


def fit_with(tmp_path: Any, *callbacks: Callback, **kwargs: Any) -> Any:
    trainer = build_trainer(tmp_path, **kwargs)
    for i, cb in enumerate(callbacks):
        trainer.add_callback(f"cb{i}", cb)
    trainer.fit()
    return trainer


# -- hooks -------------------------------------------------------------------------------------


def test_hooks_fire_in_documented_order(tmp_path: Any) -> None:
    rec = Recorder()
    trainer = fit_with(tmp_path, rec, num_instances=24, max_duration=Duration.epochs(2))
    assert trainer.global_step == 6 and trainer.epoch == 3
    per_epoch = ["pre_epoch", *LOOP_HOOKS * 3, "post_epoch"]
    logging_hooks = ("log_metrics", "post_log_metrics")
    without_logging = [c for c in rec.calls if c not in logging_hooks]
    assert without_logging == ["post_attach", "pre_train", *per_epoch * 2, "post_train", "close"]
    assert sorted(rec.logged) == list(range(1, 7))
    # Every step's metrics are delivered before post_train.
    assert rec.calls.index("post_train") > max(
        i for i, c in enumerate(rec.calls) if c == "log_metrics"
    )


def test_callbacks_run_by_priority_then_insertion(tmp_path: Any) -> None:
    order: list[str] = []

    @dataclass
    class Tagged(Callback):
        tag: str = ""

        def pre_train(self) -> None:
            order.append(self.tag)

    @dataclass
    class Urgent(Tagged):
        priority = 5

    @dataclass
    class Late(Tagged):
        priority = -5

    fit_with(
        tmp_path,
        Tagged(tag="a"),
        Late(tag="late"),
        Urgent(tag="urgent"),
        Tagged(tag="b"),
        max_duration=Duration.steps(1),
    )
    assert order == ["urgent", "a", "b", "late"]


def test_error_runs_on_error_and_close_not_post_train(tmp_path: Any) -> None:
    rec = Recorder()

    def boom(_: Any) -> None:
        raise ValueError("boom at step 3")

    with pytest.raises(ValueError, match="boom at step 3"):
        fit_with(tmp_path, rec, AtStep(step_to_act=3, action=boom), max_duration=Duration.steps(10))
    assert rec.calls[-2:] == ["on_error:ValueError", "close"]
    assert "post_train" not in rec.calls


def test_duplicate_callback_name_is_rejected(tmp_path: Any) -> None:
    trainer = build_trainer(tmp_path, max_duration=Duration.steps(1))
    trainer.add_callback("rec", Recorder())
    with pytest.raises(ConfigurationError, match="rec"):
        trainer.add_callback("rec", Recorder())


# -- durations ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("duration", "expected_steps"),
    [
        (Duration.steps(7), 7),
        (Duration.tokens(3 * 8 * SEQ_LEN + 1), 4),  # rounded up to whole batches
        (Duration.tokens(3 * 8 * SEQ_LEN), 3),
        (Duration.epochs(2), 16),  # 64 instances / 8 per batch = 8 steps per epoch
    ],
)
def test_max_duration_units(tmp_path: Any, duration: Duration, expected_steps: int) -> None:
    trainer = build_trainer(tmp_path, max_duration=duration)
    assert trainer.max_steps == expected_steps
    trainer.fit()
    assert trainer.global_step == expected_steps
    assert trainer.global_train_tokens_seen == expected_steps * 8 * SEQ_LEN


def test_hard_stop_stops_early_without_changing_max_steps(tmp_path: Any) -> None:
    trainer = fit_with(
        tmp_path, max_duration=Duration.epochs(3), hard_stop=Duration.tokens(5 * 8 * SEQ_LEN)
    )
    assert trainer.global_step == 5
    assert trainer.max_steps == 24
    assert trainer.max_tokens == 24 * 8 * SEQ_LEN


class StreamingLoader(TokenTensorDataLoader):
    @property
    def total_batches(self) -> Any:
        return None


def test_epochs_with_unknown_epoch_length_is_a_clear_error(tmp_path: Any) -> None:
    trainer = build_trainer(tmp_path, max_duration=Duration.epochs(1))
    trainer.data_loader.__class__ = StreamingLoader
    assert trainer.max_steps is None
    with pytest.raises(ConfigurationError, match=r"max_duration: .*steps or tokens"):
        trainer.fit()


def test_epoch_duration_counts_epochs_of_unknown_length_loader_by_steps(tmp_path: Any) -> None:
    trainer = build_trainer(tmp_path, max_duration=Duration.steps(20), num_instances=48)
    trainer.data_loader.__class__ = StreamingLoader
    rec = Recorder()
    trainer.add_callback("rec", rec)
    trainer.fit()
    assert trainer.global_step == 20
    assert rec.calls.count("post_epoch") == 3  # 6 batches per epoch: epochs 1-3 end, 4 is partial
    assert trainer.epoch == 4


def test_empty_epoch_is_an_error(tmp_path: Any) -> None:
    trainer = build_trainer(tmp_path, max_duration=Duration.steps(3), num_instances=8)
    trainer.data_loader.__class__ = StreamingLoader
    trainer.data_loader.instances = trainer.data_loader.instances[:4]  # less than one batch
    with pytest.raises(DataError, match="no batches in epoch 1"):
        trainer.fit()


# -- step skipping -----------------------------------------------------------------------------


def test_skipped_steps_consume_batches_but_do_not_train(tmp_path: Any) -> None:
    params: dict[int, torch.Tensor] = {}

    @dataclass
    class Snapshot(Callback):
        def post_step(self) -> None:
            weights = self.trainer.train_module.model.head.weight  # type: ignore[attr-defined]
            params[self.trainer.global_step] = weights.detach().clone()

    rec = Recorder()
    trainer = fit_with(
        tmp_path,
        rec,
        Snapshot(),
        max_duration=Duration.steps(6),
        steps_to_skip=[StepSkipRange(3, 5)],
    )
    reference = Recorder()
    fit_with(tmp_path / "ref", reference, max_duration=Duration.steps(6))
    assert torch.equal(params[2], params[3]) and torch.equal(params[3], params[4])
    assert not torch.equal(params[4], params[5])
    # Same batches in the same order as an unskipped run: skipping consumes them.
    assert all(torch.equal(a, b) for a, b in zip(rec.batches, reference.batches))
    assert trainer.global_train_tokens_seen == 6 * 8 * SEQ_LEN
    assert rec.calls.count("pre_optim_step") == 4 and rec.calls.count("post_step") == 6
    assert sorted(rec.logged) == list(range(1, 7))
    assert "train/CE loss" not in rec.logged[3] and "train/CE loss" in rec.logged[5]


# -- metrics -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [
        (MetricMergeStrategy.warn, 2.0),
        (MetricMergeStrategy.oldest, 2.0),
        (MetricMergeStrategy.latest, 6.0),
        (MetricMergeStrategy.sum, 8.0),
        (MetricMergeStrategy.mean, 4.0),
        (MetricMergeStrategy.max, 6.0),
        (MetricMergeStrategy.min, 2.0),
    ],
)
@pytest.mark.parametrize("as_tensor", [True, False])
def test_merge_strategies(
    tmp_path: Any, strategy: MetricMergeStrategy, expected: float, as_tensor: bool
) -> None:
    def value(x: float) -> Any:
        return torch.tensor(x) if as_tensor else x

    def record_twice(trainer: Any) -> None:
        trainer.record_metric("m", value(2.0), namespace="test", merge_strategy=strategy)
        trainer.record_metric("m", value(6.0), namespace="test", merge_strategy=strategy)
        seen = trainer.get_metric("m", namespace="test")
        assert isinstance(seen, torch.Tensor) and seen.item() == expected

    rec = Recorder()
    fit_with(
        tmp_path, rec, AtStep(step_to_act=2, action=record_twice), max_duration=Duration.steps(3)
    )
    assert rec.logged[2]["test/m"] == expected
    assert "test/m" not in rec.logged[1] and "test/m" not in rec.logged[3]


def test_changing_a_metrics_reduce_type_is_an_error(tmp_path: Any) -> None:
    def flip(trainer: Any) -> None:
        trainer.record_metric("train/CE loss", 1.0, ReduceType.max)

    with pytest.raises(MetricError, match="reduce_type"):
        fit_with(tmp_path, AtStep(step_to_act=2, action=flip), max_duration=Duration.steps(3))


def test_non_scalar_metric_is_rejected() -> None:
    with pytest.raises(MetricError, match="scalar"):
        MetricBuffer().record(1, "m", torch.ones(3))


def test_metrics_are_collected_once_per_interval(tmp_path: Any, monkeypatch: Any) -> None:
    collects: list[int] = []
    original = MetricBuffer.collect

    def counting_collect(self: MetricBuffer) -> Any:
        collects.append(len(self))
        return original(self)

    monkeypatch.setattr(MetricBuffer, "collect", counting_collect)
    rec = Recorder()
    fit_with(tmp_path, rec, max_duration=Duration.steps(12), metrics_collect_interval=5)
    assert collects == [5, 5, 2]  # steps 1-5, 6-10, and the rest at the end
    assert sorted(rec.logged) == list(range(1, 13))
    # post_log_metrics closes each collection's log_metrics calls, the short last one too.
    logging_calls = [c for c in rec.calls if c in ("log_metrics", "post_log_metrics")]
    collection = ["log_metrics"] * 5 + ["post_log_metrics"]
    assert logging_calls == collection * 2 + ["log_metrics"] * 2 + ["post_log_metrics"]
    losses = rec.losses()
    assert losses[-1] < losses[0]


def test_one_rank_logs_recorded_values_exactly_for_every_reduce_type(tmp_path: Any) -> None:
    # 1e200 ** 2 overflows: an l2 norm over one rank is the value, not sqrt(value**2) = inf.
    recorded = {"sum": 0.1, "mean": 1 / 3, "max": -2.5, "l2_norm": 1e200, "none": 7.25}

    @dataclass
    class RecordAll(Callback):
        def post_train_batch(self) -> None:
            for kind, value in recorded.items():
                reduce_type = None if kind == "none" else ReduceType(kind)
                self.trainer.record_metric(kind, value, reduce_type, namespace="t")
                tensor = torch.tensor(value, dtype=torch.float64)
                self.trainer.record_metric(kind, tensor, reduce_type, namespace="tensor")

    rec = Recorder()
    fit_with(tmp_path, RecordAll(), rec, max_duration=Duration.steps(2))
    for metrics in rec.logged.values():
        assert {k: metrics[f"t/{k}"] for k in recorded} == recorded
        # Tensors are gathered as float32, so they match at float32 precision.
        assert metrics["tensor/mean"] == pytest.approx(1 / 3, rel=1e-7)
        assert metrics["tensor/max"] == -2.5


def test_metric_recorded_as_tensor_stays_a_tensor_until_collected(tmp_path: Any) -> None:
    seen: list[Any] = []

    @dataclass
    class Inspect(Callback):
        def post_train_batch(self) -> None:
            seen.append(self.trainer.get_metric("CE loss", namespace="train"))

    fit_with(tmp_path, Inspect(), max_duration=Duration.steps(2))
    assert all(isinstance(t, torch.Tensor) and t.ndim == 0 and not t.requires_grad for t in seen)


# -- bookkeeping -------------------------------------------------------------------------------


def failing_op() -> None:
    raise RuntimeError("bookkeeping exploded")


def test_bookkeeping_error_is_reraised_in_the_loop_with_its_traceback(tmp_path: Any) -> None:
    def submit(trainer: Any) -> None:
        trainer.run_bookkeeping_op(failing_op, op_name="explode")

    rec = Recorder()
    with pytest.raises(RuntimeError, match="bookkeeping exploded") as info:
        fit_with(
            tmp_path, rec, AtStep(step_to_act=2, action=submit), max_duration=Duration.steps(50)
        )
    assert any(entry.name == "failing_op" for entry in info.traceback)
    assert any("explode" in note for note in getattr(info.value, "__notes__", ["explode"]))
    assert rec.calls[-2:] == ["on_error:RuntimeError", "close"]


def test_slow_bookkeeping_op_warns(tmp_path: Any, caplog: Any) -> None:
    def submit(trainer: Any) -> None:
        trainer.run_bookkeeping_op(time.sleep, 1.5, op_name="sleepy", soft_timeout=1)

    with caplog.at_level(logging.WARNING, logger="olmolike"):
        fit_with(tmp_path, AtStep(step_to_act=1, action=submit), max_duration=Duration.steps(2))
    assert any(
        "sleepy" in r.getMessage() and "bookkeeping_soft_timeout" in r.getMessage()
        for r in caplog.records
    )


def test_bookkeeping_callbacks_run_on_the_training_thread_in_order(tmp_path: Any) -> None:
    import threading

    results: list[tuple[int, str]] = []

    def submit(trainer: Any) -> None:
        for i in range(5):
            trainer.run_bookkeeping_op(
                time.sleep,
                0.05 * (5 - i),
                distributed=False,
                cb=lambda _, i=i: results.append((i, threading.current_thread().name)),
            )

    fit_with(tmp_path, AtStep(step_to_act=1, action=submit), max_duration=Duration.steps(3))
    assert [i for i, _ in results] == list(range(5))
    assert {name for _, name in results} == {threading.main_thread().name}


# -- cancel ------------------------------------------------------------------------------------


def test_cancel_run_stops_gracefully_after_the_current_step(tmp_path: Any, caplog: Any) -> None:
    rec = Recorder()
    with caplog.at_level(logging.WARNING, logger="olmolike"):
        trainer = fit_with(
            tmp_path,
            rec,
            AtStep(step_to_act=4, action=lambda t: t.cancel_run("enough for today")),
            max_duration=Duration.steps(50),
        )
    assert trainer.global_step == 4 and trainer.is_canceled
    assert rec.calls[-2:] == ["post_train", "close"]
    assert sorted(rec.logged) == [1, 2, 3, 4]
    assert any(
        "enough for today" in r.getMessage() and "canceled" in r.getMessage()
        for r in caplog.records
    )


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_cancels_gracefully_then_exits_non_zero(tmp_path: Any, signum: int) -> None:
    before = signal.getsignal(signum)
    rec = Recorder()
    # Saved and closed first; then Ctrl-C is a KeyboardInterrupt (exit 130), SIGTERM exit 143.
    expected = KeyboardInterrupt if signum == signal.SIGINT else SystemExit
    with pytest.raises(expected) as raised:
        fit_with(
            tmp_path,
            rec,
            AtStep(step_to_act=3, action=lambda _: os.kill(os.getpid(), signum)),
            max_duration=Duration.steps(50),
        )
    assert rec.calls[-2:] == ["post_train", "close"]
    assert "on_error" not in " ".join(rec.calls)
    assert signal.getsignal(signum) is before  # handlers are restored after fit()
    if signum == signal.SIGINT:
        assert str(raised.value).startswith("run canceled at step 3 (received SIGINT); ")
        assert f"the last complete checkpoint is {tmp_path}/step3" in str(raised.value)
    else:
        assert raised.value.code == 143


def test_second_sigint_during_a_save_says_what_it_interrupted(tmp_path: Any) -> None:
    trainer = build_trainer(tmp_path, max_duration=Duration.steps(50))
    state_dict_to_save = trainer.train_module.state_dict_to_save

    def interrupted_save() -> Any:
        if trainer.is_canceled:  # the second Ctrl-C, while the final checkpoint is written
            os.kill(os.getpid(), signal.SIGINT)
        return state_dict_to_save()

    trainer.train_module.state_dict_to_save = interrupted_save
    first = AtStep(step_to_act=2, action=lambda _: os.kill(os.getpid(), signal.SIGINT))
    trainer.add_callback("first_sigint", first)
    with pytest.raises(KeyboardInterrupt) as raised:
        trainer.fit()
    message = str(raised.value)  # the line the exception hook prints
    assert message.startswith("second SIGINT during a checkpoint save at step 2 (left incomplete)")
    assert f"the last complete checkpoint is {tmp_path}/step0: run the same" in message


def test_second_sigint_aborts(tmp_path: Any) -> None:
    def interrupt_twice(_: Any) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)

    rec = Recorder()
    with pytest.raises(KeyboardInterrupt):
        fit_with(
            tmp_path,
            rec,
            AtStep(step_to_act=2, action=interrupt_twice),
            max_duration=Duration.steps(50),
        )
    assert "on_error:KeyboardInterrupt" in rec.calls


# -- state -------------------------------------------------------------------------------------


def test_state_dicts_resume_the_loop_exactly(tmp_path: Any) -> None:
    """Trainer + train module state at step k continue to the same losses and weights."""
    full = Recorder()
    reference = fit_with(tmp_path / "full", full, max_duration=Duration.steps(10), num_instances=48)

    snapshot: dict[str, Any] = {}

    def take_snapshot(trainer: Any) -> None:
        snapshot["trainer"] = copy.deepcopy(trainer.state_dict())
        snapshot["module"] = copy.deepcopy(trainer.train_module.state_dict())
        trainer.cancel_run("stop at 4", no_sync=True)

    @dataclass
    class SnapshotAfterStep(Callback):
        def post_step(self) -> None:
            if self.trainer.global_step == 4:
                take_snapshot(self.trainer)

    fit_with(
        tmp_path / "first", SnapshotAfterStep(), max_duration=Duration.steps(10), num_instances=48
    )
    resumed = build_trainer(tmp_path / "second", max_duration=Duration.steps(10), num_instances=48)
    torch.manual_seed(1234)  # disturb the global RNG: the resumed run must not depend on it
    resumed.train_module.load_state_dict(snapshot["module"])
    resumed.load_state_dict(snapshot["trainer"])
    rec = Recorder()
    resumed.add_callback("rec", rec)
    resumed.fit()
    assert resumed.global_step == 10 and resumed.epoch == reference.epoch
    assert rec.losses() == full.losses()[4:]
    for a, b in zip(
        resumed.train_module.model.parameters(), reference.train_module.model.parameters()
    ):  # type: ignore[attr-defined]
        assert torch.equal(a, b)


def test_micro_batches_do_not_change_the_gradient(tmp_path: Any) -> None:
    """The loss is normalised over the whole batch, also when micro-batches hold different
    numbers of labelled tokens (a per-micro-batch mean would weight them wrongly)."""
    generator = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, 64, (8, SEQ_LEN), generator=generator)
    labels = torch.randint(0, 64, (8, SEQ_LEN), generator=generator)
    labels[:2, 3:] = -100  # the first micro-batch (of 4) has far fewer labelled tokens
    labels[5, :] = -100
    grads = []
    for micro_batch_instances in (8, 2):
        trainer = build_trainer(
            tmp_path / str(micro_batch_instances),
            micro_batch_instances=micro_batch_instances,
            max_duration=Duration.steps(1),
        )
        module = trainer.train_module
        module.train_batch({"input_ids": input_ids, "labels": labels}, dry_run=True)
        grads.append([p.grad.clone() for p in module.model.parameters()])  # type: ignore[attr-defined]
    for one, four in zip(*grads):
        torch.testing.assert_close(one, four, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("micro_batch_instances", [8, 2])
def test_a_batch_with_every_label_ignored_trains_on_nothing(
    tmp_path: Any, micro_batch_instances: int
) -> None:
    """Zero loss and zero gradients, not the NaN of a mean over no tokens."""
    trainer = build_trainer(
        tmp_path, micro_batch_instances=micro_batch_instances, max_duration=Duration.steps(1)
    )
    trainer.global_step = 1
    trainer._step_results.metrics.begin_step(1)
    input_ids = torch.randint(0, 64, (8, SEQ_LEN))
    module = trainer.train_module
    module.train_batch({"input_ids": input_ids, "labels": torch.full_like(input_ids, -100)})
    assert trainer.get_metric("train/CE loss") == 0.0
    for p in module.model.parameters():  # type: ignore[attr-defined]
        assert p.grad is not None and torch.equal(p.grad, torch.zeros_like(p.grad))


@pytest.mark.parametrize("micro_batch_instances", [8, 2])
def test_a_diverged_model_reports_a_nan_loss(tmp_path: Any, micro_batch_instances: int) -> None:
    trainer = build_trainer(
        tmp_path, micro_batch_instances=micro_batch_instances, max_duration=Duration.steps(1)
    )
    trainer.global_step = 1
    trainer._step_results.metrics.begin_step(1)
    module = trainer.train_module
    with torch.no_grad():
        next(module.model.parameters()).fill_(float("nan"))  # type: ignore[attr-defined]
    module.train_batch({"input_ids": torch.randint(0, 64, (8, SEQ_LEN))})
    loss = trainer.get_metric("train/CE loss")
    assert loss is not None and torch.isnan(loss)


def test_trainer_losses_do_not_depend_on_micro_batches(tmp_path: Any) -> None:
    one, four = Recorder(), Recorder()
    fit_with(tmp_path / "one", one, max_duration=Duration.steps(4))
    fit_with(tmp_path / "four", four, max_duration=Duration.steps(4), micro_batch_instances=2)
    assert one.losses() == pytest.approx(four.losses(), rel=1e-4)


def test_microbatch_size_must_divide_rank_batch(tmp_path: Any) -> None:
    with pytest.raises(ConfigurationError, match="rank_microbatch_size"):
        build_trainer(tmp_path, micro_batch_instances=3, max_duration=Duration.steps(1))


def test_petaflops_accumulate(tmp_path: Any) -> None:
    trainer = fit_with(tmp_path, max_duration=Duration.steps(3))
    params = sum(p.numel() for p in trainer.train_module.model.parameters())  # type: ignore[attr-defined]
    assert trainer.global_train_petaflops == pytest.approx(3 * 6 * params * 8 * SEQ_LEN / 1e15)


# -- files -------------------------------------------------------------------------------------


def test_write_file_and_persist_working_file(tmp_path: Any) -> None:
    trainer = build_trainer(tmp_path / "save", max_duration=Duration.steps(1))
    path = trainer.write_file("notes/hello.txt", "hi")
    assert Path(path).read_text() == "hi"
    with pytest.raises(FileExistsError, match="save_overwrite"):
        trainer.write_file("notes/hello.txt", "again")
    (trainer.work_dir / "trace.json").write_text("{}")
    assert trainer.persist_working_file("trace.json") == str(tmp_path / "save" / "trace.json")

    remote = build_trainer(
        "memory://bucket/run", max_duration=Duration.steps(1), work_dir=str(tmp_path / "work")
    )
    (remote.work_dir / "sub").mkdir(parents=True)
    (remote.work_dir / "sub" / "a.txt").write_text("a")
    (remote.work_dir / "sub" / "b.txt").write_text("b")
    assert remote.persist_working_subdir("sub") == "memory://bucket/run/sub"
    import fsspec

    fs = fsspec.filesystem("memory")
    assert fs.cat("/bucket/run/sub/b.txt") == b"b"
    assert remote.write_file("x.txt", b"bytes") == "memory://bucket/run/x.txt"


def test_callback_settings_are_validated_at_construction() -> None:
    from olmolike.train import TrainerConfig
    from olmolike.train.callbacks import ConsoleLoggerCallback

    with pytest.raises(ConfigurationError, match="log_interval"):
        ConsoleLoggerCallback(log_interval=0)
    with pytest.raises(ConfigurationError, match=r"callbacks\.log\.log_interval"):
        TrainerConfig(save_folder="x").merge(
            ["--callbacks.log={_CLASS_: console_logger, log_interval: 0}"]
        )


def test_user_callback_named_console_logger_is_kept(tmp_path: Any) -> None:
    mine = Recorder()
    trainer = build_trainer(
        tmp_path, max_duration=Duration.steps(1), callbacks={"console_logger": mine}
    )
    assert trainer.callbacks["console_logger"] is mine


def test_int32_tokens_train(tmp_path: Any) -> None:
    trainer = build_trainer(tmp_path, max_duration=Duration.steps(2))
    loader = trainer.data_loader
    assert isinstance(loader, TokenTensorDataLoader)
    loader.instances = loader.instances.to(torch.int32)
    loader._fingerprint = None
    trainer.fit()
    assert trainer.global_step == 2


def test_microbatch_size_must_be_whole_sequences(tmp_path: Any) -> None:
    trainer = build_trainer(tmp_path, max_duration=Duration.steps(2))
    trainer.train_module.rank_microbatch_size = SEQ_LEN * 2 + SEQ_LEN // 2  # type: ignore[attr-defined]
    with pytest.raises(ConfigurationError, match="multiple of the sequence length"):
        trainer.fit()


def test_sigint_after_a_programmatic_cancel_is_still_graceful(tmp_path: Any) -> None:
    def cancel_then_interrupt(trainer: Any) -> None:
        trainer.cancel_run("done early")
        os.kill(os.getpid(), signal.SIGINT)

    trainer = fit_with(
        tmp_path,
        AtStep(step_to_act=2, action=cancel_then_interrupt),
        max_duration=Duration.steps(9),
    )
    assert trainer.global_step == 2 and trainer.is_canceled


def test_rejected_first_record_does_not_fix_the_reduce_type() -> None:
    buffer = MetricBuffer()
    with pytest.raises(MetricError):
        buffer.record(1, "m", torch.ones(2), ReduceType.max)
    buffer.record(1, "m", 1.0, ReduceType.sum)


def test_persist_checks_file_or_directory(tmp_path: Any) -> None:
    trainer = build_trainer(
        tmp_path / "save", max_duration=Duration.steps(1), work_dir=str(tmp_path / "w")
    )
    (trainer.work_dir / "d").mkdir()
    (trainer.work_dir / "f").write_text("x")
    with pytest.raises(FileNotFoundError):
        trainer.persist_working_file("d")
    with pytest.raises(NotADirectoryError):
        trainer.persist_working_subdir("f")


def test_one_cpu_process_runs_bookkeeping_inline_unless_asked(tmp_path: Path) -> None:
    import threading

    seen: list[str] = []

    @dataclass
    class ThreadProbe(Callback):
        def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
            del step, metrics
            seen.append(threading.current_thread().name)

    default = build_trainer(tmp_path / "a", max_duration=Duration.steps(2), device="cpu")
    assert default.async_bookkeeping is False
    op_threads: list[str] = []
    default.run_bookkeeping_op(lambda: op_threads.append(threading.current_thread().name))
    assert op_threads == [threading.current_thread().name]

    asked = build_trainer(
        tmp_path / "b", max_duration=Duration.steps(2), device="cpu", async_bookkeeping=True
    )
    asked.add_callback("probe", ThreadProbe())
    asked.run_bookkeeping_op(lambda: op_threads.append(threading.current_thread().name))
    asked.fit()
    assert asked.async_bookkeeping is True
    assert op_threads[1] != threading.current_thread().name
    assert seen and all(name == threading.current_thread().name for name in seen)


def test_every_trainer_config_field_of_the_trainers_reaches_it(tmp_path: Path) -> None:
    from dataclasses import fields

    from olmolike.train import LoadStrategy, Trainer, TrainerConfig

    values: dict[str, Any] = {
        "max_duration": Duration.steps(7),
        "save_overwrite": True,
        "load_path": str(tmp_path / "elsewhere"),
        "load_strategy": LoadStrategy.never,
        "load_trainer_state": False,
        "load_optim_state": False,
        "metrics_collect_interval": 3,
        "cancel_check_interval": 4,
        "hard_stop": Duration.steps(5),
        "async_bookkeeping": False,
        "bookkeeping_soft_timeout": 12,
        "train_timeout_seconds": 99,
        "no_checkpoints": True,
        "no_evals": True,
    }
    trainer = build_trainer(tmp_path / "run", **values)
    assert {name: getattr(trainer, name) for name in values} == values
    assert trainer.save_folder == str(tmp_path / "run")
    built = {"save_folder", "work_dir", "device", "checkpointer", "callbacks"}
    copied = {"steps_to_skip", "checkpoints_to_eval"}
    trainers = {f.name for f in fields(Trainer) if f.init}
    assert {f.name for f in fields(TrainerConfig) if f.name in trainers} == {
        *values,
        *built,
        *copied,
    }
