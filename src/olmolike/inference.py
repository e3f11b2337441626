"""Use a training checkpoint outside training: load its model and tokenizer, sample, export.

A checkpoint (``{save_folder}/step{N}``) holds the weights; the experiment's ``config.json``
(written by :class:`~olmolike.train.callbacks.ConfigSaverCallback`) in the checkpoint folder
or the save folder above it says how to build the model and which tokenizer it was trained with.

A model too large for one device is loaded split over ``tensor_parallel`` ranks (``olmolike
generate --tp N`` under ``torchrun --nproc-per-node=N``): DCP reads a checkpoint of any layout
into the split model, and every rank samples the same tokens (:mod:`olmolike.nn.generation`).
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from . import io
from .data.numpy_dataset import NumpyDatasetConfig
from .data.tokenizer import Tokenizer, TokenizerConfig
from .distributed.checkpoint import load_model_and_optim_state
from .distributed.checkpoint_format import MODEL_AND_OPTIM
from .distributed.utils import get_world_size, is_distributed
from .exceptions import CheckpointError, ConfigurationError, DataError
from .nn import Transformer, TransformerConfig
from .nn.generation import generate
from .nn.hf_export import export_hf
from .nn.parallel_plan import apply_tensor_parallel
from .train.callbacks.evaluator import LMEvaluator
from .train.checkpoint import Checkpointer
from .train.train_module import BasicTrainModule

__all__ = [
    "LoadedCheckpoint",
    "evaluate_checkpoint",
    "evaluate_command",
    "export_checkpoint_to_hf",
    "generate_text",
    "load_checkpoint_model",
]

log = logging.getLogger(__name__)

CONFIG_NAME = "config.json"


@dataclass
class LoadedCheckpoint:
    model: Transformer
    tokenizer: Tokenizer
    config: dict[str, Any]
    """The experiment config the checkpoint was trained with, as plain values."""


def find_experiment_config(checkpoint: str) -> dict[str, Any]:
    """The ``config.json`` in ``checkpoint`` or in the save folder that contains it."""
    parent = checkpoint.rstrip("/").rsplit("/", 1)[0] if "/" in checkpoint.rstrip("/") else "."
    for folder in (checkpoint, parent):
        path = io.join_path(folder, CONFIG_NAME)
        if io.exists(path):
            return dict(json.loads(io.read_bytes(path)))
    raise CheckpointError(
        f"no {CONFIG_NAME} in {checkpoint} or its parent folder, so the model's shape is unknown. "
        "Train with ConfigSaverCallback (the train_lm example adds it), or write the experiment "
        "config (with its 'model' and 'tokenizer' sections) there."
    )


def resolve_checkpoint(path: str) -> str:
    """``path`` if it is a complete checkpoint, else the newest complete one under it."""
    if Checkpointer.dir_is_checkpoint(path):
        return path
    try:
        latest = Checkpointer.latest_checkpoint(path)
    except FileNotFoundError:
        raise CheckpointError(
            f"{path} is neither a complete checkpoint nor a save folder holding one; pass a "
            "step folder such as runs/my-run/step1000 or the run's save folder"
        ) from None
    log.info("Using the newest checkpoint in %s: %s", path, latest)
    return latest


def load_checkpoint_model(
    checkpoint: str | Path, *, device: torch.device | str = "cpu", tensor_parallel: int = 1
) -> LoadedCheckpoint:
    """Build the model a checkpoint was trained with and load its weights.

    ``checkpoint`` is a checkpoint folder (``.../step1000``) or a save folder, which means its
    newest complete checkpoint. Without ``tensor_parallel`` no process group is needed; with
    ``tensor_parallel=N`` the model is split over the N ranks of the job (every rank calls
    this), each materialising and loading only its own shards.
    """
    checkpoint = resolve_checkpoint(str(checkpoint))
    weights = io.join_path(checkpoint, MODEL_AND_OPTIM)
    config = find_experiment_config(checkpoint)
    for section in ("model", "tokenizer"):
        if section not in config:
            raise CheckpointError(
                f"the experiment config of {checkpoint} has no {section!r} section"
            )
    model_config = TransformerConfig.from_dict(_without_class(config["model"]), path="model")
    model = model_config.build(init_device="meta")
    if tensor_parallel > 1:
        apply_tensor_parallel(model, _tensor_parallel_mesh(tensor_parallel, torch.device(device)))
    model = model.materialize(torch.device(device))
    load_model_and_optim_state(weights, model)
    model.eval()
    tokenizer = TokenizerConfig.from_dict(_without_class(config["tokenizer"])).build()
    return LoadedCheckpoint(model, tokenizer, config)


def _tensor_parallel_mesh(degree: int, device: torch.device) -> DeviceMesh:
    """A 1-D mesh over every rank of the job, which must have ``degree`` ranks."""
    world = get_world_size() if is_distributed() else 1
    if world != degree:
        raise ConfigurationError(
            f"splits the model over {degree} ranks, but this job has {world}: start "
            f"{degree} ranks (olmolike generate --nproc-per-node={degree} CHECKPOINT --tp "
            f"{degree}, or torchrun --nproc-per-node={degree} -m olmolike generate CHECKPOINT "
            f"--tp {degree}), or drop --tp",
            path="tp",
        )
    return init_device_mesh(device.type, (degree,), mesh_dim_names=("tp",))


def _without_class(section: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in section.items() if k != "_CLASS_"}


def generate_text(
    loaded: LoadedCheckpoint,
    prompt: str,
    *,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = 40,
    top_p: float | None = None,
    seed: int = 0,
    use_cache: bool = True,
) -> str:
    """Sample a continuation of ``prompt``; returns only the new text.

    The prompt is preceded by the end-of-document token, as every document was in training,
    so an empty prompt samples the start of a new document. Only the tokenizer's ids are
    sampled: a model's vocabulary is usually padded past it (to a multiple of 128, for fast
    matmuls), and an early checkpoint or a high temperature could otherwise pick a padding id
    the tokenizer cannot decode.
    """
    tokenizer = loaded.tokenizer
    ids = torch.tensor([tokenizer.eos_token_id, *tokenizer.encode(prompt)], dtype=torch.long)
    device = next(loaded.model.parameters()).device
    out = generate(
        loaded.model,
        ids.to(device),
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_token_id=tokenizer.eos_token_id,
        vocab_size=tokenizer.vocab_size,
        generator=torch.Generator(device=device).manual_seed(seed),
        use_cache=use_cache,
    )
    return tokenizer.decode(out.reshape(-1)[ids.numel() :].tolist())


def export_checkpoint_to_hf(
    checkpoint: str | Path, output_dir: str | Path, *, overwrite: bool = False
) -> Path:
    """Write a checkpoint's model as Hugging Face Llama or OLMo-2 (safetensors + config.json)."""
    loaded = load_checkpoint_model(checkpoint)
    tokenizer = loaded.tokenizer
    return export_hf(
        loaded.model.state_dict(),
        loaded.model.config,
        output_dir,
        overwrite=overwrite,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )


