"""What the checkpoint package needs of a train module: its state, to save and to load into.

A protocol, so that the package depends on nothing above it: any
:class:`~olmolike.train.train_module.TrainModule` is one.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["Checkpointable"]


class Checkpointable(Protocol):
    """The state a checkpoint holds besides the trainer's: model and optimizer."""

    def state_dict_to_save(self) -> dict[str, Any]:
        """The state to save (DCP state dict, tensors possibly sharded)."""
        ...

    def state_dict_to_load(self, optim: bool = True) -> dict[str, Any]:
        """The state DCP loads into, in place (with the optimizer's when ``optim``)."""
        ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Apply a loaded state."""
        ...
