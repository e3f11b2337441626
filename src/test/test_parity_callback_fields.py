"""OLMo-core's fields on existing callbacks: evaluator schedule and duration, console and
profiler options, garbage collector switch, W&B run name and cancel tags."""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from test_evaluator import (
    StepRecorder,
    build,
    direct_ce,
    eval_instances,
    lm_evaluator,
    trained_model,
    write_eval_data,
)
from testutils import build_trainer

from olmolike.exceptions import ConfigurationError
from olmolike.train import Callback, Duration
from olmolike.train.callbacks import (
    CheckpointerCallback,
    ConsoleLoggerCallback,
    EvaluatorCallback,
    GarbageCollectorCallback,
    LMEvaluatorCallbackConfig,
    ProfilerCallback,
    StabilityMonitorCallback,
    WandBCallback,
)

# -- evaluator -------------------------------------------------------------------------------


def test_evaluator_defaults_match_olmo_core() -> None:
    cb = EvaluatorCallback()
    assert (cb.eval_interval, cb.fixed_steps, cb.eval_on_startup, cb.eval_on_finish) == (
        1000,
        None,
        False,
        False,
    )
    assert (cb.cancel_after_first_eval, cb.eval_duration, cb.log_interval) == (
        False,
        Duration.epochs(1),
        5,
    )


@pytest.mark.parametrize(
    ("settings", "want"),
    [
        ({"eval_interval": None, "fixed_steps": [2, 5]}, [2, 5]),
        ({"eval_interval": 3, "fixed_steps": [1]}, [1, 3, 6]),
        ({"eval_interval": None, "eval_on_finish": True}, [6]),
    ],
)
def test_fixed_steps_and_no_interval(
    tmp_path: Path, settings: dict[str, Any], want: list[int]
) -> None:
    recorder = StepRecorder()
    trainer, _ = build(tmp_path, EvaluatorCallback(evaluators=[recorder], **settings), steps=6)
    trainer.fit()
    assert recorder.steps == want


def test_cancel_after_first_eval_stops_the_run(tmp_path: Path) -> None:
    recorder = StepRecorder()
    evaluator = EvaluatorCallback(
        evaluators=[recorder], eval_interval=2, cancel_after_first_eval=True
    )
    trainer, _ = build(tmp_path, evaluator, steps=6)
    trainer.fit()
    assert recorder.steps == [2] and trainer.global_step == 2 and trainer.is_canceled

    startup = StepRecorder()
    only_eval = EvaluatorCallback(
        evaluators=[startup], eval_on_startup=True, cancel_after_first_eval=True
    )
    trainer, _ = build(tmp_path / "startup", only_eval, steps=6)
    trainer.fit()
    assert startup.steps == [0] and trainer.global_step == 0


