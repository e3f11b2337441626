"""The final model, also written in Hugging Face format when training ends."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from ... import io
from ...config import DType
from ...distributed.utils import barrier, get_rank, is_distributed
from ...exceptions import ConfigurationError
from ...nn.hf_export import export_hf
from ...nn.transformer import Transformer
from ...nn.transformer_config import TransformerConfig
from .callback import Callback, model_of

__all__ = ["HFConverterCallback"]

log = logging.getLogger(__name__)


@dataclass
class HFConverterCallback(Callback, name="hf_converter"):
    """Writes the weights of the final step as a Hugging Face model folder (safetensors and
    ``config.json``) to ``output_folder``, by default ``{save_folder}/step{N}-hf`` beside the
    final checkpoint, when training ends (also when it is canceled).

    Needs an :class:`olmolike.nn.Transformer` model (see :func:`olmolike.nn.hf_export.export_hf`
    for the architectures). Every rank takes part (a sharded model is gathered); rank 0 writes.
    Tokenizer files are not written (olmolike downloads nothing): copy yours beside the weights.
    OLMo-core's ``validate``, ``debug``, ``device``, ``tokenizer_id`` and
    ``moe_capacity_factor`` keys are accepted in config files and ignored.
    """

    priority: ClassVar[int] = -1  # after the checkpointer has saved the final step
    _IGNORE_FIELDS: ClassVar[tuple[str, ...]] = (
        "validate",
        "debug",
        "device",
        "tokenizer_id",
        "moe_capacity_factor",
    )

    enabled: bool = True
    """``False`` turns the callback off while keeping it in the config (an override can turn it back
    on)."""
    output_folder: str | None = None
    """Local directory or URL for the model; default ``{save_folder}/step{N}-hf``."""
    dtype: DType | None = DType.bfloat16
    """The dtype of the written weights; ``None`` keeps the training dtype."""
    max_sequence_length: int | None = None
    """Recorded in ``config.json`` instead of the model's own maximum."""
    eos_token_id: int | None = None
    """The end-of-text token id recorded in ``config.json`` (``eos_token_id``); ``None`` leaves it
    out."""
    bos_token_id: int | None = None
    """The beginning-of-text token id recorded in ``config.json`` (``bos_token_id``); ``None``
    leaves it out."""

    def post_attach(self) -> None:
        if self.enabled:
            self._config()  # a model that cannot be exported fails when the trainer is built

    def _model(self) -> torch.nn.Module:
        return model_of(self.trainer.train_module, path="callbacks.hf_converter")

    def _config(self) -> TransformerConfig:
        model = getattr(self.trainer.train_module, "model", None)
        if not isinstance(model, Transformer):
            raise ConfigurationError(
                f"exports olmolike.nn.Transformer models, not {type(model).__name__}",
                path="callbacks.hf_converter",
            )
        config = model.config
        if self.max_sequence_length is not None:
            config = config.replace(max_sequence_length=self.max_sequence_length)
        return config

    def post_train(self) -> None:
        if not self.enabled:
            return
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        # A collective when the model is sharded; rank 0 gets the whole tensors.
        gathered = get_model_state_dict(self._model(), options=options)
        if get_rank() == 0:
            state = {k: v for k, v in gathered.items() if isinstance(v, torch.Tensor)}
            if self.dtype is not None:
                dtype = self.dtype.as_pt()
                state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
            self._write(state)
        if is_distributed():
            barrier()

    def _write(self, state: dict[str, torch.Tensor]) -> None:
        trainer = self.trainer
        target = self.output_folder or io.join_path(
            trainer.save_folder, f"step{trainer.global_step}-hf"
        )
        overwrite = trainer.save_overwrite
        if not io.is_url(target):
            export_hf(state, self._config(), target, overwrite=overwrite, **self._token_ids())
            log.info("Wrote the final model in Hugging Face format to %s", target)
            return
        # export_hf writes locally: stage in the work dir, then upload.
        name = target.rstrip("/").rsplit("/", 1)[-1]
        staging = Path(trainer.work_dir) / "hf-export"
        export_hf(state, self._config(), staging / name, overwrite=True, **self._token_ids())
        io.persist(staging, target.rstrip("/").rsplit("/", 1)[0], name, overwrite=overwrite)
        log.info("Wrote the final model in Hugging Face format to %s", target)

    def _token_ids(self) -> dict[str, int | None]:
        return {"eos_token_id": self.eos_token_id, "bos_token_id": self.bos_token_id}
