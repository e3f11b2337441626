"""Weight averaging: the mean of the model's weights over the last steps before a merge step.

Averaging the weights of the last few hundred steps of a stable learning-rate phase gives a
model close to what decaying the learning rate would give, without decaying it (and so
without ending the run). The helpers at the bottom place merge steps just before the decay
phases of a schedule and name the steps that need a checkpoint for a resumed run to still
merge.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

import torch
from torch.distributed.tensor import DTensor

from ...exceptions import ConfigurationError
from .callback import Callback, model_of
from .evaluator import _PeriodicEvaluation

__all__ = [
    "ModelMergeCallback",
    "compute_merge_steps_from_decay_schedule",
    "compute_merge_window_starts",
]

log = logging.getLogger(__name__)


@dataclass
class ModelMergeCallback(Callback, name="model_merger"):
    """Saves the average of the weights after each of the ``merge_last_n_steps`` steps that end
    at each merge step, as the checkpoint ``{save_folder}/step{N}-{output_suffix}``.

    The merged checkpoint holds the model only (load it with ``load_optim_state=False``, or
    unshard or export it like any checkpoint); it is never taken for the run's latest
    checkpoint. Every evaluator callback then evaluates the averaged weights, logged as
    ``eval/merged/...``, and training continues with the unaveraged weights.

    The running sums are not checkpointed: a run resumed inside a window cannot complete that
    window's average and skips the merge with a warning, except when resumed exactly at the
    window's first step (:func:`compute_merge_window_starts` lists those steps, for the
    checkpointer's ``fixed_steps``). Ephemeral checkpoints are blocked inside windows, so an
    interruption resumes from before the window. Sums are kept in float32 on the CPU: one copy
    of this rank's share of the weights per open window.
    """

    priority: ClassVar[int] = 2  # before the checkpointer: blocking must be in place first

    merge_step: int | list[int] = field(default_factory=list)
    """The step(s) to save an averaged checkpoint at."""
    merge_interval: int | None = None
    """Or merge every this many steps (instead of ``merge_step``)."""
    merge_last_n_steps: int = 500
    """How many steps (ending at the merge step) the average spans."""
    output_suffix: str = "merged"
    """The merged checkpoint is ``step{N}-{output_suffix}``."""
    enabled: bool = False
    """Off unless set, as in OLMo-core: averaging costs CPU memory and a save per merge."""

    _merge_steps: list[int] = field(default_factory=list, init=False, repr=False)
    _sums: dict[int, list[torch.Tensor]] = field(default_factory=dict, init=False, repr=False)
    _counts: dict[int, int] = field(default_factory=dict, init=False, repr=False)
    _completed_merges: set[int] = field(default_factory=set, init=False, repr=False)
    """Merge steps saved, or skipped because the run resumed inside their window."""

    def validate(self) -> None:
        # Messages phrased as OLMo-core's, so tests and scripts matching them keep working.
        if not self.enabled:
            return
        if self.merge_last_n_steps < 1:
            raise ConfigurationError(
                f"merge_last_n_steps must be positive, got {self.merge_last_n_steps}"
            )
        steps = [self.merge_step] if isinstance(self.merge_step, int) else list(self.merge_step)
        if self.merge_interval is not None:
            if self.merge_interval < 1:
                raise ConfigurationError(
                    f"merge_interval must be positive, got {self.merge_interval}"
                )
            if any(s > 0 for s in steps):
                raise ConfigurationError(
                    "Cannot set both merge_step and merge_interval; list every step in "
                    "merge_step to combine them",
                    path="merge_interval",
                )
            return
        if not steps:
            raise ConfigurationError("merge_step or merge_interval must be set", path="merge_step")
        if any(s < 1 for s in steps):
            raise ConfigurationError(f"merge_step values must be positive, got {steps}")
        self._merge_steps = sorted(set(steps))

    def _window_start(self, merge_step: int) -> int:
        """The first step whose weights enter the average of ``merge_step``."""
        return max(0, merge_step - self.merge_last_n_steps + 1)

    def _active_windows(self) -> list[int]:
        """The pending merge steps whose window holds the current step."""
        step = self.step
        return [
            ms
            for ms in self._merge_steps
            if ms not in self._completed_merges and self._window_start(ms) <= step <= ms
        ]

    def pre_train(self) -> None:
        if not self.enabled:
            return
        if self.merge_interval is not None:
            max_steps = self.trainer.max_steps
            if max_steps is None:
                raise ConfigurationError(
                    "needs the run's length in steps (max_duration in steps or tokens)",
                    path="merge_interval",
                )
            self._merge_steps = list(range(self.merge_interval, max_steps + 1, self.merge_interval))
        now = self.step
        for ms in self._merge_steps:
            start = self._window_start(ms)
            if ms <= now:  # merged (or skipped) before the checkpoint this run resumed from
                self._completed_merges.add(ms)
                continue
            if ms < self.merge_last_n_steps:
                raise ConfigurationError(
                    f"merge step {ms} comes before {self.merge_last_n_steps} steps have been "
                    "trained; lower merge_last_n_steps or merge later",
                    path="merge_last_n_steps",
                )
            if now == start:
                # Resumed at the window's first step: the loaded weights are that step's.
                self._accumulate(ms, self._local_weights())
            elif start < now:
                log.warning(
                    "Resumed at step %d inside the window [%d, %d] of merge step %d: that "
                    "merge is skipped (its running average was not checkpointed)",
                    now,
                    start,
                    ms,
                    ms,
                )
                self._completed_merges.add(ms)
        log.info("Model merges at steps %s", [s for s in self._merge_steps if s > now])

    def post_train_batch(self) -> None:
        if not self.enabled:
            return
        step = self.step
        open_windows = self._active_windows()
        if open_windows:
            weights = self._local_weights()
            for ms in open_windows:
                self._accumulate(ms, weights)
            if step in open_windows:
                self._save_merged(step)
        if any(self._window_start(ms) <= step < ms for ms in open_windows):
            self.block_ephemeral_checkpoints()
        else:
            self.unblock_ephemeral_checkpoints()

    def _params(self) -> list[torch.nn.Parameter]:
        return list(model_of(self.trainer.train_module).parameters())

    def _local_weights(self) -> list[torch.Tensor]:
        return [_local(p).detach().to("cpu", torch.float32) for p in self._params()]

    def _accumulate(self, merge_step: int, weights: list[torch.Tensor]) -> None:
        sums = self._sums.get(merge_step)
        if sums is None:
            self._sums[merge_step] = [w.clone() for w in weights]
            self._counts[merge_step] = 1
            return
        for total, w in zip(sums, weights):
            total.add_(w)
        self._counts[merge_step] += 1

    @torch.no_grad()
    def _save_merged(self, merge_step: int) -> None:
        sums, count = self._sums.pop(merge_step), self._counts.pop(merge_step)
        self._completed_merges.add(merge_step)
        trainer = self.trainer
        path = f"{trainer.save_folder.rstrip('/')}/step{merge_step}-{self.output_suffix}"
        log.info("Saving the average of %d steps' weights to %s", count, path)
        params = self._params()
        originals = [_local(p).detach().clone() for p in params]
        try:
            for p, total in zip(params, sums):
                local = _local(p)
                local.copy_((total / count).to(local.device, local.dtype))
            trainer.checkpointer.save(
                path, cast(Any, _ModelOnly(trainer.train_module)), trainer.state_dict()
            )
            for cb in trainer.callbacks.values():
                if isinstance(cb, _PeriodicEvaluation) and not trainer.no_evals:
                    cb.perform_eval(prefix="eval/merged")
        finally:
            for p, original in zip(params, originals):
                _local(p).copy_(original)


class _ModelOnly:
    """A train module's model state alone, for checkpoints that carry no optimizer."""

    def __init__(self, train_module: Any) -> None:
        self._train_module = train_module

    def state_dict_to_save(self) -> dict[str, Any]:
        return {"model": self._train_module.state_dict_to_save()["model"]}


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param.data


