"""Trainer callbacks: one module each."""

from .aim import AimCallback
from .batch_size_scheduler import BatchSizeSchedulerCallback, BatchSizeStage, BatchSizeUnits
from .callback import CALLBACK_HOOKS, Callback, callback_registry
from .checkpointer import CheckpointerCallback
from .config_saver import ConfigSaverCallback
from .console_logger import ConsoleLoggerCallback
from .early_stopping import EarlyStoppingCallback, EarlyStoppingMode
from .evaluator import Evaluator, EvaluatorCallback, LMEvaluator, LMEvaluatorCallbackConfig
from .garbage_collector import GarbageCollectorCallback
from .gpu_memory_monitor import GPUMemoryMonitorCallback
from .metric_saver import MetricSaverCallback
from .model_merge import (
    ModelMergeCallback,
    compute_merge_steps_from_decay_schedule,
    compute_merge_window_starts,
)
from .profiler import ProfilerCallback
from .progress import ProgressCallback
from .reproducibility_check import ReproducibilityCheckCallback
from .speed_monitor import SpeedMonitorCallback
from .stability import StabilityMonitorCallback, StabilityPolicy
from .tensorboard import TensorBoardCallback
from .wandb import WandBCallback

__all__ = [
    "CALLBACK_HOOKS",
    "AimCallback",
    "BatchSizeSchedulerCallback",
    "BatchSizeStage",
    "BatchSizeUnits",
    "Callback",
    "CheckpointerCallback",
    "ConfigSaverCallback",
    "ConsoleLoggerCallback",
    "EarlyStoppingCallback",
    "EarlyStoppingMode",
    "Evaluator",
    "EvaluatorCallback",
    "GPUMemoryMonitorCallback",
    "GarbageCollectorCallback",
    "LMEvaluator",
    "LMEvaluatorCallbackConfig",
    "MetricSaverCallback",
    "ModelMergeCallback",
    "ProfilerCallback",
    "ProgressCallback",
    "ReproducibilityCheckCallback",
    "SpeedMonitorCallback",
    "StabilityMonitorCallback",
    "StabilityPolicy",
    "TensorBoardCallback",
    "WandBCallback",
    "callback_registry",
    "compute_merge_steps_from_decay_schedule",
    "compute_merge_window_starts",
]
