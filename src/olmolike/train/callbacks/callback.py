"""The callback base class and registry.

A callback is a dataclass of settings whose hook methods the trainer calls at fixed points of
the loop. Hooks fire in this order::

    post_attach                      once, when the trainer is built
    pre_train                        once, at the start of fit() (after any checkpoint load)
    pre_epoch                        at the start of each epoch
      pre_load_batch                 before the next batch is fetched
      pre_step(batch)                after it is fetched, before the forward pass
      pre_optim_step                 after backward, before the optimizer step (not on skipped steps)
      post_train_batch               after the optimizer step
      post_step                      at the end of the step
      log_metrics(step, metrics)     for each step, once its metrics are collected and reduced
                                     (collected at step s: delivered at the end of step s + 1)
      post_log_metrics               after the log_metrics calls of one collection
    post_epoch                       when an epoch's batches are exhausted
    post_train                       once, when training ends normally or is canceled
    on_error(exc)                    instead of post_train, when fit() raises
    close                            always, last

Callbacks run in descending ``priority``; ties keep the order in which they were added.
OLMo-core's later hooks (``pre_log_metrics``, ``post_checkpoint_saved``,
``post_checkpoint_loaded``) are described in :mod:`.hooks`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ...config import CheckedChoices, register_config_class, require_class_name
from ...exceptions import ConfigurationError
from .hooks import CallbackHooks

if TYPE_CHECKING:
    from ..trainer import Trainer

__all__ = ["CALLBACK_HOOKS", "Callback", "callback_registry", "model_of"]

CALLBACK_HOOKS = (
    "post_attach",
    "pre_train",
    "pre_epoch",
    "pre_load_batch",
    "pre_step",
    "pre_optim_step",
    "post_train_batch",
    "post_step",
    "log_metrics",
    "post_log_metrics",
    "post_epoch",
    "post_train",
    "on_error",
    "close",
)

callback_registry: dict[str, type[Callback]] = {}
"""Callback classes by their registered name (e.g. ``"console_logger"``)."""


@dataclass
class Callback(CallbackHooks, CheckedChoices):
    """Base class for trainer callbacks. Subclasses are dataclasses of their settings.

    Register a subclass under a short name with ``class MyCallback(Callback, name="my_cb")``:
    the name can then be used as ``_CLASS_`` in config files.
    """

    priority: ClassVar[int] = 0
    """Higher priorities run first (e.g. a checkpointer should see a step before a logger)."""

    registered_name: ClassVar[str | None] = None

    def __init_subclass__(cls, name: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        register_config_class(cls, *([name] if name else []))
        if name is not None:
            existing = callback_registry.get(name)
            if existing is not None and existing.__qualname__ != cls.__qualname__:
                raise ValueError(f"callback name {name!r} is already used by {existing!r}")
            callback_registry[name] = cls
            cls.registered_name = name

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise :class:`~olmolike.exceptions.ConfigurationError` for an impossible setting."""

    @property
    def trainer(self) -> Trainer:
        trainer = self.__dict__.get("_trainer")
        if trainer is None:
            raise RuntimeError(f"{type(self).__name__} is not attached to a trainer yet")
        return trainer

    @trainer.setter
    def trainer(self, trainer: Trainer) -> None:
        self.__dict__["_trainer"] = trainer

    def train_loss_metric(self) -> str:
        """The metric holding the loss being trained: the train module's ``loss_metric``
        (``train/DPO loss`` for DPO), else OLMo-core's ``train/CE loss`` (before attaching,
        or beside a stand-in trainer whose train module names no metric, as OLMo-core's own
        tests build callbacks)."""
        trainer = self.__dict__.get("_trainer")
        named = getattr(getattr(trainer, "train_module", None), "loss_metric", None)
        return named if isinstance(named, str) and named else "train/CE loss"

    @property
    def step(self) -> int:
        return self.trainer.global_step

    def state_dict(self) -> dict[str, Any]:
        """State to save in checkpoints (plain values only)."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        del state_dict

    def post_attach(self) -> None:
        """Called once the trainer is built and the callback attached."""

    def pre_train(self) -> None:
        """Called once at the start of :meth:`Trainer.fit`, after any checkpoint load."""

    def pre_epoch(self) -> None:
        """Called at the start of each epoch."""

    def pre_load_batch(self) -> None:
        """Called before the next batch is fetched from the data loader."""

    def pre_step(self, batch: dict[str, Any]) -> None:
        """Called with the batch (already on the device) before the forward pass."""

    def pre_optim_step(self) -> None:
        """Called after backward and before the optimizer step."""

    def post_train_batch(self) -> None:
        """Called after the optimizer step."""

    def post_step(self) -> None:
        """Called at the end of each step."""

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Called for each step once its metrics have been collected and reduced.

        The metrics collected at step ``s`` arrive at the end of step ``s + 1``, the same step
        on every rank (those pending at the end of training, before ``post_train``), so a
        decision taken here may change which collectives run: every rank takes it together.
        """

    def post_log_metrics(self) -> None:
        """Called after :meth:`log_metrics` has been called for every step of a collection
        (every ``metrics_collect_interval`` steps, and at the end of training): the place to
        write out what ``log_metrics`` buffered, once per collection instead of once per step."""

    def post_epoch(self) -> None:
        """Called when the epoch's batches are exhausted."""

    def post_train(self) -> None:
        """Called once when training ends normally or is canceled."""

    def on_error(self, exc: BaseException) -> None:
        """Called when :meth:`Trainer.fit` raises, before the error propagates."""

    def close(self) -> None:
        """Called last, whether training succeeded or not: release resources here."""


register_config_class(Callback)
require_class_name(Callback)


def model_of(
    train_module: Any, *, needed_for: str = "", fix: str = "", path: str = "callbacks"
) -> torch.nn.Module:
    """The model of ``train_module`` (its ``model``), for a callback that reads or changes it.

    A train module without one is a configuration error at ``path`` (the callback's field)
    that says what the model was ``needed_for`` and how else to run (``fix``).
    """
    model = getattr(train_module, "model", None)
    if not isinstance(model, torch.nn.Module):
        need = f"needs a train module with a 'model' {needed_for}".rstrip()
        advice = f"; {fix}" if fix else ""
        raise ConfigurationError(
            f"{need}, but {type(train_module).__name__} has none{advice}", path=path
        )
    return model
