"""Trainer callbacks: one module each."""

from .aim import AimCallback
from .batch_size_scheduler import BatchSizeSchedulerCallback, BatchSizeStage, BatchSizeUnits
from .callback import CALLBACK_HOOKS, Callback, callback_registry
from .checkpointer import CheckpointerCallback
from .comet import CometCallback, CometNotificationSetting
from .config_saver import ConfigSaverCallback
from .console_logger import ConsoleLoggerCallback
from .early_stopping import EarlyStoppingCallback, EarlyStoppingMode
from .evaluator import (
    Evaluator,
    EvaluatorCallback,
    LMEvaluator,
    LMEvaluatorCallbackConfig,
    SFTEvaluatorCallbackConfig,
)
from .gap_monitor import GAPMonitorCallback
from .garbage_collector import GarbageCollectorCallback
from .gpu_memory_monitor import GPUMemoryMonitorCallback
from .hf_converter import HFConverterCallback
from .init_weights import InitWeightsCallback
from .list_checkpointer import CheckpointRemovalStrategy, ListCheckpointerCallback
from .metric_saver import MetricSaverCallback
from .model_merge import (
    ModelMergeCallback,
    compute_merge_steps_from_decay_schedule,
    compute_merge_window_starts,
)
from .moe_load import MoELoadCallback
from .monkey_patcher import MonkeyPatcherCallback
from .notifications import NotificationSetting
from .profiler import ProfilerCallback
from .progress import ProgressCallback
from .reproducibility_check import ReproducibilityCheckCallback
from .sequence_length_scheduler import SequenceLengthSchedulerCallback
from .slack_notifier import SlackNotificationSetting, SlackNotifierCallback
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
    "CheckpointRemovalStrategy",
    "CheckpointerCallback",
    "CometCallback",
    "CometNotificationSetting",
    "ConfigSaverCallback",
    "ConsoleLoggerCallback",
    "EarlyStoppingCallback",
    "EarlyStoppingMode",
    "Evaluator",
    "EvaluatorCallback",
    "GAPMonitorCallback",
    "GPUMemoryMonitorCallback",
    "GarbageCollectorCallback",
    "HFConverterCallback",
    "InitWeightsCallback",
    "LMEvaluator",
    "LMEvaluatorCallbackConfig",
    "ListCheckpointerCallback",
    "MetricSaverCallback",
    "MoELoadCallback",
    "ModelMergeCallback",
    "MonkeyPatcherCallback",
    "NotificationSetting",
    "ProfilerCallback",
    "ProgressCallback",
    "ReproducibilityCheckCallback",
    "SFTEvaluatorCallbackConfig",
    "SequenceLengthSchedulerCallback",
    "SlackNotificationSetting",
    "SlackNotifierCallback",
    "SpeedMonitorCallback",
    "StabilityMonitorCallback",
    "StabilityPolicy",
    "TensorBoardCallback",
    "WandBCallback",
    "callback_registry",
    "compute_merge_steps_from_decay_schedule",
    "compute_merge_window_starts",
]
