"""Trainer callbacks: one module each."""

from .callback import CALLBACK_HOOKS, Callback, callback_registry
from .checkpointer import CheckpointerCallback
from .config_saver import ConfigSaverCallback
from .console_logger import ConsoleLoggerCallback
from .evaluator import Evaluator, EvaluatorCallback, LMEvaluator, LMEvaluatorCallbackConfig

__all__ = [
    "CALLBACK_HOOKS",
    "Callback",
    "CheckpointerCallback",
    "ConfigSaverCallback",
    "ConsoleLoggerCallback",
    "Evaluator",
    "EvaluatorCallback",
    "LMEvaluator",
    "LMEvaluatorCallbackConfig",
    "callback_registry",
]
