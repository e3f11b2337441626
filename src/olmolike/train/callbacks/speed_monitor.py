"""Training throughput: tokens, batches and FLOPs per second, and model FLOPs utilisation."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ...exceptions import ConfigurationError
from ...hardware import peak_flops
from ..common import ReduceType
from ..durations import Speed
from .callback import Callback

__all__ = ["SpeedMonitorCallback", "speed_of"]

log = logging.getLogger(__name__)

_MFU_NOTED: set[str] = set()

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class SpeedMonitorCallback(Callback, name="speed_monitor"):
    """Records throughput metrics under the ``throughput/`` namespace for every timed step.

    A step is timed from the end of the previous step (its ``post_step``) to its own end, by
    the wall clock. Everything in between counts: loading the batch, other callbacks' work
    such as a checkpoint save or an evaluation, and the step itself. The numbers are then what
    the run really achieves, and a save shows up as a dip at its step instead of vanishing
    from the average. Not timed (nothing is recorded for them): the first step after
    ``pre_train``, whose interval has no start and would include start-up work, and steps
    skipped by ``steps_to_skip``, which train nothing.

    The device is never synchronized: on an accelerator a step's interval is the time the
    host spent queueing it, which tracks the device's pace because the metric collection
    (one sync per ``metrics_collect_interval``) keeps the host from running far ahead. Single
    steps may jitter; ``device/TPS (avg)`` is the steady figure.

    Metrics (per-device values are averaged over ranks, global ones summed):

    - ``throughput/device/TPS``: tokens per second on this device.
    - ``throughput/device/TPS (avg)``: the same, averaged over every timed step of this
      ``fit()`` call.
    - ``throughput/TPS``: tokens per second over all devices.
    - ``throughput/device/BPS``: batches (steps) per second.
    - ``throughput/device/FLOPS``: model FLOPs per second on this device, from
      ``train_module.num_flops_per_token(seq_len)`` (absent if the module cannot count).
    - ``throughput/device/MFU``: those FLOPs as a percentage of the device's peak (absent
      when the peak is unknown, e.g. on a CPU, unless ``device_peak_flops`` is set).
    - ``throughput/total tokens``: tokens trained on so far, over all ranks.
    """

    device_peak_flops: float | None = None
    """The device's peak FLOP/s for MFU; by default looked up for the device and ``dtype``."""
    dtype: str = "bfloat16"
    """The matmul precision training runs in, to look up the peak: bfloat16, float16, float32."""

    _last_end: float | None = field(default=None, init=False, repr=False)
    _rank_tokens: int = field(default=0, init=False, repr=False)
    _seq_len: int = field(default=0, init=False, repr=False)
    _trained: bool = field(default=False, init=False, repr=False)
    _peak: float | None = field(default=None, init=False, repr=False)
    _flops_per_token: dict[int, int | None] = field(default_factory=dict, init=False, repr=False)
    _timed_tokens: int = field(default=0, init=False, repr=False)
    _timed_seconds: float = field(default=0.0, init=False, repr=False)
    _timed_steps: int = field(default=0, init=False, repr=False)
    _timed_flops: float = field(default=0.0, init=False, repr=False)

    def validate(self) -> None:
        if self.device_peak_flops is not None and not self.device_peak_flops > 0:
            raise ConfigurationError(
                f"must be a positive FLOP/s figure (e.g. 989e12 for an H100 in bfloat16) or "
                f"None to look it up, got {self.device_peak_flops}",
                path="device_peak_flops",
            )
        if self.dtype not in _DTYPES:
            raise ConfigurationError(
                f"must be one of {sorted(_DTYPES)}, got {self.dtype!r}", path="dtype"
            )

    def pre_train(self) -> None:
        self._last_end = None
        self._timed_tokens = 0
        self._timed_seconds = 0.0
        self._timed_steps = 0
        self._timed_flops = 0.0
        self._peak = self.device_peak_flops
        if self._peak is None:
            self._peak = peak_flops(self.trainer.device, _DTYPES[self.dtype])
            device = self.trainer.device
            if self._peak is None and str(device) not in _MFU_NOTED:
                _MFU_NOTED.add(str(device))  # once per device and process, not every fit()
                log.log(
                    logging.DEBUG if device.type == "cpu" else logging.INFO,  # expected on CPU
                    "MFU is not reported: the peak FLOP/s of %s is unknown (set "
                    "device_peak_flops on the speed monitor to report it)",
                    device,
                )

    def pre_step(self, batch: dict[str, Any]) -> None:
        input_ids = batch["input_ids"]
        # Shapes are host-side metadata: reading them never waits for the device.
        self._rank_tokens = input_ids.numel()
        self._seq_len = int(input_ids.shape[-1])
        self._trained = False

    def pre_optim_step(self) -> None:
        # The trainer calls this only on steps it trains, so a skipped step stays untimed.
        self._trained = True

    def post_step(self) -> None:
        now = time.perf_counter()
        last, self._last_end = self._last_end, now
        if last is None or not self._trained:
            return
        self._record(now - last)

    def _record(self, seconds: float) -> None:
        seconds = max(seconds, 1e-9)
        trainer = self.trainer
        self._timed_tokens += self._rank_tokens
        self._timed_seconds += seconds
        self._timed_steps += 1
        tps = self._rank_tokens / seconds
        trainer.record_metric("device/TPS", tps, ReduceType.mean, namespace="throughput")
        trainer.record_metric(
            "device/TPS (avg)",
            self._timed_tokens / self._timed_seconds,
            ReduceType.mean,
            namespace="throughput",
        )
        trainer.record_metric("TPS", tps, ReduceType.sum, namespace="throughput")
        trainer.record_metric("device/BPS", 1.0 / seconds, ReduceType.mean, namespace="throughput")
        trainer.record_metric(
            "total tokens", float(trainer.global_train_tokens_seen), namespace="throughput"
        )
        per_token = self._flops_per_token_at(self._seq_len)
        if per_token is None:
            return
        flops = per_token * tps
        self._timed_flops += per_token * self._rank_tokens
        trainer.record_metric("device/FLOPS", flops, ReduceType.mean, namespace="throughput")
        if self._peak is not None:
            mfu = 100.0 * flops / self._peak
            trainer.record_metric("device/MFU", mfu, ReduceType.mean, namespace="throughput")

    @property
    def bps_avg(self) -> float | None:
        """Steps per second averaged over the timed steps of this ``fit()`` (this rank)."""
        return self._timed_steps / self._timed_seconds if self._timed_steps else None

    @property
    def tps_avg(self) -> float | None:
        """Tokens per second on this device, averaged over the timed steps."""
        return self._timed_tokens / self._timed_seconds if self._timed_steps else None

    @property
    def mfu_avg(self) -> float | None:
        """Model FLOPs utilization in percent over the timed steps, if the peak is known."""
        if not self._timed_flops or self._peak is None:
            return None
        return 100.0 * self._timed_flops / self._timed_seconds / self._peak

    def _flops_per_token_at(self, seq_len: int) -> int | None:
        # Counting may walk the model's parameters; once per sequence length is enough.
        if seq_len not in self._flops_per_token:
            self._flops_per_token[seq_len] = self.trainer.train_module.num_flops_per_token(seq_len)
        return self._flops_per_token[seq_len]


def speed_of(callbacks: Iterable[Any]) -> Speed:
    """The speed the first :class:`SpeedMonitorCallback` among ``callbacks`` measured (all
    unknown without one), for :attr:`~olmolike.train.Trainer.training_progress`."""
    monitor = next((cb for cb in callbacks if isinstance(cb, SpeedMonitorCallback)), None)
    if monitor is None:
        return Speed()
    return Speed(monitor.bps_avg, monitor.tps_avg, monitor.mfu_avg)
