"""Trainer callbacks: one module each."""

from .callback import CALLBACK_HOOKS, Callback, callback_registry
from .console_logger import ConsoleLoggerCallback

__all__ = ["CALLBACK_HOOKS", "Callback", "ConsoleLoggerCallback", "callback_registry"]