def compute_merge_steps_from_decay_schedule(
    period_lengths: list[int],
    tokens_per_step: int,
    decay: int | None = None,
    decay_fraction: float | None = None,
) -> list[int]:
    """The last step before the decay phase of each period of a schedule.

    :param period_lengths: the length of each period in tokens (periods follow each other).
    :param tokens_per_step: the global batch size in tokens.
    :param decay: the decay phase's length in tokens, the same for every period; or
    :param decay_fraction: the decay phase as a fraction of each period.
    """
    if decay is None and decay_fraction is None:
        raise ValueError("Either decay or decay_fraction must be set (decay in tokens)")
    steps, end = [], 0
    for length in period_lengths:
        end += length
        if decay is not None:
            decay_tokens = decay
        else:
            assert decay_fraction is not None
            decay_tokens = round(decay_fraction * length)
        steps.append((end - decay_tokens) // tokens_per_step)
    return steps


def compute_merge_window_starts(merge_steps: list[int], merge_last_n_steps: int) -> list[int]:
    """The first step of each merge window, where a checkpoint lets a resumed run still merge.

    Overlapping windows share the start of the earliest; pass the result as the
    checkpointer's fixed steps.
    """
    starts: list[int] = []
    previous = -1
    for ms in sorted(merge_steps):
        start = max(0, ms - merge_last_n_steps + 1)
        if start > previous:
            starts.append(start)
        previous = ms
    return starts
