"""Train modules: what one training step does."""

from .activation_checkpointing import ActivationCheckpointingConfig, ActivationCheckpointingMode
from .pipeline import PipelineTransformerTrainModule
from .train_module import BasicTrainModule, TrainModule
from .transformer import TransformerTrainModule, TransformerTrainModuleConfig

__all__ = [
    "ActivationCheckpointingConfig",
    "ActivationCheckpointingMode",
    "BasicTrainModule",
    "PipelineTransformerTrainModule",
    "TrainModule",
    "TransformerTrainModule",
    "TransformerTrainModuleConfig",
]
