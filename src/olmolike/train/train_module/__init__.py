"""Train modules: what one training step does."""

from .train_module import BasicTrainModule, TrainModule

__all__ = ["BasicTrainModule", "TrainModule"]
