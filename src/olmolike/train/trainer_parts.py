"""The components a :class:`~olmolike.train.trainer.Trainer` is made of, built from its
settings: FLOP counting, the cancel protocol, the callbacks' hooks, the run's checkpoints, the
per-step results and the scope around a run. ``trainer.py`` keeps the loop and the public API;
what each component needs from the trainer's settings is decided here, in one place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..distributed.utils import get_rank, get_world_size, is_distributed
from . import durations
from .background_ops import BookkeepingRunner
from .callbacks.callback import CALLBACK_HOOKS, Callback
from .callbacks.hooks import EXTRA_HOOKS, HookCaller
from .cancellation import CancelCoordinator
from .checkpoint.run import RunCheckpoints
from .run_scope import RunScope
from .step_results import StepResults

if TYPE_CHECKING:
    from .trainer import Trainer

__all__ = ["ALL_HOOKS", "TrainerParts", "build_parts"]

ALL_HOOKS = CALLBACK_HOOKS + EXTRA_HOOKS


@dataclass(frozen=True)
class TrainerParts:
    """The trainer's components (each documented in its own module)."""

    flops: durations.FlopCounter
    """FLOPs per token, asked of the train module once per sequence length."""
    cancel: CancelCoordinator
    """The run's cancellation, agreed by every rank at the same step."""
    hooks: HookCaller
    """Calls the callbacks' hooks, highest priority first."""
    checkpoints: RunCheckpoints
    """The run's loads (resume with fallback) and the files added to every checkpoint."""
    step_results: StepResults
    """Per-step metric collection, cancel checks and the delivery of what is due."""
    scope: RunScope
    """Around ``fit()``: error reports, closing the callbacks, releasing what the run holds."""


def build_parts(trainer: Trainer, bookkeeping: BookkeepingRunner) -> TrainerParts:
    """The components of ``trainer``, whose bookkeeping runs on ``bookkeeping``."""
    # Asked when a step needs it: a callback may replace the train module's method.
    flops = durations.FlopCounter(lambda n: trainer.train_module.num_flops_per_token(n))
    cancel = CancelCoordinator(rank=get_rank(), world_size=get_world_size())
    hooks = HookCaller(trainer.callbacks.values(), ALL_HOOKS, Callback)
    checkpoints = RunCheckpoints(
        checkpointer=trainer.checkpointer,
        train_module=trainer.train_module,
        save_folder=trainer.save_folder,
        work_dir=trainer.work_dir,
        load_path=trainer.load_path,
        load_strategy=trainer.load_strategy,
        load_trainer_state=trainer.load_trainer_state,
        load_optim_state=trainer.load_optim_state,
    )
    step_results = StepResults(
        runner=bookkeeping,
        cancel=cancel,
        hooks=hooks,
        device=trainer.device
        if is_distributed() and not trainer.async_bookkeeping
        else torch.device("cpu"),
        metrics_collect_interval=trainer.metrics_collect_interval,
        cancel_check_interval=trainer.cancel_check_interval,
        train_timeout_seconds=trainer.train_timeout_seconds,
    )
    scope = RunScope(
        checkpoints=checkpoints,
        step_results=step_results,
        bookkeeping=bookkeeping,
        call_each=hooks.call_each,
        owned_groups=trainer.owned_process_groups,
        step=lambda: trainer.global_step,
        save_folder=trainer.save_folder,
        cancel=cancel,
    )
    return TrainerParts(flops, cancel, hooks, checkpoints, step_results, scope)
