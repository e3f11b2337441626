"""SpeedMonitorCallback: which steps are timed, what counts in a step, and the derived rates."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from testutils import SEQ_LEN, build_trainer, run_distributed_test

from olmolike.exceptions import ConfigurationError
from olmolike.train import Callback, Duration, StepSkipRange, Trainer
from olmolike.train.callbacks import speed_monitor
from olmolike.train.callbacks.speed_monitor import SpeedMonitorCallback

INSTANCES = 8
RANK_TOKENS = INSTANCES * SEQ_LEN
STEP_SECONDS = 0.5
PAUSE_SECONDS = 10.0
PAUSE_STEP = 3


@dataclass
class FakeClock(Callback):
    """Advances a fake clock: ``STEP_SECONDS`` per step, plus a pause in one step's post_step.

    Its priority puts its post_step before the monitor's, like a checkpointer's save.
    """

    now: float = 100.0
    logged: dict[int, dict[str, float]] = field(default_factory=dict)

    priority = 10

    def perf_counter(self) -> float:
        return self.now

    def pre_step(self, batch: dict[str, Any]) -> None:
        del batch
        self.now += STEP_SECONDS

    def post_step(self) -> None:
        if self.step == PAUSE_STEP:
            self.now += PAUSE_SECONDS

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.logged[step] = {k: v for k, v in metrics.items() if k.startswith("throughput/")}


def fit_with_clock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, steps: int = 5, **config: Any
) -> tuple[Trainer, FakeClock]:
    clock = FakeClock()
    monkeypatch.setattr(speed_monitor, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    callbacks = {"clock": clock, **config.pop("callbacks", {})}
    callbacks.setdefault("speed", SpeedMonitorCallback(device_peak_flops=1e12))
    trainer = build_trainer(
        tmp_path,
        instances_per_batch=INSTANCES,
        max_duration=Duration.steps(steps),
        metrics_collect_interval=1,
        no_checkpoints=True,
        callbacks=callbacks,
        **config,
    )
    trainer.fit()
    return trainer, clock


def test_rates_follow_the_step_interval_and_skip_the_first_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer, clock = fit_with_clock(tmp_path, monkeypatch)
    assert clock.logged[1] == {}
    flops_per_token = trainer.train_module.num_flops_per_token(SEQ_LEN)
    assert flops_per_token is not None
    for step in (2, 4, 5):
        metrics = clock.logged[step]
        assert metrics["throughput/device/BPS"] == pytest.approx(1 / STEP_SECONDS)
        assert metrics["throughput/device/TPS"] == pytest.approx(RANK_TOKENS / STEP_SECONDS)
        assert metrics["throughput/TPS"] == pytest.approx(RANK_TOKENS / STEP_SECONDS)
        assert metrics["throughput/total tokens"] == step * RANK_TOKENS
        flops = flops_per_token * RANK_TOKENS / STEP_SECONDS
        assert metrics["throughput/device/FLOPS"] == pytest.approx(flops)
        assert metrics["throughput/device/MFU"] == pytest.approx(100 * flops / 1e12)


def test_other_callbacks_time_counts_in_the_step_and_the_average(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, clock = fit_with_clock(tmp_path, monkeypatch)
    paused = clock.logged[PAUSE_STEP]
    assert paused["throughput/device/BPS"] == pytest.approx(1 / (STEP_SECONDS + PAUSE_SECONDS))
    # Steps 2..5 took 4 x STEP_SECONDS plus the pause, for 4 batches.
    average = 4 * RANK_TOKENS / (4 * STEP_SECONDS + PAUSE_SECONDS)
    assert clock.logged[5]["throughput/device/TPS (avg)"] == pytest.approx(average)
    assert clock.logged[2]["throughput/device/TPS (avg)"] == pytest.approx(
        RANK_TOKENS / STEP_SECONDS
    )


def test_skipped_steps_are_not_timed_and_the_next_step_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, clock = fit_with_clock(tmp_path, monkeypatch, steps=6, steps_to_skip=[StepSkipRange(4, 5)])
    assert clock.logged[4] == {}
    assert set(clock.logged[5]) == set(clock.logged[6])
    assert clock.logged[5]["throughput/device/BPS"] == pytest.approx(1 / STEP_SECONDS)


def test_no_flops_or_mfu_without_a_flop_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    @dataclass
    class NoFlopCount(Callback):
        def post_attach(self) -> None:
            self.trainer.train_module.num_flops_per_token = lambda seq_len: None  # type: ignore[method-assign]

    _, clock = fit_with_clock(tmp_path, monkeypatch, steps=3, callbacks={"nf": NoFlopCount()})
    assert set(clock.logged[3]) == {
        "throughput/device/TPS",
        "throughput/device/TPS (avg)",
        "throughput/TPS",
        "throughput/device/BPS",
        "throughput/total tokens",
    }


def test_cpu_without_a_peak_reports_flops_but_no_mfu_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(speed_monitor, "_MFU_NOTED", set())
    with caplog.at_level(logging.DEBUG, logger=speed_monitor.__name__):
        _, clock = fit_with_clock(
            tmp_path, monkeypatch, steps=3, callbacks={"speed": SpeedMonitorCallback()}
        )
    assert "throughput/device/FLOPS" in clock.logged[3]
    assert "throughput/device/MFU" not in clock.logged[3]
    assert "set device_peak_flops" in caplog.text


def test_built_from_config_overrides(tmp_path: Path) -> None:
    trainer = build_trainer(
        tmp_path,
        max_duration=Duration.steps(1),
        overrides=("--callbacks={speed: {_CLASS_: speed_monitor, device_peak_flops: 2e12}}",),
    )
    callback = trainer.callbacks["speed"]
    assert isinstance(callback, SpeedMonitorCallback)
    assert callback.device_peak_flops == 2e12


@pytest.mark.parametrize(
    ("settings", "path"),
    [({"device_peak_flops": 0.0}, "device_peak_flops"), ({"dtype": "fp8"}, "dtype")],
)
def test_rejects_impossible_settings(settings: dict[str, Any], path: str) -> None:
    with pytest.raises(ConfigurationError, match=path):
        SpeedMonitorCallback(**settings)


@dataclass
class Keep(Callback):
    logged: dict[int, dict[str, float]] = field(default_factory=dict)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.logged[step] = metrics


def two_rank_worker(save_folder: str) -> dict[int, dict[str, float]]:
    keep = Keep()
    trainer = build_trainer(
        save_folder,
        max_duration=Duration.steps(3),
        metrics_collect_interval=1,
        no_checkpoints=True,
        callbacks={"speed": SpeedMonitorCallback(), "keep": keep},
    )
    trainer.fit()
    return keep.logged


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_global_tps_sums_the_ranks_per_device_rates(tmp_path: Path) -> None:
    rank0, _ = run_distributed_test(two_rank_worker, args=(str(tmp_path),))
    for step in (2, 3):
        metrics = rank0[step]
        assert metrics["throughput/TPS"] == pytest.approx(2 * metrics["throughput/device/TPS"])
        assert metrics["throughput/total tokens"] == step * RANK_TOKENS


def test_the_mfu_note_is_logged_once_at_debug_on_cpu(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(speed_monitor, "_MFU_NOTED", set())
    caplog.set_level(logging.DEBUG, logger=speed_monitor.__name__)
    for run in ("a", "b"):
        callbacks = {"speed": SpeedMonitorCallback()}
        build_trainer(
            tmp_path / run, max_duration=Duration.steps(1), no_checkpoints=True, callbacks=callbacks
        ).fit()
    notes = [r for r in caplog.records if "MFU is not reported" in r.getMessage()]
    assert [r.levelno for r in notes] == [logging.DEBUG]
