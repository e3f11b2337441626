"""Pretrained weights loaded into the model when a run starts (not when it resumes), for any
train module with a ``model``. ``TransformerTrainModuleConfig.init_weights`` needs no callback:
the train module loads them itself when ``fit()`` starts (:meth:`TrainModule.on_fit_start`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...config_dict import register_config_class
from ...exceptions import ConfigurationError
from ..weights import load_init_weights
from .callback import Callback, model_of

__all__ = ["InitWeightsCallback"]


@dataclass
class InitWeightsCallback(Callback):
    """Loads pretrained weights into the train module's model before the first step, unless
    the run resumed from a checkpoint (which then has the weights the run had reached)."""

    source: str = ""
    """A Hugging Face model folder or an olmolike checkpoint / save folder."""

    priority: ClassVar[int] = 100
    """Before anything looks at the model at the start: evaluators, the step-0 checkpoint."""

    def validate(self) -> None:
        if not self.source:
            raise ConfigurationError(
                "must name a Hugging Face model folder or an olmolike checkpoint", path="source"
            )

    def pre_train(self) -> None:
        model = model_of(
            self.trainer.train_module,
            needed_for="to load pretrained weights into",
            path="init_weights",
        )
        resumed = self.trainer.checkpoint_loaded
        load_init_weights(model, self.source, resumed=resumed, work_dir=self.trainer.work_dir)


# Its name before it moved here from olmolike.train.weights, for configs written then.
register_config_class(InitWeightsCallback, "olmolike.train.weights.InitWeightsCallback")
