"""Start from pretrained weights: a Hugging Face model folder or another run's checkpoint.

:func:`load_pretrained_weights` loads *weights only* (no optimizer, scheduler, data position
or step count) into a model that may be plain, wrapped in DDP or sharded with FSDP2, on one
rank or many. :func:`load_init_weights` is the start of a run: it loads them unless the run
resumed from a checkpoint. ``TransformerTrainModuleConfig.init_weights`` has the train module
call it when ``fit()`` starts; :class:`~olmolike.train.callbacks.InitWeightsCallback` does the
same for any train module with a ``model``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import io
from ..distributed.checkpoint import load_model_and_optim_state, read_metadata
from ..distributed.checkpoint_format import MODEL_AND_OPTIM
from ..distributed.utils import broadcast_object, get_rank, is_distributed
from ..exceptions import ConfigurationError
from ..nn.hf_import import (
    convert_from_hf,
    is_hf_model_dir,
    read_hf_config,
    read_hf_tensors,
    transformer_config_from_hf,
)
from ..nn.rope import RopeScalingConfig
from ..nn.transformer_config import TransformerConfig
from ..nn.transformer_stage import TransformerParts
from .checkpoint import Checkpointer

__all__ = ["load_init_weights", "load_pretrained_weights"]

log = logging.getLogger(__name__)

T = TypeVar("T")

# Fields that change what the weights compute without changing their shapes: a model that
# differs from its weights in one of these would load fine and be silently wrong.
_ARCHITECTURE_FIELDS = (
    "block_type", "qk_norm", "tie_weights", "rope_theta", "rope_scaling", "norm_eps",
)  # fmt: skip
_SHAPE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "kv_heads", "hidden_size")
# The config field that sets each derived size.
_FIELD_TO_SET = {"kv_heads": "n_kv_heads", "hidden_size": "mlp_hidden_size"}


def load_pretrained_weights(
    model: nn.Module, source: str, *, work_dir: str | Path | None = None
) -> None:
    """Load the weights of ``source`` into ``model`` in place; nothing else is touched.

    ``source`` is a Hugging Face model folder (``config.json`` + ``*.safetensors``, sharded or
    not) or an olmolike checkpoint (a ``step{N}`` folder, or a save folder: its newest
    complete checkpoint), local or remote (``gs://``, ``s3://``). ``model`` is a plain module,
    a DDP wrapper, a model sharded with FSDP2 and/or split by tensor parallelism, or what one
    pipeline rank holds (:class:`~olmolike.nn.transformer_stage.TransformerParts`: only its
    stages' tensors are loaded), already on its device; every rank must call this (it runs
    collectives when distributed). Rank 0 reads a Hugging Face folder and broadcasts it one
    tensor at a time, each rank keeping its part of each; a checkpoint is read by every rank,
    each its own shards. ``work_dir`` is where remote Hugging Face weights are downloaded to
    before reading (default: into memory).

    :raises ConfigurationError: if ``source`` is neither, or its weights do not fit ``model``
        (the message names the fields or tensors that differ).
    """
    if any(p.is_meta for p in model.parameters()):
        raise ConfigurationError(
            "the model is still on the meta device; materialise it (and shard it) before "
            "loading pretrained weights into it"
        )
    source = str(source).rstrip("/")
    resolved = _on_rank0(lambda: _resolve(source))
    assert resolved is not None
    kind, path = resolved
    if kind == "hf":
        _load_hf(model, path, work_dir)
    else:
        _load_checkpoint(model, path)
    log.info("loaded pretrained weights from %s", path)


def load_init_weights(
    model: nn.Module, source: str, *, resumed: bool, work_dir: str | Path | None = None
) -> bool:
    """A run's starting weights: :func:`load_pretrained_weights` of ``source``, unless the run
    ``resumed`` from a checkpoint, whose weights are the ones the run had reached (``source``
    is then not read at all, so it may be gone). Returns whether it loaded them."""
    if resumed:
        log.info("resumed from a checkpoint: not loading the init weights %s", source)
        return False
    load_pretrained_weights(model, source, work_dir=work_dir)
    return True


def _resolve(source: str) -> tuple[str, str]:
    if is_hf_model_dir(source):
        return "hf", source
    if Checkpointer.dir_is_checkpoint(source):
        return "checkpoint", source
    if Checkpointer.contains_checkpoint(source):
        return "checkpoint", Checkpointer.latest_checkpoint(source)
    raise ConfigurationError(
        f"{source} is neither a Hugging Face model folder (config.json and *.safetensors) nor "
        "an olmolike checkpoint (a step folder with its completion marker, or a save folder "
        "holding one); check the path"
    )


def _on_rank0(fn: Callable[[], T], *, share: bool = True) -> T | None:
    """``fn()`` on rank 0; its error is raised on every rank, its result (with ``share``)
    returned on every rank, else on rank 0 only (``None`` elsewhere).

    Every rank then acts on the same answer: listings of one folder can differ between nodes,
    and an error on rank 0 alone would leave the other ranks waiting in a collective.
    """
    result: T | None = None
    failure: Exception | None = None
    if get_rank() == 0:
        try:
            result = fn()
        except Exception as e:
            failure = e
    error = None if failure is None else f"{type(failure).__name__}: {failure}"
    shared, error = broadcast_object((result if share else None, error))
    if failure is not None:
        raise failure
    if error is not None:
        raise ConfigurationError(f"loading pretrained weights failed on rank 0: {error}")
    return shared if share else result


def _unwrapped(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DDP) else model


def _model_config(model: nn.Module) -> TransformerConfig | None:
    config = getattr(_unwrapped(model), "config", None)
    return config if isinstance(config, TransformerConfig) else None


def _check_config(model: nn.Module, weights: Mapping[str, Any], source: str) -> None:
    """Compare the model's TransformerConfig with the one the weights were trained with."""
    ours = _model_config(model)
    if ours is None:
        return
    differ = [
        name
        for name in (*_SHAPE_FIELDS, *_ARCHITECTURE_FIELDS)
        if name in weights and getattr(ours, name) != weights[name]
    ]
    if differ:
        found = "; ".join(f"{n}: {getattr(ours, n)} vs {weights[n]}" for n in differ)
        fix = " ".join(_override(n, weights[n]) for n in differ)
        raise ConfigurationError(
            f"the model is not built like the weights in {source} (model vs weights: {found}); "
            f"build it with the weights' config, e.g. with the overrides {fix}"
        )


def _override(name: str, value: Any) -> str:
    """The command-line override that sets the model config's ``name`` to ``value``."""
    if value is None:
        return f"--model.{name}=null"
    if isinstance(value, RopeScalingConfig):
        return " ".join(f"--model.{name}.{k}={v}" for k, v in vars(value).items())
    return f"--model.{_FIELD_TO_SET.get(name, name)}={value}"


def _model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state by name, unwrapped from DDP (sharded tensors stay sharded)."""
    state = get_model_state_dict(model)
    return {name: t for name, t in state.items() if isinstance(t, torch.Tensor)}


def _holds_part(model: nn.Module) -> bool:
    """Whether ``model`` is one pipeline rank's share of a model: weights it lacks are the
    other ranks', not unexpected."""
    return isinstance(_unwrapped(model), TransformerParts)


def _shape_mismatches(model: nn.Module, shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
    """Differences between the model's tensor names/shapes and ``shapes`` (no communication:
    a sharded parameter's shape is that of the full tensor)."""
    ours = {name: tuple(t.shape) for name, t in _model_tensors(model).items()}
    missing = sorted(set(ours) - set(shapes))
    unexpected = [] if _holds_part(model) else sorted(set(shapes) - set(ours))
    wrong = [f"{n} {shapes[n]} != {ours[n]}" for n in ours if n in shapes and shapes[n] != ours[n]]
    problems = []
    for label, names in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)):
        if names:
            problems.append(f"{label}: {', '.join(names[:6])}{' ...' if len(names) > 6 else ''}")
    return problems