def evaluate_checkpoint(
    checkpoint: str | Path,
    data: Sequence[str],
    *,
    sequence_length: int | None = None,
    batch_size: int = 8,
    max_batches: int | None = None,
    device: torch.device | str = "cpu",
) -> dict[str, float]:
    """Mean next-token cross-entropy (``"CE loss"``) and perplexity (``"PPL"``) over token data.

    The numbers are those the in-training :class:`~olmolike.train.callbacks.LMEvaluatorCallbackConfig`
    reports (the same :class:`~olmolike.train.callbacks.evaluator.LMEvaluator` computes them),
    so a checkpoint can be scored on new data after the run. ``data`` are token files, folders
    or globs as in :class:`~olmolike.data.numpy_dataset.NumpyDatasetConfig`;
    ``sequence_length`` defaults to the experiment config's ``dataset.sequence_length``.
    """
    if not data:
        raise ConfigurationError("must name at least one token file, folder or glob", path="data")
    if batch_size < 1:
        raise ConfigurationError(f"must be >= 1, got {batch_size}", path="batch_size")
    if max_batches is not None and max_batches < 1:
        raise ConfigurationError(
            f"must be >= 1 or None (all the data), got {max_batches}", path="max_batches"
        )
    if sequence_length is not None and sequence_length < 1:
        raise ConfigurationError(f"must be >= 1, got {sequence_length}", path="sequence_length")
    loaded = load_checkpoint_model(checkpoint, device=device)
    model = loaded.model
    seq_len = (
        sequence_length if sequence_length is not None else _config_sequence_length(loaded.config)
    )
    if seq_len > model.config.max_sequence_length:
        raise ConfigurationError(
            f"{seq_len} is longer than the model's max_sequence_length "
            f"({model.config.max_sequence_length}); pass a shorter --sequence-length",
            path="sequence_length",
        )
    dataset = NumpyDatasetConfig(paths=list(data), sequence_length=seq_len).build()
    if dataset.vocab_size is not None and dataset.vocab_size > model.config.vocab_size:
        raise DataError(
            f"the data's vocabulary ({dataset.vocab_size} ids, from its metadata.json) is larger "
            f"than the model's ({model.config.vocab_size}); it was tokenized with another "
            "tokenizer than the one this model was trained with"
        )
    # The evaluator drives a train module; plain SGD has no state, so this one costs nothing.
    module = BasicTrainModule(
        model, torch.optim.SGD(model.parameters(), lr=0.0), rank_microbatch_size=seq_len
    )
    evaluator = LMEvaluator(
        "lm",
        dataset,
        rank_batch_instances=batch_size,
        max_batches=max_batches,
        device=torch.device(device),
    )
    return {name: float(value) for name, value in evaluator.evaluate(module).items()}


def _config_sequence_length(config: dict[str, Any]) -> int:
    dataset = config.get("dataset")
    value = dataset.get("sequence_length") if isinstance(dataset, dict) else None
    if not isinstance(value, int):
        raise ConfigurationError(
            "is not given and the experiment config has no dataset.sequence_length; pass "
            "--sequence-length (e.g. the length the model was trained on)",
            path="sequence_length",
        )
    return value


def evaluate_command(args: argparse.Namespace) -> int:
    """``olmolike evaluate`` (its arguments: :mod:`olmolike.cli_args`)."""
    metrics = evaluate_checkpoint(
        args.checkpoint,
        args.data,
        sequence_length=args.sequence_length,
        batch_size=args.batch_size,
        max_batches=args.max_batches,
        device=args.device,
    )
    for name, value in metrics.items():
        print(f"{name}: {value:.6f}")
    return 0
