"""The trainer's own part of a checkpoint: its counters, the data loader's position, the RNG
states and each callback's state (the model and optimizer are the train module's)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ..distributed.utils import get_world_size
from ..utils import get_rng_state, set_rng_state

if TYPE_CHECKING:
    from .trainer import Trainer

__all__ = ["TrainerStateDict", "load_trainer_state_dict", "trainer_state_dict"]

log = logging.getLogger(__name__)

TrainerStateDict = dict[str, Any]


def trainer_state_dict(trainer: Trainer) -> TrainerStateDict:
    """What :meth:`Trainer.state_dict` saves."""
    return {
        "global_step": trainer.global_step,
        "global_train_tokens_seen": trainer.global_train_tokens_seen,
        "global_train_petaflops": trainer.global_train_petaflops,
        "epoch": trainer.epoch,
        "world_size": get_world_size(),
        "data_loader": trainer.data_loader.state_dict(),
        "rng": get_rng_state(),
        "callbacks": {name: cb.state_dict() for name, cb in trainer.callbacks.items()},
    }


def load_trainer_state_dict(trainer: Trainer, state_dict: TrainerStateDict) -> None:
    """Restore into ``trainer`` what :func:`trainer_state_dict` saved. RNG states are restored
    only at the world size they were saved at (each rank's state belongs to its rank)."""
    trainer.global_step = state_dict["global_step"]
    trainer.global_train_tokens_seen = state_dict["global_train_tokens_seen"]
    trainer.global_train_petaflops = state_dict["global_train_petaflops"]
    trainer.epoch = state_dict["epoch"]
    trainer.data_loader.load_state_dict(state_dict["data_loader"])
    if state_dict.get("world_size", get_world_size()) == get_world_size():
        set_rng_state(state_dict["rng"])
    else:
        log.warning("World size changed since the checkpoint: RNG states are not restored")
    for name, cb_state in state_dict.get("callbacks", {}).items():
        if name in trainer.callbacks:
            trainer.callbacks[name].load_state_dict(cb_state)