# -- Hugging Face folders -----------------------------------------------------------------


def _load_hf(model: nn.Module, path: str, work_dir: str | Path | None) -> None:
    hf_config = read_hf_config(path)
    config = transformer_config_from_hf(hf_config)
    # Every rank checks (config.json is small): a mismatch is then the same error everywhere.
    _check_config(model, _config_fields(config), path)
    download = None if work_dir is None else Path(work_dir) / "hf-download" / path.rsplit("/")[-1]
    state: dict[str, torch.Tensor] | None = _on_rank0(
        lambda: convert_from_hf(read_hf_tensors(path, download_dir=download), config), share=False
    )
    # Every rank checks its own tensors against the names and shapes rank 0 read, and all
    # raise the same error if any rank found one (a rank alone would leave the others waiting).
    shapes = broadcast_object({n: tuple(t.shape) for n, t in (state or {}).items()})
    problems = _agreed_problems(_shape_mismatches(model, shapes))
    if problems:
        raise ConfigurationError(f"the weights in {path} do not fit the model ({problems})")
    _copy_in(model, state, shapes)


def _agreed_problems(mine: list[str]) -> str:
    """Every rank's problems, on every rank (one line; empty if none)."""
    if not is_distributed():
        return "; ".join(mine)
    everyone: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, mine)
    seen = dict.fromkeys(p for problems in everyone for p in problems)  # ordered, no repeats
    return "; ".join(seen)


