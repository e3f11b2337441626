"""Python garbage collection at fixed steps instead of whenever the allocator decides."""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass, field

from ...exceptions import ConfigurationError
from .callback import Callback

__all__ = ["GarbageCollectorCallback"]

log = logging.getLogger(__name__)


@dataclass
class GarbageCollectorCallback(Callback, name="garbage_collector"):
    """Turns automatic garbage collection off for training and collects every ``gc_interval``.

    A training step allocates many short-lived Python objects, so the automatic collector
    runs often and at unpredictable moments; an older-generation pass can take long enough
    to stall the step. With several ranks, a stall on one rank holds every other rank at
    the next collective. Collecting on the same steps everywhere puts all ranks' pauses in
    the same place. Automatic collection is restored when training ends (in ``close``,
    which runs after an error too), unless it was already off before. A collection also runs
    after each completed checkpoint save, which leaves much garbage behind.
    """

    gc_interval: int = 1000
    """Steps between collections."""
    generation: int = 1
    """The oldest generation to collect (0-2): 2 is a full pass, slower but thorough."""
    enabled: bool = True
    """``False`` leaves garbage collection alone (e.g. to switch the default one off)."""

    _restore: bool = field(default=False, init=False, repr=False)

    def validate(self) -> None:
        if self.gc_interval < 1:
            raise ConfigurationError(f"must be >= 1, got {self.gc_interval}", path="gc_interval")
        if self.generation not in (0, 1, 2):
            raise ConfigurationError(
                f"must be 0, 1 or 2 (2 collects everything), got {self.generation}",
                path="generation",
            )

    def pre_train(self) -> None:
        if not self.enabled:
            return
        self._restore = gc.isenabled()
        gc.disable()
        log.info(
            "Automatic garbage collection is off; collecting generation %d every %d steps",
            self.generation,
            self.gc_interval,
        )

    def post_step(self) -> None:
        if self.enabled and self.step % self.gc_interval == 0:
            gc.collect(self.generation)

    def post_checkpoint_saved(self, path: str) -> None:
        if self.enabled:
            gc.collect(self.generation)

    def close(self) -> None:
        if self._restore:
            gc.enable()
            self._restore = False
