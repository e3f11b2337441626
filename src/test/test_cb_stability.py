"""StabilityMonitorCallback: spikes and non-finite values under each policy; checkpoints stay good."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar
from unittest.mock import Mock

import pytest
import torch
from testutils import build_trainer

from olmolike.exceptions import ConfigurationError
from olmolike.train import Callback, Duration
from olmolike.train.callbacks.checkpointer import CheckpointerCallback
from olmolike.train.callbacks.stability import (
    SKIPPED_METRIC,
    StabilityMonitorCallback,
    StabilityPolicy,
    _DeviceRunningStats,
    _RunningStats,
)
from olmolike.train.checkpoint import Checkpointer


@dataclass
class FakeLoss(Callback):
    """Records ``values[step - 1]`` as a metric the monitor can watch."""

    values: list[float] = field(default_factory=list)

    def post_step(self) -> None:
        self.trainer.record_metric("fake", self.values[self.trainer.global_step - 1])


@dataclass
class Poison(Callback):
    """Multiplies every gradient by ``factor`` at ``step``, before the monitor sees them."""

    step_to_poison: int = 3
    factor: float = float("nan")
    logged: dict[int, dict[str, float]] = field(default_factory=dict)

    priority: ClassVar[int] = 3

    def pre_optim_step(self) -> None:
        if self.trainer.global_step == self.step_to_poison:
            for p in self.trainer.train_module.model.parameters():  # type: ignore[attr-defined]
                p.grad.mul_(self.factor)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.logged[step] = metrics


def fit(folder: Path, *callbacks: Callback, steps: int, **kwargs: Any) -> Any:
    kwargs.setdefault("no_checkpoints", True)
    trainer = build_trainer(
        folder,
        num_instances=16,
        instances_per_batch=2,
        max_duration=Duration.steps(steps),
        callbacks={f"cb{i}": cb for i, cb in enumerate(callbacks)},
        **kwargs,
    )
    trainer.fit()
    return trainer


def params_finite(trainer: Any) -> bool:
    return all(torch.isfinite(p).all() for p in trainer.train_module.model.parameters())


def test_warn_reports_a_spike_and_keeps_training(tmp_path: Path, caplog: Any) -> None:
    values = [2.0, 2.1, 1.9, 2.0, 2.05, 1.95, 9.0, 2.0]
    monitor = StabilityMonitorCallback(loss_metric="fake", window=5, warmup_steps=4)
    with caplog.at_level(logging.WARNING, logger="olmolike"):
        trainer = fit(tmp_path, FakeLoss(values=values), monitor, steps=8)
    assert trainer.global_step == 8 and not trainer.is_canceled
    spikes = [r.getMessage() for r in caplog.records if "spike" in r.getMessage()]
    assert len(spikes) == 1 and "step 7" in spikes[0]


def test_spikes_are_not_judged_during_warmup(tmp_path: Path) -> None:
    monitor = StabilityMonitorCallback(
        loss_metric="fake", window=5, warmup_steps=4, policy=StabilityPolicy.stop
    )
    trainer = fit(tmp_path, FakeLoss(values=[2.0, 2.0, 50.0, 2.0, 2.0]), monitor, steps=5)
    assert not trainer.is_canceled


def test_stop_cancels_on_a_loss_spike(tmp_path: Path) -> None:
    values = [2.0, 2.1, 1.9, 2.0, 2.05, 9.0, 2.0, 2.0]
    monitor = StabilityMonitorCallback(
        loss_metric="fake",
        window=5,
        warmup_steps=4,
        policy="stop",  # type: ignore[arg-type]
    )
    trainer = fit(tmp_path, FakeLoss(values=values), monitor, steps=8, metrics_collect_interval=1)
    # Step 6's metrics reach the callbacks at the end of step 7 (the agreed delivery step).
    assert trainer.global_step == 7 and trainer.is_canceled
    assert "loss spike: 9" in (trainer._cancel.reason or "")


def test_stop_on_nan_keeps_the_last_good_checkpoint(tmp_path: Path) -> None:
    """The NaN at step 3 is not yet reported at step 4 (collect interval 5), but the guard
    sees it before the step-4 save: only the good checkpoints (steps 0 and 2) exist afterwards."""
    monitor = StabilityMonitorCallback(policy=StabilityPolicy.stop)
    trainer = fit(
        tmp_path,
        Poison(step_to_poison=3),
        monitor,
        CheckpointerCallback(save_interval=2),
        steps=10,
        no_checkpoints=False,
        metrics_collect_interval=5,
    )
    assert trainer.is_canceled and trainer.global_step == 4
    assert [step for step, _ in Checkpointer.find_checkpoints(str(tmp_path))] == [0, 2]


def test_stop_on_nan_from_metrics_disables_the_final_checkpoint(tmp_path: Path) -> None:
    monitor = StabilityMonitorCallback(policy=StabilityPolicy.stop, guard_checkpoints=False)
    trainer = fit(
        tmp_path,
        Poison(step_to_poison=3),
        monitor,
        CheckpointerCallback(save_interval=100),
        steps=10,
        no_checkpoints=False,
        metrics_collect_interval=1,
    )
    # Step 3's gradient norm is NaN: delivered at the end of step 4, which stops the run there.
    assert trainer.is_canceled and trainer.global_step == 4
    assert list(Checkpointer.find_checkpoints(str(tmp_path))) == [(0, str(tmp_path / "step0"))]


def test_warn_with_a_nan_run_saves_no_corrupt_final_checkpoint(tmp_path: Path) -> None:
    trainer = fit(
        tmp_path,
        Poison(step_to_poison=2),
        StabilityMonitorCallback(),
        CheckpointerCallback(save_interval=100, pre_train_checkpoint=False),
        steps=5,
        no_checkpoints=False,
    )
    assert trainer.global_step == 5 and not trainer.is_canceled
    assert list(Checkpointer.find_checkpoints(str(tmp_path))) == []


@pytest.mark.parametrize("factor", [float("nan"), 1e6])
def test_skip_step_zeroes_bad_gradients_on_the_device(tmp_path: Path, factor: float) -> None:
    poison = Poison(step_to_poison=6, factor=factor)
    monitor = StabilityMonitorCallback(policy=StabilityPolicy.skip_step, window=5, warmup_steps=3)
    trainer = fit(tmp_path, poison, monitor, steps=8, metrics_collect_interval=4)
    assert params_finite(trainer) and not trainer.is_canceled
    skipped = {step: m[SKIPPED_METRIC] for step, m in poison.logged.items()}
    assert skipped == {s: float(s == 6) for s in range(1, 9)}
    assert poison.logged[6]["optim/total grad norm"] == 0.0


def test_without_skipping_nan_gradients_corrupt_the_weights(tmp_path: Path) -> None:
    trainer = fit(tmp_path, Poison(step_to_poison=2), StabilityMonitorCallback(), steps=3)
    assert not params_finite(trainer)


def test_host_and_device_statistics_make_the_same_decisions() -> None:
    """The host judges logged values with floats, skip_step judges on the device: same rules."""
    values = [1.0, 1.1, 0.9, 1.05, 0.95, 9.0, 1.0, 1.02, 0.98, 30.0, 1.01, 1.0]
    host, device = _RunningStats(window=5), _DeviceRunningStats(5, torch.device("cpu"))
    host_spikes, device_spikes = [], []
    for value in values:
        spike = host.is_spike(value, threshold=3.0, warmup=4)
        if not spike:
            host.update(value)
        host_spikes.append(spike)
        x = torch.tensor(value, dtype=torch.float64)
        bad = device.is_spike(x, threshold=3.0, warmup=4)
        device.update(x, ~bad)
        device_spikes.append(bool(bad))
    assert host_spikes == device_spikes
    assert host_spikes.count(True) == 2  # 9.0 and 30.0; the first stays out of the baseline
    assert device.state_dict() == pytest.approx(host.state_dict(), rel=1e-12)


def test_running_statistics_survive_a_resume(tmp_path: Path) -> None:
    values = [2.0, 2.1, 1.9, 2.0, 2.05, 1.95, 9.0]
    first = StabilityMonitorCallback(loss_metric="fake", window=5, warmup_steps=4)
    fit(tmp_path, FakeLoss(values=values), first, steps=7, hard_stop=Duration.steps(6))
    second = StabilityMonitorCallback(loss_metric="fake", window=5, warmup_steps=4)
    second.load_state_dict(first.state_dict())
    assert second.state_dict() == first.state_dict()
    assert second.state_dict()["loss"]["count"] == 6


@pytest.mark.parametrize(
    ("kwargs", "path"),
    [
        ({"window": 0}, "window"),
        ({"warmup_steps": 0}, "warmup_steps"),
        ({"loss_spike_threshold": 0.0}, "loss_spike_threshold"),
        ({"grad_norm_spike_threshold": -1.0}, "grad_norm_spike_threshold"),
    ],
)
def test_bad_settings_are_rejected_at_construction(kwargs: dict[str, Any], path: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        StabilityMonitorCallback(**kwargs)
    assert info.value.path == path


def test_beside_a_stand_in_trainer_it_watches_the_ce_loss() -> None:
    """OLMo-core's own tests build the monitor with a ``Mock`` for a trainer, whose train
    module's ``loss_metric`` is another Mock, not a name: the monitor then watches
    ``train/CE loss``, as it does before it is attached."""
    monitor = StabilityMonitorCallback(window_size=4, rolling_window=4, threshold_std=3.0)
    monitor._trainer = Mock()
    assert monitor.train_loss_metric() == "train/CE loss"
    for step in range(4):
        monitor.pre_log_metrics(step, {"train/CE loss": 2.0 - 0.1 * step})
    metrics = {"train/CE loss": 50.0}
    monitor.pre_log_metrics(4, metrics)
    assert metrics["spike/SpikeScore (total)"] == pytest.approx(1 / 5)
    named = Mock()
    named.train_module.loss_metric = "train/DPO loss"  # a train module that names its loss
    monitor._trainer = named
    assert monitor.train_loss_metric() == "train/DPO loss"
