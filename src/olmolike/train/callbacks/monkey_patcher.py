"""Process-wide performance patches to PyTorch, applied for the length of training."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.device_mesh import DeviceMesh

from .callback import Callback

__all__ = ["MonkeyPatcherCallback"]

log = logging.getLogger(__name__)


@dataclass
class MonkeyPatcherCallback(Callback, name="monkey_patcher"):
    """Caches ``DeviceMesh.__getitem__``: FSDP asks for the same sub-mesh (``mesh["dp"]``)
    very often, and each call builds a new sub-mesh object, which shows up in profiles of
    large runs. A mesh never changes once built, so the cached sub-mesh is the same one.

    The patch is undone in ``close``.
    """

    enabled: bool = True
    """``False`` turns the callback off while keeping it in the config (an override can turn it back
    on)."""

    _original: Callable[..., Any] | None = field(default=None, init=False, repr=False)

    def pre_train(self) -> None:
        if not self.enabled or self._original is not None:
            return
        original = DeviceMesh.__getitem__
        if hasattr(original, "cache_info"):
            return  # already patched (e.g. by another trainer in this process)
        self._original = original
        DeviceMesh.__getitem__ = functools.lru_cache(maxsize=None)(original)  # type: ignore[method-assign]
        log.info("DeviceMesh.__getitem__ now caches sub-meshes")

    def close(self) -> None:
        if self._original is not None:
            DeviceMesh.__getitem__ = self._original  # type: ignore[method-assign]
            self._original = None
