"""Train modules: what one training step does."""

from .pipeline import PipelineTransformerTrainModule
from .train_module import BasicTrainModule, TrainModule
from .transformer import (
    ActivationCheckpointingConfig,
    ActivationCheckpointingMode,
    TransformerTrainModule,
    TransformerTrainModuleConfig,
)

__all__ = [
    "ActivationCheckpointingConfig",
    "ActivationCheckpointingMode",
    "BasicTrainModule",
    "PipelineTransformerTrainModule",
    "TrainModule",
    "TransformerTrainModule",
    "TransformerTrainModuleConfig",
]
