"""GPUMemoryMonitorCallback: per-interval peaks on CUDA, a quiet no-op elsewhere."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from testutils import build_trainer

from olmolike.exceptions import ConfigurationError
from olmolike.train import Callback, Duration, Trainer
from olmolike.train.callbacks import gpu_memory_monitor
from olmolike.train.callbacks.gpu_memory_monitor import GPUMemoryMonitorCallback

GIB = 1024**3
TOTAL = 16 * GIB
PEAK_BEFORE_TRAINING = 10 * GIB
PEAK_IN_STEP = {1: 3 * GIB, 2: 1 * GIB, 3: 2 * GIB, 4: 1 * GIB}


@dataclass
class FakeCudaCounters(Callback):
    """Stands in for the CUDA allocator's peak counters; each step allocates its own peak."""

    allocated: int = PEAK_BEFORE_TRAINING
    logged: dict[int, dict[str, float]] = field(default_factory=dict)

    priority = 10

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        cuda = gpu_memory_monitor.torch.cuda
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda device: self.allocated)
        monkeypatch.setattr(cuda, "max_memory_reserved", lambda device: 2 * self.allocated)
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda device: self._reset())
        props = type("Props", (), {"total_memory": TOTAL})()
        monkeypatch.setattr(cuda, "get_device_properties", lambda device: props)
        monkeypatch.setattr(
            GPUMemoryMonitorCallback, "_cuda_device", lambda cb: torch.device("cuda", 0)
        )

    def _reset(self) -> None:
        self.allocated = 0

    def pre_step(self, batch: dict[str, Any]) -> None:
        del batch
        self.allocated = max(self.allocated, PEAK_IN_STEP[self.step])

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.logged[step] = {k: v for k, v in metrics.items() if k.startswith("system/")}


def fit(
    tmp_path: Path, monitor: GPUMemoryMonitorCallback, *probes: Callback, **cfg: Any
) -> Trainer:
    trainer = build_trainer(
        tmp_path,
        max_duration=Duration.steps(4),
        no_checkpoints=True,
        callbacks={"mem": monitor, **{f"probe{i}": p for i, p in enumerate(probes)}},
        **cfg,
    )
    trainer.fit()
    return trainer


@pytest.mark.parametrize("settings", [{"interval": 2}, {}])
def test_records_each_intervals_own_peak(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, settings: dict[str, Any]
) -> None:
    counters = FakeCudaCounters()
    counters.install(monkeypatch)
    collect = 1 if settings else 2  # without an interval, the monitor follows this one
    fit(tmp_path, GPUMemoryMonitorCallback(**settings), counters, metrics_collect_interval=collect)
    assert counters.logged[1] == {} and counters.logged[3] == {}
    # Step 2 saw step 1's 3 GiB, not the pre-training 10 GiB; step 4 saw only steps 3-4.
    assert counters.logged[2] == {
        "system/GPU max allocated (GiB)": 3.0,
        "system/GPU max reserved (GiB)": 6.0,
        "system/GPU max reserved (%)": pytest.approx(100 * 6 / 16),
    }
    assert counters.logged[4]["system/GPU max allocated (GiB)"] == 2.0


@dataclass
class Keep(Callback):
    logged: dict[int, dict[str, float]] = field(default_factory=dict)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.logged[step] = metrics


def test_on_cpu_records_nothing_and_says_so_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keep, monitor = Keep(), GPUMemoryMonitorCallback(interval=1)
    with caplog.at_level(logging.INFO, logger=gpu_memory_monitor.__name__):
        fit(tmp_path, monitor, keep)
        monitor.pre_train()
    assert len(keep.logged) == 4
    assert not any(name.startswith("system/") for m in keep.logged.values() for name in m)
    said = [r for r in caplog.records if r.name == gpu_memory_monitor.__name__]
    assert len(said) == 1 and "nothing to report" in said[0].getMessage()


def test_rejects_a_zero_interval() -> None:
    with pytest.raises(ConfigurationError, match="interval"):
        GPUMemoryMonitorCallback(interval=0)


@dataclass
class ModelToDevice(Callback):
    def post_attach(self) -> None:
        self.trainer.train_module.model.to(self.trainer.device)  # type: ignore[attr-defined]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_cuda_peaks(tmp_path: Path) -> None:
    keep = Keep()
    fit(tmp_path, GPUMemoryMonitorCallback(interval=2), ModelToDevice(), keep, device="cuda")
    metrics = keep.logged[4]
    assert 0 < metrics["system/GPU max allocated (GiB)"] <= metrics["system/GPU max reserved (GiB)"]
    assert 0 < metrics["system/GPU max reserved (%)"] < 100
