"""Pretrained weights loaded into the model when a run starts (not when it resumes), for any
train module with a ``model``. ``TransformerTrainModuleConfig.init_weights`` needs no callback:
the train module loads them itself when ``fit()`` starts (:meth:`TrainModule.on_fit_start`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ...config_dict import register_config_class
from ...exceptions import ConfigurationError
from ..weights import check_allowed_changes, load_init_weights
from .callback import Callback, model_of

__all__ = ["InitWeightsCallback"]


@dataclass
class InitWeightsCallback(Callback):
    """Loads pretrained weights into the train module's model before the first step, unless
    the run resumed from a checkpoint (which then has the weights the run had reached)."""

    source: str = ""
    """A Hugging Face model folder or an olmolike checkpoint / save folder."""
    allowed_changes: list[str] = field(default_factory=list)
    """Model config fields that may differ from the config the weights were trained with
    (see ``TransformerTrainModuleConfig.init_weights_allowed_changes``)."""

    priority: ClassVar[int] = 100
    """Before anything looks at the model at the start: evaluators, the step-0 checkpoint."""

    def validate(self) -> None:
        if not self.source:
            raise ConfigurationError(
                "must name a Hugging Face model folder or an olmolike checkpoint", path="source"
            )
        check_allowed_changes(self.allowed_changes)

    def pre_train(self) -> None:
        model = model_of(
            self.trainer.train_module,
            needed_for="to load pretrained weights into",
            path="init_weights",
        )
        load_init_weights(
            model,
            self.source,
            resumed=self.trainer.checkpoint_loaded,
            work_dir=self.trainer.work_dir,
            allowed_changes=self.allowed_changes,
        )


# Its name before it moved here from olmolike.train.weights, for configs written then.
register_config_class(InitWeightsCallback, "olmolike.train.weights.InitWeightsCallback")
