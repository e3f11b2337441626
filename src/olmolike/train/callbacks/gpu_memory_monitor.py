"""Peak accelerator memory per interval, to see how close a run is to running out."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ...exceptions import ConfigurationError
from ..common import ReduceType
from .callback import Callback

__all__ = ["GPUMemoryMonitorCallback"]

log = logging.getLogger(__name__)

_GIB = 1024**3


@dataclass
class GPUMemoryMonitorCallback(Callback, name="gpu_memory_monitor"):
    """Records the peak CUDA memory of each interval under the ``system/`` namespace.

    Every ``interval`` steps it records the highest memory allocated by tensors and reserved
    by PyTorch's caching allocator since the previous record, then resets the peaks so each
    record covers its own interval. The reserved figure is what the device really lost to
    this process, and the one that runs out first; the gap between the two is fragmentation
    and cache. Values are the maximum over ranks, since the fullest device fails first.

    The counters live in host memory, so reading them never synchronizes with the device.
    On a device without CUDA there is nothing to report: it says so once in the log and
    records nothing.

    Metrics: ``system/GPU max allocated (GiB)``, ``system/GPU max reserved (GiB)`` and
    ``system/GPU max reserved (%)`` (of the device's total memory).
    """

    interval: int | None = None
    """Steps between records; by default the trainer's ``metrics_collect_interval``."""

    _device: torch.device | None = field(default=None, init=False, repr=False)
    _every: int = field(default=1, init=False, repr=False)
    _said_idle: bool = field(default=False, init=False, repr=False)

    def validate(self) -> None:
        if self.interval is not None and self.interval < 1:
            raise ConfigurationError(
                f"must be >= 1, or None to follow metrics_collect_interval, got {self.interval}",
                path="interval",
            )

    def pre_train(self) -> None:
        self._device = self._cuda_device()
        self._every = self.interval or self.trainer.metrics_collect_interval
        if self._device is None:
            if not self._said_idle:
                self._said_idle = True
                log.info(
                    "GPU memory monitor: training runs on %s, not a CUDA device; nothing to report",
                    self.trainer.device,
                )
            return
        # Peaks reached before training (loading, building) are not any interval's.
        torch.cuda.reset_peak_memory_stats(self._device)

    def _cuda_device(self) -> torch.device | None:
        device = self.trainer.device
        return device if device.type == "cuda" else None

    def post_step(self) -> None:
        if self._device is None or self.step % self._every:
            return
        device = self._device
        allocated = torch.cuda.max_memory_allocated(device)
        reserved = torch.cuda.max_memory_reserved(device)
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.reset_peak_memory_stats(device)
        record = self.trainer.record_metric
        record("GPU max allocated (GiB)", allocated / _GIB, ReduceType.max, namespace="system")
        record("GPU max reserved (GiB)", reserved / _GIB, ReduceType.max, namespace="system")
        record("GPU max reserved (%)", 100 * reserved / total, ReduceType.max, namespace="system")
