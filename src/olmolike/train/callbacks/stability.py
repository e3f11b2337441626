"""Watches for loss and gradient-norm spikes and non-finite values, and reacts by policy.

Detection happens where values are already on the host: in :meth:`~olmolike.train.Callback.log_metrics`, once per
collect interval, with values reduced across ranks and delivered at the same step on every rank
(so every rank decides the same, at the same step: disabling checkpoints changes collectives). That adds
no host-device sync to the hot path. Only ``skip_step`` must act before the optimizer step of
the bad step itself; it does so entirely on the device (see
:meth:`StabilityMonitorCallback.pre_optim_step`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ...config import StrEnum
from ...distributed.utils import is_distributed
from ...exceptions import ConfigurationError
from ..common import ReduceType
from .callback import Callback, model_of
from .checkpointer import CheckpointerCallback
from .spike_score import SpikeScore

__all__ = ["StabilityMonitorCallback", "StabilityPolicy"]

log = logging.getLogger(__name__)

SKIPPED_METRIC = "stability/skipped step"


class StabilityPolicy(StrEnum):
    """What to do when the monitor finds a problem."""

    warn = "warn"
    """Log a warning and keep training."""
    skip_step = "skip_step"
    """Zero the gradients of a step whose gradient norm is non-finite or spikes."""
    stop = "stop"
    """Cancel the run gracefully."""


class _RunningStats:
    """Exponentially weighted mean and variance of plain floats, for values on the host.

    Plain floats, not 0-dim tensors: this runs for every logged value, and each tensor op on
    the host costs microseconds where a float op costs nanoseconds.
    """

    def __init__(self, window: int) -> None:
        self.alpha = 2.0 / (window + 1)
        self.mean = 0.0
        self.var = 0.0
        self.count = 0

    def is_spike(self, x: float, threshold: float, warmup: int) -> bool:
        # A floor on the spread: a perfectly flat history would otherwise flag any wiggle.
        std = max(math.sqrt(self.var), 1e-3 * abs(self.mean))
        return self.count >= warmup and x > self.mean + threshold * std

    def update(self, x: float) -> None:
        if self.count == 0:
            self.mean, self.var = x, 0.0
        else:
            delta = x - self.mean
            self.mean += self.alpha * delta
            self.var = (1 - self.alpha) * (self.var + self.alpha * delta * delta)
        self.count += 1

    def state_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.mean, self.var, self.count = state["mean"], state["var"], int(state["count"])


class _DeviceRunningStats:
    """The same statistics as :class:`_RunningStats`, as tensors on the training device, so
    the skip decision needs no host sync. Updates are masked rather than branched for that."""

    def __init__(self, window: int, device: torch.device) -> None:
        self.alpha = 2.0 / (window + 1)
        self.mean = torch.zeros((), dtype=torch.float64, device=device)
        self.var = torch.zeros((), dtype=torch.float64, device=device)
        self.count = torch.zeros((), dtype=torch.int64, device=device)

    def is_spike(self, x: torch.Tensor, threshold: float, warmup: int) -> torch.Tensor:
        std = torch.maximum(self.var.sqrt(), 1e-3 * self.mean.abs())
        return (self.count >= warmup) & (x > self.mean + threshold * std)

    def update(self, x: torch.Tensor, keep: torch.Tensor) -> None:
        """Fold ``x`` in where ``keep``: spikes stay out, so they do not raise the baseline."""
        x = x.to(torch.float64)
        delta = x - self.mean
        first = self.count == 0
        mean = torch.where(first, x, self.mean + self.alpha * delta)
        var = torch.where(first, 0.0, (1 - self.alpha) * (self.var + self.alpha * delta * delta))
        self.mean = torch.where(keep, mean, self.mean)
        self.var = torch.where(keep, var, self.var)
        self.count = self.count + keep.to(torch.int64)

    def state_dict(self) -> dict[str, float]:
        return {"mean": self.mean.item(), "var": self.var.item(), "count": self.count.item()}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.mean = torch.tensor(state["mean"], dtype=torch.float64, device=self.mean.device)
        self.var = torch.tensor(state["var"], dtype=torch.float64, device=self.var.device)
        self.count = torch.tensor(int(state["count"]), device=self.count.device)


@dataclass
class StabilityMonitorCallback(SpikeScore, Callback, name="stability_monitor"):
    """Detects loss spikes, gradient-norm spikes and non-finite values; reacts by ``policy``.

    A spike is a value more than ``*_spike_threshold`` standard deviations above its running
    (exponentially weighted, span ``window`` steps) mean, judged once ``warmup_steps`` values
    are known. Non-finite values are always a problem.

    ``skip_step`` zeroes the gradients on the device, before the optimizer step, when the
    gradient norm is non-finite or spikes; no host sync. The optimizer still steps with a zero
    gradient: Adam-style momentum and weight decay still move the weights a little, but nothing
    from the bad batch enters them. It judges the gradient norm rather than the loss because the
    norm is the same on every data-parallel rank after gradient synchronisation, so all replicas
    make the same choice without communicating; a non-finite loss always gives non-finite
    gradients, so it is caught too. Loss spikes are reported as warnings under this policy.

    ``stop`` cancels the run. A non-finite loss or gradient norm means the weights may be
    corrupt, so the monitor then disables every :class:`CheckpointerCallback`: the last good
    checkpoint stays the newest. With ``guard_checkpoints``, the loss is also checked right
    before each checkpoint (one host sync per checkpoint, not per step): metrics arrive up to a
    collect interval late, and a checkpoint of a corrupt state must not be written meanwhile.

    OLMo-core's fields (``window_size``, ``rolling_window``, ``threshold_std``,
    ``loss_metric_name``, ``grad_norm_metric_name``, ``enabled``) and its SpikeScore metrics
    come from :class:`~.spike_score.SpikeScore`.
    """

    policy: StabilityPolicy = StabilityPolicy.warn
    """What a problem leads to: ``warn`` (a warning), ``skip_step`` (zero the gradients of a step
    whose gradient norm is non-finite or spikes) or ``stop`` (cancel the run, keeping the last good
    checkpoint the newest)."""
    loss_metric: str | None = None
    """The loss watched; ``None``: the train module's (its ``loss_metric``: ``train/CE loss``
    for pretraining and SFT, ``train/DPO loss``, ``train/GRPO loss``)."""
    grad_norm_metric: str = "optim/total grad norm"
    """Recorded by the train modules when they clip gradients (``max_grad_norm``)."""
    window: int = 100
    """The span, in steps, of the exponentially weighted running mean and variance that spikes are
    measured against."""
    warmup_steps: int = 20
    """Values seen before spikes are judged (non-finite values are problems from the first step)."""
    loss_spike_threshold: float | None = 6.0
    """Standard deviations above the running mean; ``None`` watches only for non-finite loss."""
    grad_norm_spike_threshold: float | None = 6.0
    """Standard deviations above the running mean at which the gradient norm spikes; ``None``
    watches only for a non-finite norm."""
    guard_checkpoints: bool = True
    """Check the loss right before each checkpoint (one host sync per checkpoint) and refuse to save
    a state whose loss is non-finite: metrics arrive up to a collect interval late."""

    _loss_stats: _RunningStats = field(init=False, repr=False)
    _grad_stats: _RunningStats = field(init=False, repr=False)
    _device_grad_stats: _DeviceRunningStats | None = field(default=None, init=False, repr=False)
    _params: list[torch.nn.Parameter] = field(default_factory=list, init=False, repr=False)
    _corrupt: bool = field(default=False, init=False, repr=False)
    _last_loss: torch.Tensor | None = field(default=None, init=False, repr=False)
    _checkpointers: list[CheckpointerCallback] = field(default_factory=list, init=False, repr=False)

    priority = 2  # before the checkpointer, so a guarded save can be prevented

    def validate(self) -> None:
        if self.window < 1:
            raise ConfigurationError(f"must be >= 1, got {self.window}", path="window")
        if self.warmup_steps < 1:
            raise ConfigurationError(
                f"must be >= 1 (values needed before spikes are judged), got {self.warmup_steps}",
                path="warmup_steps",
            )
        for name in ("loss_spike_threshold", "grad_norm_spike_threshold"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigurationError(
                    f"must be > 0 (standard deviations), or None to not judge spikes; got {value}",
                    path=name,
                )
        self._loss_stats = _RunningStats(self.window)
        self._grad_stats = _RunningStats(self.window)
        for name, problem in self._check_score_settings():
            raise ConfigurationError(problem, path=name)

    def post_attach(self) -> None:
        if self.policy != StabilityPolicy.skip_step or not self.enabled:
            return
        model = model_of(
            self.trainer.train_module,
            needed_for="to reach the gradients (policy 'skip_step')",
            fix="use policy 'warn' or 'stop'",
            path="policy",
        )
        self._params = list(model.parameters())
        self._device_grad_stats = _DeviceRunningStats(self.window, self.trainer.device)

    # -- skip_step: on the device, before the optimizer step --------------------------------

    def pre_optim_step(self) -> None:
        stats = self._device_grad_stats
        if stats is None:
            return
        grads = [p.grad for p in self._params if p.grad is not None]
        if not grads:
            return
        norm = torch.nn.utils.get_total_norm(grads)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        bad = ~torch.isfinite(norm)
        if self.grad_norm_spike_threshold is not None:
            bad = bad | stats.is_spike(norm, self.grad_norm_spike_threshold, self.warmup_steps)
        for grad in grads:
            grad.masked_fill_(bad, 0.0)  # replaces NaN too, which multiplying by 0 would not
        stats.update(torch.nan_to_num(norm), ~bad)
        self.trainer.record_metric(SKIPPED_METRIC, bad.to(torch.float32), ReduceType.max)

    # -- warn / stop: on the host, as metrics arrive ----------------------------------------

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        problems: list[str] = []
        nonfinite = False
        loss = metrics.get(self._loss_metric)
        if loss is not None:
            nonfinite |= self._judge(
                "loss", loss, self._loss_stats, self.loss_spike_threshold, problems
            )
        grad_norm = metrics.get(self.grad_norm_metric)
        if grad_norm is not None and self.policy != StabilityPolicy.skip_step:
            nonfinite |= self._judge(
                "gradient norm",
                grad_norm,
                self._grad_stats,
                self.grad_norm_spike_threshold,
                problems,
            )
        if metrics.get(SKIPPED_METRIC, 0.0) > 0:
            log.warning("Step %d was skipped: its gradient norm was non-finite or spiked", step)
        if problems:
            self._act(
                step, problems, corrupt=nonfinite and self.policy != StabilityPolicy.skip_step
            )

    def _judge(
        self,
        what: str,
        value: float,
        stats: _RunningStats,
        threshold: float | None,
        problems: list[str],
    ) -> bool:
        """Append a problem with ``value``; return whether it is non-finite."""
        if not math.isfinite(value):
            problems.append(f"non-finite {what} ({value})")
            return True
        if threshold is not None and stats.is_spike(value, threshold, self.warmup_steps):
            problems.append(
                f"{what} spike: {value:.4g} vs running mean {stats.mean:.4g} "
                f"(std {math.sqrt(stats.var):.3g}, threshold {threshold} std)"
            )
        else:  # spikes stay out, so they do not raise the baseline
            stats.update(value)
        return False

    def _act(self, step: int, problems: list[str], *, corrupt: bool) -> None:
        message = f"step {step}: " + "; ".join(problems)
        if corrupt:
            self._disable_checkpoints(message)
        if self.policy == StabilityPolicy.stop:
            log.error("Training is unstable at %s: stopping", message)
            self.trainer.cancel_run(f"stability monitor: {message}")
        else:
            log.warning("Training is unstable at %s", message)

    def _disable_checkpoints(self, why: str) -> None:
        if self._corrupt:
            return
        self._corrupt = True
        log.error(
            "No further checkpoints will be saved (%s): the weights may be corrupt; resume from "
            "the last checkpoint saved before this step",
            why,
        )
        for callback in self.trainer.callbacks.values():
            if isinstance(callback, CheckpointerCallback):
                callback.enabled = False

    # -- guarding checkpoints -----------------------------------------------------------------

    @property
    def _loss_metric(self) -> str:
        return self.loss_metric or self.train_loss_metric()

    def _default_metric(self, which: str) -> str:
        return self._loss_metric if which == "loss" else self.grad_norm_metric

    def pre_train(self) -> None:
        # Looked up once: the guard runs every step, and the callbacks are fixed by now.
        self._checkpointers = [
            cb for cb in self.trainer.callbacks.values() if isinstance(cb, CheckpointerCallback)
        ]

    def post_step(self) -> None:
        if not self.guard_checkpoints or not self.enabled:
            return
        # A reference, not a value: reading it would sync. The final checkpoint (post_train)
        # comes after the metrics are collected, so it is kept here for that check.
        self._last_loss = self.trainer.get_metric(self._loss_metric)
        if self._checkpoint_due():
            self._guard("before the checkpoint of step")

    def post_train(self) -> None:
        if self.enabled and self.guard_checkpoints and self._active_checkpointers():
            self._guard("before the final checkpoint at step")

    def _active_checkpointers(self) -> list[CheckpointerCallback]:
        return [cb for cb in self._checkpointers if cb.active]

    def _checkpoint_due(self) -> bool:
        step = self.trainer.global_step
        return any(cb.saves_at(step) for cb in self._active_checkpointers())

    def _guard(self, when: str) -> None:
        loss = self._last_loss
        finite = True if loss is None else bool(torch.isfinite(loss).all())
        if not self._agree(finite):
            step = self.trainer.global_step
            self._act(step, [f"non-finite loss {when} {step}"], corrupt=True)

    def _agree(self, finite: bool) -> bool:
        """Whether the loss is finite on every rank: a save is collective, so all must agree."""
        if not is_distributed():
            return finite
        trainer = self.trainer
        return trainer.run_bookkeeping_op(
            _all_true,
            finite,
            trainer.bookkeeping_pg,
            trainer.bookkeeping_device,
            op_name="stability_guard",
        ).result()

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "loss": self._loss_stats.state_dict(),
            "grad_norm": self._grad_stats.state_dict(),
        }
        if self._device_grad_stats is not None:
            state["device_grad_norm"] = self._device_grad_stats.state_dict()
        return state | {"spike_score": self._score_state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loss_stats.load_state_dict(state_dict["loss"])
        self._grad_stats.load_state_dict(state_dict["grad_norm"])
        if self._device_grad_stats is not None and "device_grad_norm" in state_dict:
            self._device_grad_stats.load_state_dict(state_dict["device_grad_norm"])
        self._load_score_state(state_dict.get("spike_score", {}))


def _all_true(flag: bool, group: dist.ProcessGroup | None, device: torch.device) -> bool:
    value = torch.tensor([int(flag)], dtype=torch.int64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
    return bool(value.item())
