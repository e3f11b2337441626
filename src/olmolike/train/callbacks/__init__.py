"""Trainer callbacks: one module each."""

from .callback import CALLBACK_HOOKS, Callback, callback_registry
from .checkpointer import CheckpointerCallback
from .console_logger import ConsoleLoggerCallback

__all__ = [
    "CALLBACK_HOOKS",
    "Callback",
    "CheckpointerCallback",
    "ConsoleLoggerCallback",
    "callback_registry",
]
