"""Gradient, activation and parameter (GAP) statistics, and raw gradient dumps."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch.distributed.tensor import DTensor

from ...distributed.checkpoint import save_state_dict
from ...distributed.utils import get_rank
from ...exceptions import ConfigurationError
from ..common import MetricMergeStrategy, ReduceType
from .callback import Callback, model_of

__all__ = ["GAPMonitorCallback"]

log = logging.getLogger(__name__)

Kind = Literal["param", "grad", "activation", "activation_grad"]


@dataclass
class GAPMonitorCallback(Callback, name="gap_monitor"):
    """Records max (of the absolute value), mean and variance of every parameter, gradient,
    module output (activation) and gradient of a module output, every ``interval`` steps:
    ``gap/params/{name}/max``, ``gap/grads/...``, ``gap/activations/{module}/...``,
    ``gap/activation_grads/...``.

    Parameter and gradient statistics are over the whole tensor (sharded ones are gathered);
    activation statistics are taken per instance and averaged over the batch. Only training
    forward and backward passes are measured, not evaluations. It can also dump raw gradients
    to ``{work_dir}/gradients/step{N}/``: all of them sharded as a distributed checkpoint
    (``full_gradients``), or the first ``dump_gradients_save_first_n`` entries of each
    dimension as one safetensors file per parameter from rank 0 (``sampled_gradients``).

    Every statistic is a metric: with many layers that is many metrics per step, so set an
    ``interval`` for long runs.
    """

    enabled: bool = True
    """``False`` turns the callback off while keeping it in the config (an override can turn it back
    on)."""
    monitor: bool | None = None
    """Record the statistics; default ``True``."""
    interval: int = 1
    """Steps between measurements."""
    dump_gradients: bool | None = None
    """Write raw gradients; default ``False``."""
    dump_gradients_start_step: int = 0
    """The first step whose gradients are dumped (with ``dump_gradients``)."""
    dump_gradients_end_step: int | None = None
    """The last step to dump (inclusive); ``None`` until training ends."""
    dump_gradients_step_interval: int = 1
    """Steps between gradient dumps, counted from ``dump_gradients_start_step``."""
    dump_gradients_save_first_n: int | None = None
    """Dump only this many leading entries of each dimension (from rank 0)."""

    _handles: list[Any] = field(default_factory=list, init=False, repr=False)
    _instances: int = field(default=1, init=False, repr=False)
    _measuring: bool = field(default=False, init=False, repr=False)

    def validate(self) -> None:
        if not self.enabled and (self.monitor or self.dump_gradients):
            raise ConfigurationError(
                "monitor or dump_gradients is set but enabled is False; set enabled=True",
                path="enabled",
            )
        if self.enabled and self.monitor is False and not self.dump_gradients:
            raise ConfigurationError(
                "monitor and dump_gradients are both off: set one, or enabled=False",
                path="monitor",
            )
        for name in ("interval", "dump_gradients_step_interval"):
            if getattr(self, name) < 1:
                raise ConfigurationError(f"must be >= 1, got {getattr(self, name)}", path=name)
        if self.dump_gradients_start_step < 0:
            raise ConfigurationError(
                f"must be >= 0, got {self.dump_gradients_start_step}",
                path="dump_gradients_start_step",
            )
        if self.dump_gradients_save_first_n is not None and self.dump_gradients_save_first_n < 1:
            raise ConfigurationError(
                f"must be >= 1 if set, got {self.dump_gradients_save_first_n}",
                path="dump_gradients_save_first_n",
            )

    @property
    def _monitoring(self) -> bool:
        return self.enabled and self.monitor is not False

    def _model(self) -> torch.nn.Module:
        return model_of(self.trainer.train_module)

    def pre_train(self) -> None:
        if not self._monitoring:
            return
        for name, module in self._model().named_modules():
            if name:
                self._handles.append(
                    module.register_forward_hook(functools.partial(self._on_output, name=name))
                )
                self._handles.append(
                    module.register_full_backward_pre_hook(
                        functools.partial(self._on_output_grad, name=name)
                    )
                )

    def pre_step(self, batch: dict[str, Any]) -> None:
        self._instances = int(batch["input_ids"].shape[0])
        self._measuring = self._monitoring and self.step % self.interval == 0

    def pre_optim_step(self) -> None:
        if self._measuring:
            self._measuring = False  # forward/backward are over: nothing after is training
            for name, param in self._model().named_parameters():
                self._record_whole(name, param, "param")
                if param.grad is not None:
                    self._record_whole(name, param.grad, "grad")
        if self.enabled and self.dump_gradients and self._dump_due():
            self._dump()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # -- statistics --------------------------------------------------------------------------

    def _on_output(self, module: torch.nn.Module, args: Any, output: Any, *, name: str) -> None:
        if self._measuring:
            self._record_per_instance(name, _first_tensor(output), "activation")

    def _on_output_grad(self, module: torch.nn.Module, grad_output: Any, *, name: str) -> None:
        if self._measuring:
            self._record_per_instance(name, _first_tensor(grad_output), "activation_grad")

    @torch.no_grad()
    def _record_per_instance(self, name: str, tensor: torch.Tensor | None, kind: Kind) -> None:
        if tensor is None or tensor.ndim < 2:
            return
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        flat = local.detach().reshape(local.shape[0], -1).float()
        var, mean = torch.var_mean(flat, dim=-1, correction=0)
        # Summed over micro-batches, each divided by the whole batch: the per-instance mean.
        prefix = f"gap/{kind}s/{name}"
        record = self.trainer.record_metric
        record(f"{prefix}/max", flat.abs().max(), ReduceType.max, None, MetricMergeStrategy.max)
        for stat, value in (("mean", mean), ("var", var)):
            total = value.sum() / self._instances
            record(f"{prefix}/{stat}", total, ReduceType.mean, None, MetricMergeStrategy.sum)

    @torch.no_grad()
    def _record_whole(self, name: str, tensor: torch.Tensor, kind: Kind) -> None:
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if full.numel() <= 1:
            return
        values = full.detach().float()
        var, mean = torch.var_mean(values, correction=0)
        prefix = f"gap/{kind}s/{name}"
        self.trainer.record_metric(f"{prefix}/max", values.abs().max(), ReduceType.max)
        self.trainer.record_metric(f"{prefix}/mean", mean, ReduceType.mean)
        self.trainer.record_metric(f"{prefix}/var", var, ReduceType.mean)

    # -- gradient dumps ----------------------------------------------------------------------

    def _dump_due(self) -> bool:
        step, start, end = self.step, self.dump_gradients_start_step, self.dump_gradients_end_step
        if step < start or (end is not None and step > end):
            return False
        return (step - start) % self.dump_gradients_step_interval == 0

    def _dump(self) -> None:
        folder = self.trainer.work_dir / "gradients" / f"step{self.step}"
        grads = {
            name: p.grad.detach()
            for name, p in self._model().named_parameters()
            if p.grad is not None
        }
        if self.dump_gradients_save_first_n is None:
            save_state_dict(folder / "full_gradients", grads, save_overwrite=True)
            log.info("Saved %d gradients of step %d to %s", len(grads), self.step, folder)
            return
        from safetensors.torch import save_file

        n = self.dump_gradients_save_first_n
        out = folder / "sampled_gradients"
        for name, grad in grads.items():
            full = grad.full_tensor() if isinstance(grad, DTensor) else grad  # on every rank
            if get_rank() == 0:
                out.mkdir(parents=True, exist_ok=True)
                sample = full[tuple(slice(0, n) for _ in full.shape)].contiguous().cpu()
                save_file({"gradient": sample}, str(out / f"{name}.safetensors"))
        log.info("Saved samples of %d gradients of step %d to %s", len(grads), self.step, out)


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, tuple):
        value = value[0] if value else None
    return value if isinstance(value, torch.Tensor) else None
