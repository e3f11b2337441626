"""Optimizers and learning-rate schedules.

Build an optimizer with ``AdamWConfig(...).build(model)``; its parameter groups carry a
``name`` and an ``initial_lr``, which a :class:`Scheduler` scales each step with
``scheduler.set_lr(optim, current, t_max)``.
"""

from __future__ import annotations

from .config import AdamWConfig, OptimConfig, OptimGroupOverride, SGDConfig
from .scheduler import (
    SGDR,
    WSD,
    ConstantWithWarmup,
    CosWithWarmup,
    DecayShape,
    LinearWithWarmup,
    Scheduler,
    SchedulerUnits,
    WarmupScheduler,
)

__all__ = [
    "SGDR",
    "WSD",
    "AdamWConfig",
    "ConstantWithWarmup",
    "CosWithWarmup",
    "DecayShape",
    "LinearWithWarmup",
    "OptimConfig",
    "OptimGroupOverride",
    "SGDConfig",
    "Scheduler",
    "SchedulerUnits",
    "WarmupScheduler",
]
