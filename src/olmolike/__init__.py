"""olmolike: a composable, exact-resume trainer for language models on PyTorch."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any

__version__ = "0.1.0"

MOVED_MODULES = {
    "olmolike.train.memory_plan": "olmolike.plan.memory",
    "olmolike.train.activation_memory": "olmolike.plan.activations",
    "olmolike.train.memory_report": "olmolike.plan.report",
}
"""Modules that moved in 0.2, by their old name: the old name still imports, for one release,
and warns (``DeprecationWarning``) naming the new one. The planner left ``olmolike.train``,
which never uses it, for :mod:`olmolike.plan`. Nothing in ``train`` imports the new place: the
alias lives here, so the rooms stay ordered."""


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name of :data:`MOVED_MODULES` and gives the module under its new name."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> ModuleType:
        new = MOVED_MODULES[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new}; import it from there ({spec.name} goes in 0.3)",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        """The module was executed under its new name already."""


if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModuleFinder())
