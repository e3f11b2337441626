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
from collections.abc import Callable, Collection, Mapping
from dataclasses import fields
from pathlib import Path
from typing import TypeVar

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
from ..nn.moe import MoEConfig
from ..nn.transformer_config import TransformerConfig, computation_changes, model_override
from ..nn.transformer_stage import TransformerParts
from .checkpoint import Checkpointer

__all__ = ["check_allowed_changes", "load_init_weights", "load_pretrained_weights"]

log = logging.getLogger(__name__)

T = TypeVar("T")


def load_pretrained_weights(
    model: nn.Module,
    source: str,
    *,
    work_dir: str | Path | None = None,
    allowed_changes: Collection[str] = (),
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
    before reading (default: into memory). ``allowed_changes``: model config fields that may
    differ from the weights' config on purpose (the tensor shapes must still fit).

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
    allowed = check_allowed_changes(allowed_changes)
    if kind == "hf":
        _load_hf(model, path, work_dir, allowed)
    else:
        _load_checkpoint(model, path, allowed)
    log.info("loaded pretrained weights from %s", path)


def load_init_weights(
    model: nn.Module,
    source: str,
    *,
    resumed: bool,
    work_dir: str | Path | None = None,
    allowed_changes: Collection[str] = (),
) -> bool:
    """A run's starting weights: :func:`load_pretrained_weights` of ``source``, unless the run
    ``resumed`` from a checkpoint, whose weights are the ones the run had reached (``source``
    is then not read at all, so it may be gone). Returns whether it loaded them."""
    if resumed:
        log.info("resumed from a checkpoint: not loading the init weights %s", source)
        return False
    load_pretrained_weights(model, source, work_dir=work_dir, allowed_changes=allowed_changes)
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


def check_allowed_changes(names: Collection[str], path: str = "allowed_changes") -> set[str]:
    """``names`` as a set, each checked to be a :class:`TransformerConfig` field (or
    ``moe.<field>``, a field of its :class:`~olmolike.nn.moe.MoEConfig`)."""
    known = {f.name for f in fields(TransformerConfig)} | {
        f"moe.{f.name}" for f in fields(MoEConfig)
    }
    unknown = sorted(set(names) - known)
    if unknown:
        raise ConfigurationError(
            f"{', '.join(unknown)} is no model config field; name fields of TransformerConfig "
            f"({', '.join(sorted(known))})",
            path=path,
        )
    return set(names)


def _check_config(
    model: nn.Module, weights: TransformerConfig | None, source: str, allowed: Collection[str]
) -> None:
    """Compare the model's TransformerConfig with the one the weights were trained with
    (:func:`~olmolike.nn.transformer_config.computation_changes`); fields in ``allowed`` may
    differ."""
    ours = _model_config(model)
    if ours is None or weights is None:
        return
    changed = computation_changes(weights, ours)
    differ = [name for name in changed if name not in allowed]

    def listed(names: Collection[str]) -> str:
        return "; ".join(f"{n}: {changed[n][1]!r} vs {changed[n][0]!r}" for n in names)

    if differ:
        fix = " ".join(model_override(n, changed[n][0]) for n in differ)
        raise ConfigurationError(
            f"the model is not built like the weights in {source} (model vs weights: "
            f"{listed(differ)}); build it with the weights' config, e.g. with the overrides "
            f"{fix}, or, to start from them under this config on purpose, allow the "
            f"difference: --train_module.init_weights_allowed_changes=[{','.join(differ)}]"
        )
    if changed:
        log.warning(
            "starting from the weights in %s under other model settings, as allowed "
            "(model vs weights): %s",
            source,
            listed(changed),
        )


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


def _load_hf(
    model: nn.Module, path: str, work_dir: str | Path | None, allowed: Collection[str]
) -> None:
    hf_config = read_hf_config(path)
    config = transformer_config_from_hf(hf_config)
    # Every rank checks (config.json is small): a mismatch is then the same error everywhere.
    _check_config(model, config, path, allowed)
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


# -- olmolike checkpoints -----------------------------------------------------------------


def _load_checkpoint(model: nn.Module, checkpoint: str, allowed: Collection[str]) -> None:
    _check_config(model, _checkpoint_model_config(checkpoint), checkpoint, allowed)
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


def _checkpoint_model_config(checkpoint: str) -> TransformerConfig | None:
    """The ``model`` section of the run's ``config.json`` (in the checkpoint or its save
    folder); ``None`` if the run saved none, or another kind of model config."""
    parent = checkpoint.rsplit("/", 1)[0] if "/" in checkpoint else "."
    for folder in (checkpoint, parent):
        path = io.join_path(folder, "config.json")
        if io.exists(path):
            section = json.loads(io.read_bytes(path)).get("model")
            if not isinstance(section, dict):
                return None
            fields = {k: v for k, v in section.items() if k != "_CLASS_"}
            try:
                return TransformerConfig.from_dict(fields)
            except (ConfigurationError, TypeError):
                return None  # not a TransformerConfig: the tensor shapes are still checked
    return None