@pytest.mark.parametrize(
    ("duration", "instances"),
    [
        (Duration.steps(2), 4),  # 2 batches of 2 instances
        (Duration.tokens(40), 4),  # 32 tokens per batch: 2 batches cover 40 tokens
        (Duration.tokens(32), 2),
        (Duration.epochs(1), 7),
    ],
)
def test_eval_duration_limits_the_data(
    tmp_path: Path, duration: Duration, instances: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="olmolike.train.callbacks.evaluator")
    data = write_eval_data(tmp_path / "eval", 7)
    evaluator = lm_evaluator(data, eval_batch_size=2, eval_duration=duration, log_interval=1)
    trainer, log = build(tmp_path / "run", evaluator)
    trainer.fit()
    want = direct_ce(trained_model(trainer), eval_instances(data)[:instances])
    assert log.ce()[3] == pytest.approx(want, rel=1e-5)
    batches = -(-instances // 2)
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[eval=")]
    assert progress == [f"[eval=lm,step={i}/{batches}]" for i in range(1, batches + 1)]


@pytest.mark.parametrize(
    ("settings", "path"),
    [
        ({"eval_interval": 0}, "eval_interval"),
        ({"fixed_steps": [-1]}, "fixed_steps"),
        ({"log_interval": 0}, "log_interval"),
        ({"eval_duration": Duration.steps(0)}, "eval_duration"),
    ],
)
def test_evaluator_settings_are_checked(settings: dict[str, Any], path: str) -> None:
    with pytest.raises(ConfigurationError, match=path):
        EvaluatorCallback(**settings)


def test_lm_evaluator_fields_round_trip_through_config() -> None:
    from olmolike.train import TrainerConfig

    data = {
        "save_folder": "/s",
        "callbacks": {
            "lm": {
                "_CLASS_": "lm_evaluator",
                "eval_dataset": {"paths": ["x"], "sequence_length": 8},
                "eval_interval": None,
                "fixed_steps": [10, 20],
                "eval_duration": {"value": 100, "unit": "tokens"},
            }
        },
    }
    cb = TrainerConfig.from_dict(data).callbacks["lm"]
    assert isinstance(cb, LMEvaluatorCallbackConfig)
    assert cb.fixed_steps == [10, 20] and cb.eval_duration == Duration.tokens(100)
    config = TrainerConfig(save_folder="/s", callbacks={"lm": cb})
    assert TrainerConfig.from_dict(config.as_config_dict()) == config


# -- console logger, garbage collector, profiler ---------------------------------------------


def test_console_metrics_log_interval(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="olmolike.train.callbacks.console_logger")
    console = ConsoleLoggerCallback(log_interval=1, metrics_log_interval=3)
    build_trainer(
        tmp_path,
        max_duration=Duration.steps(6),
        no_checkpoints=True,
        metrics_collect_interval=1,
        callbacks={"console_logger": console},
    ).fit()
    first_lines = [  # one line per record: "[step=...]" then the metrics and the time to go
        r.getMessage().split()[0] for r in caplog.records if r.name.endswith("console_logger")
    ]
    progress = ["[step=1/6,epoch=1]", "[step=2/6,epoch=1]", "[step=4/6,epoch=1]"]
    assert sorted(first_lines) == sorted(
        [*progress, "[step=5/6,epoch=1]", "[step=3/6]", "[step=6/6]"]
    )
    with pytest.raises(ConfigurationError, match="metrics_log_interval"):
        ConsoleLoggerCallback(metrics_log_interval=0)


@pytest.fixture
def gc_on() -> Iterator[None]:
    gc.enable()
    yield
    gc.enable()


def test_gc_callback_disabled_leaves_gc_alone(tmp_path: Path, gc_on: None) -> None:
    seen: list[bool] = []
    trainer = build_trainer(
        tmp_path,
        max_duration=Duration.steps(2),
        no_checkpoints=True,
        callbacks={"gc": GarbageCollectorCallback(enabled=False)},
    )
    trainer.add_callback("probe", _GcSeen(seen))
    trainer.fit()
    assert seen == [True, True]


def test_gc_collects_after_each_checkpoint_save(
    tmp_path: Path, gc_on: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: calls.append(generation) or 0)
    build_trainer(
        tmp_path,
        max_duration=Duration.steps(4),
        callbacks={
            "gc": GarbageCollectorCallback(gc_interval=1000, generation=0),
            "checkpointer": CheckpointerCallback(save_interval=2),
        },
    ).fit()
    assert calls.count(0) == 3  # after the saves of steps 0, 2 and 4


@dataclass
class _GcSeen(Callback):
    seen: list[bool] = field(default_factory=list)

    def pre_step(self, batch: dict[str, Any]) -> None:
        self.seen.append(gc.isenabled())


@pytest.mark.parametrize(("ranks", "profiles"), [(None, True), ("all", True), ("dp", True)])
def test_profiler_rank_shortcuts(tmp_path: Path, ranks: Any, profiles: bool) -> None:
    profiler = ProfilerCallback(wait=0, warmup=0, active=1, ranks=ranks, with_stack=False)
    build_trainer(
        tmp_path,
        max_duration=Duration.steps(2),
        no_checkpoints=True,
        callbacks={"profiler": profiler},
    ).fit()
    assert bool(profiler.traces) == profiles
    with pytest.raises(ConfigurationError, match="ranks"):
        ProfilerCallback(ranks="some")


def test_profiler_cuda_sync_events_option_is_accepted_on_cpu(tmp_path: Path) -> None:
    profiler = ProfilerCallback(wait=0, warmup=0, active=1, enable_cuda_sync_events=True)
    build_trainer(
        tmp_path, max_duration=Duration.steps(1), no_checkpoints=True, callbacks={"p": profiler}
    ).fit()
    assert len(profiler.traces) == 1


# -- W&B -------------------------------------------------------------------------------------


def test_wandb_name_and_cancel_tags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb", reason="needs the wandb extra")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setattr(WandBCallback, "fetch_tags", lambda self: ["baseline", "Killed"])
    callback = WandBCallback(
        mode="offline", name="parity-run", cancel_tags=["killed"], cancel_check_interval=1
    )
    trainer = build_trainer(
        tmp_path,
        max_duration=Duration.steps(8),
        cancel_check_interval=1,
        no_checkpoints=True,
        callbacks={"wandb": callback},
    )
    trainer.fit()
    assert trainer.is_canceled and trainer.global_step < 8

    assert WandBCallback(cancel_tags=[])._cancel_tags == set()
    assert WandBCallback()._cancel_tags == {"cancel"}
    assert WandBCallback(name="a", run_name="a").name == "a"
    with pytest.raises(ConfigurationError, match="name"):
        WandBCallback(name="a", run_name="b")


# -- stability monitor: OLMo-core's SpikeScore ------------------------------------------------


def _feed(monitor: StabilityMonitorCallback, losses: list[float]) -> list[dict[str, float]]:
    out = []
    for step, loss in enumerate(losses, start=1):
        metrics = {"train/CE loss": loss}
        monitor.pre_log_metrics(step, metrics)
        out.append(metrics)
    return out


def test_spike_score_is_the_rate_of_spikes() -> None:
    monitor = StabilityMonitorCallback(window_size=4, rolling_window=5, threshold_std=3.0)
    logged = _feed(monitor, [1.0, 1.1, 0.9, 1.0, 1.0, 9.0, 1.0, 1.05])
    assert "spike/SpikeScore (total)" not in logged[2]  # fewer than window_size steps
    assert logged[3]["spike/SpikeScore (total)"] == 0.0
    assert "spike/SpikeScore" not in logged[3]  # the rolling window is not full yet
    assert logged[4]["spike/SpikeScore"] == 0.0
    assert logged[5]["spike/SpikeScore"] == pytest.approx(1 / 5)  # step 6 spiked
    assert logged[7]["spike/SpikeScore (total)"] == pytest.approx(1 / 8)
    # A flat history never spikes; the state survives a checkpoint.
    restored = StabilityMonitorCallback(window_size=4, rolling_window=5, threshold_std=3.0)
    restored.load_state_dict(monitor.state_dict())
    assert _feed(restored, [1.0]) == _feed(monitor, [1.0])


def test_spike_score_in_training_and_disabled_monitor(tmp_path: Path) -> None:
    log = _MetricLog()
    monitor = StabilityMonitorCallback(
        window_size=2, rolling_window=3, loss_metric_name="train/CE loss"
    )
    build_trainer(
        tmp_path, max_duration=Duration.steps(4), no_checkpoints=True, metrics_collect_interval=2,
        callbacks={"stability": monitor, "log": log},
    ).fit()  # fmt: skip
    assert "spike/SpikeScore" not in log.metrics[2] and "spike/SpikeScore" in log.metrics[3]
    assert log.metrics[4]["spike/SpikeScore (total)"] == 0.0

    off = _MetricLog()
    disabled = StabilityMonitorCallback(window_size=1, rolling_window=1, enabled=False)
    build_trainer(
        tmp_path / "off", max_duration=Duration.steps(2), no_checkpoints=True,
        metrics_collect_interval=1, callbacks={"stability": disabled, "log": off},
    ).fit()  # fmt: skip
    assert not any(k.startswith("spike/") for m in off.metrics.values() for k in m)
    for settings, path in [
        ({"window_size": 0}, "window_size"),
        ({"threshold_std": 0}, "threshold_std"),
    ]:
        with pytest.raises(ConfigurationError, match=path):
            StabilityMonitorCallback(**settings)


@dataclass
class _MetricLog(Callback):
    metrics: dict[int, dict[str, float]] = field(default_factory=dict)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.metrics[step] = dict(metrics)