@torch.no_grad()
def _copy_in(
    model: nn.Module, state: dict[str, torch.Tensor] | None, shapes: Mapping[str, tuple[int, ...]]
) -> None:
    """Copy rank 0's full tensors (``state``, ``None`` elsewhere) into the model, cast to its
    dtypes. When distributed they are broadcast one at a time in rank 0's order and every
    rank keeps its part of each, so no rank holds more than one full tensor beside its model."""
    ours = _model_tensors(model)
    device = next(iter(ours.values())).device
    dtypes = broadcast_object({n: t.dtype for n, t in (state or {}).items()})
    for name, shape in shapes.items():
        if state is not None:
            full = state.pop(name).to(device)
        else:
            full = torch.empty(shape, dtype=dtypes[name], device=device)
        if is_distributed():
            dist.broadcast(full, src=0)
        target = ours.get(name)
        if target is None:  # another pipeline rank's
            continue
        if isinstance(target, DTensor):
            mine = distribute_tensor(
                full, target.device_mesh, target.placements, src_data_rank=None
            )
            target.to_local().copy_(mine.to_local())
        else:
            target.copy_(full)


def _config_fields(config: TransformerConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in (*_SHAPE_FIELDS, *_ARCHITECTURE_FIELDS)}


# -- olmolike checkpoints -----------------------------------------------------------------


def _load_checkpoint(model: nn.Module, checkpoint: str) -> None:
    _check_config(model, _checkpoint_model_config(checkpoint), checkpoint)
    dcp_dir = io.join_path(checkpoint, MODEL_AND_OPTIM)
    problems = _agreed_problems(_shape_mismatches(model, _checkpoint_shapes(dcp_dir)))
    if problems:
        raise ConfigurationError(
            f"the weights in {checkpoint} do not fit the model ({problems}); build "
            "the model with the config that run used (its config.json)"
        )
    load_model_and_optim_state(dcp_dir, model)  # the model only: the optimizer is left fresh


def _checkpoint_shapes(dcp_dir: str) -> dict[str, tuple[int, ...]]:
    return {
        key.removeprefix("model."): tuple(meta.size)
        for key, meta in read_metadata(dcp_dir).state_dict_metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }


def _checkpoint_model_config(checkpoint: str) -> dict[str, Any]:
    """The ``model`` section of the run's ``config.json`` (in the checkpoint or its save
    folder), with the derived sizes; empty if the run saved none."""
    parent = checkpoint.rsplit("/", 1)[0] if "/" in checkpoint else "."
    for folder in (checkpoint, parent):
        path = io.join_path(folder, "config.json")
        if io.exists(path):
            section = json.loads(io.read_bytes(path)).get("model")
            if not isinstance(section, dict):
                return {}
            fields = {k: v for k, v in section.items() if k != "_CLASS_"}
            try:
                return _config_fields(TransformerConfig.from_dict(fields))
            except (ConfigurationError, TypeError):
                return {}  # not a TransformerConfig: the tensor shapes are still checked
    return {}
