"""OLMo-core's later callback hooks, ephemeral-checkpoint blocking, and the hook-name check.

:class:`~olmolike.train.callbacks.Callback` inherits :class:`CallbackHooks`, so every callback
has these hooks; the trainer calls them:

- ``post_checkpoint_loaded(path)`` after a checkpoint was loaded (before ``pre_train`` when
  ``fit()`` resumes);
- ``pre_log_metrics(step, metrics)`` for each step just before ``log_metrics``, with the same
  dict: change, add or remove metrics in place and every ``log_metrics`` sees the result;
- ``post_checkpoint_saved(path)`` once a checkpoint is complete (its marker written), on the
  training thread: at once for a blocking save, at the end of the next step (or before the
  callbacks close) for a background one.

A callback method that looks like a hook (``pre_*``, ``post_*``, ``on_*``) but is none of
olmolike's is an error when the callback is attached: it would silently never be called (for
example a hook of a newer OLMo-core). Methods that are helpers, not hooks, are named in the
class's ``helper_methods``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, ClassVar

from ...exceptions import ConfigurationError

if TYPE_CHECKING:
    from ..trainer import Trainer

__all__ = ["EXTRA_HOOKS", "CallbackHooks", "HookCaller", "check_hook_names", "hook_table"]

log = logging.getLogger(__name__)

EXTRA_HOOKS = ("post_checkpoint_loaded", "pre_log_metrics", "post_checkpoint_saved")
"""Hooks added to the base set, with OLMo-core's names and arguments."""

_HOOK_LIKE = re.compile(r"^(pre|post|on)_[a-z0-9_]+$")


class CallbackHooks:
    """The hooks of :data:`EXTRA_HOOKS` and ephemeral blocking, mixed into ``Callback``."""

    helper_methods: ClassVar[tuple[str, ...]] = ()
    """Methods named like hooks (``post_process``, ...) that are helpers: exempt from the
    attach-time check that every hook-like method is a real hook."""

    if TYPE_CHECKING:  # a runtime annotation would reach config type checks of every callback
        trainer: Trainer

    def post_checkpoint_loaded(self, path: str) -> None:
        """Called after a checkpoint is loaded; ``path`` is the checkpoint folder."""
        del path

    def pre_log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Called for each step right before :meth:`~olmolike.train.Callback.log_metrics`; may modify ``metrics``."""
        del step, metrics

    def post_checkpoint_saved(self, path: str) -> None:
        """Called once the checkpoint at ``path`` is complete."""
        del path

    def block_ephemeral_checkpoints(self) -> None:
        """Stop ephemeral checkpoints from being saved until :meth:`unblock_ephemeral_checkpoints`.

        For a callback whose state would be wrong to resume from mid-way (e.g. a partial
        weight average). Call it at the same step on every rank: whether a checkpoint is saved
        decides which collectives run.
        """
        name = self.trainer.get_callback_name(self)  # type: ignore[arg-type]
        self.trainer.set_ephemeral_checkpoints_blocked(name, True)

    def unblock_ephemeral_checkpoints(self) -> None:
        """Allow ephemeral checkpoints again (as far as this callback is concerned)."""
        name = self.trainer.get_callback_name(self)  # type: ignore[arg-type]
        self.trainer.set_ephemeral_checkpoints_blocked(name, False)


def check_hook_names(callbacks: Iterable[Any], known: Iterable[str]) -> None:
    """Raise if a callback has a hook-like method that the trainer would never call."""
    known = set(known)
    for callback in callbacks:
        cls = type(callback)
        exempt = set(getattr(cls, "helper_methods", ()))
        for name in dir(cls):
            if name in known or name in exempt or not _HOOK_LIKE.match(name):
                continue
            if not callable(getattr(cls, name, None)):
                continue
            raise ConfigurationError(
                f"{cls.__name__}.{name} looks like a trainer hook, but olmolike has no hook "
                f"{name!r}, so it would never be called. The hooks are: {', '.join(sorted(known))}. "
                f"If it is a helper method, list it in {cls.__name__}.helper_methods.",
                path="callbacks",
            )


def hook_table(
    callbacks: Iterable[Any], hooks: Iterable[str], base: type
) -> dict[str, list[Callable[..., None]]]:
    """For each hook, the bound methods of the callbacks that override it, by priority.

    A hook a callback does not override is left out: an empty hook costs nothing per step.
    """
    ordered = sorted(callbacks, key=lambda cb: -cb.priority)
    return {
        hook: [
            getattr(cb, hook)
            for cb in ordered
            if getattr(type(cb), hook) is not getattr(base, hook)
        ]
        for hook in hooks
    }


class HookCaller:
    """Calls a hook on the callbacks that override it, highest priority first.

    The trainer builds one and rebuilds it whenever its callbacks change; the hook names are
    checked then.
    """

    def __init__(self, callbacks: Iterable[Any], hooks: Iterable[str], base: type) -> None:
        self.hooks, self.base = list(hooks), base
        self.rebuild(callbacks)

    def rebuild(self, callbacks: Iterable[Any]) -> None:
        """Follow a change of the callbacks (components holding this caller see it too)."""
        callbacks = list(callbacks)
        check_hook_names(callbacks, self.hooks)
        self.table = hook_table(callbacks, self.hooks, self.base)

    def attach(self, trainer: Any, callbacks: Iterable[Any], new: Iterable[Any]) -> None:
        """Give the ``new`` ones among all ``callbacks`` their ``trainer``, follow the change,
        then call their ``post_attach``."""
        new = list(new)
        for callback in new:
            callback.trainer = trainer
        self.rebuild(callbacks)
        for callback in new:
            callback.post_attach()

    def __call__(self, hook: str, *args: Any) -> None:
        for method in self.table[hook]:
            method(*args)

    def deliver_metrics(self, metrics: dict[int, dict[str, float]]) -> None:
        """One collection's reduced metrics, ``{step: {name: value}}``: ``pre_log_metrics``
        and ``log_metrics`` for each step in order, then ``post_log_metrics``."""
        for step in sorted(metrics):
            self("pre_log_metrics", step, metrics[step])
            self("log_metrics", step, metrics[step])
        self("post_log_metrics")

    def call_except(self, hook: str, excluded: Iterable[Any]) -> None:
        """Call ``hook`` (without arguments) on every callback but those in ``excluded``."""
        excluded = list(excluded)
        for method in self.table[hook]:
            if not any(getattr(method, "__self__", None) is cb for cb in excluded):
                method()

    def call_each(self, hook: str, *args: Any, raise_errors: bool) -> None:
        """Call ``hook`` on every callback even if one fails (each failure is logged);
        ``raise_errors`` then raises the first failure, once every callback had its call (a
        ``close`` that fails must not leave the other callbacks open)."""
        first: Exception | None = None
        for method in self.table[hook]:
            try:
                method(*args)
            except Exception as e:
                if raise_errors and first is None:
                    first = e
                else:
                    log.exception("A callback's %s hook failed", hook)
        if raise_errors and first is not None:
            raise first
