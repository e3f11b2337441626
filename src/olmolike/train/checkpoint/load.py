"""Loading a train checkpoint (the read side of :mod:`~olmolike.train.checkpoint`'s format).

Nothing is applied before every rank has checked the whole checkpoint as it sees it, and all
ranks agree on the outcome in one all-gather: the marker, DCP's metadata, that every shard it
references is there with its bytes, that every rank's trainer state is there, and the trainer
state this rank will load, read and checked. Then DCP reads model and optimizer state into
the train module's tensors, in place, checking each record's CRC as it reads (see
:mod:`~olmolike.distributed.checkpoint_loading`). Damage found there (DCP tells every rank)
has already overwritten some tensors: the caller that falls back to another checkpoint
(:meth:`~olmolike.train.checkpoint.run.RunCheckpoints.resume`) resets what that one
may not hold.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ... import io
from ...distributed.checkpoint import load_state_dict
from ...distributed.checkpoint_download import local_copy
from ...distributed.checkpoint_format import (
    MODEL_AND_OPTIM,
    CheckedCheckpoint,
    DamagedCheckpointError,
    load_train_state,
    verify_checkpoint,
)
from ...distributed.checkpoint_save import describe_error
from ...distributed.utils import gather_objects, get_rank, using_group
from ...exceptions import CheckpointError, ConfigurationError
from ...nn.transformer_config import TransformerConfig, computation_changes, model_override

if TYPE_CHECKING:
    from .checkpointable import Checkpointable

__all__ = ["CheckpointLoad", "describe_computation_change", "describe_shape_mismatch"]


@dataclass
class CheckpointLoad:
    """One load of the checkpoint ``dir`` into ``train_module``, on every rank of ``group``."""

    dir: str
    """The checkpoint folder (``step{N}``), local or a URL."""
    train_module: Checkpointable
    """What the model and optimizer state are read into, in place."""
    group: dist.ProcessGroup | None
    """The process group of the ranks that load together (``None``: the default group)."""
    load_trainer_state: bool | None
    """Whether to read the trainer state too; ``None``: if the checkpoint has it."""
    load_optim_state: bool | None
    """Whether to read the optimizer state; ``None``: if the checkpoint has it."""
    current_config: str | bytes | None
    """This run's ``config.json`` (``None`` if it has none): a checkpoint whose model config differs
    is refused, naming the fields."""

    def run(self, work_dir: Path, pre_download: bool, thread_count: int | None) -> Any:
        """Load; returns this rank's trainer state (``None`` if not loaded). ``pre_download``
        copies a remote checkpoint under ``work_dir`` first."""
        checked, train_state = self._verify()
        if not (io.is_url(self.dir) and pre_download):
            self._load_from(self.dir, checked.metadata, thread_count)
            return train_state
        with local_copy(
            self.dir, work_dir, process_group=self.group, thread_count=thread_count
        ) as source:
            self._load_from(source, checked.metadata, thread_count)
        return train_state

    def _verify(self) -> tuple[CheckedCheckpoint, dict[str, Any] | None]:
        """Check the checkpoint on this rank, then agree: every rank raises the error of the
        lowest rank that found one (so all fall back alike), or none does."""
        result: tuple[CheckedCheckpoint, dict[str, Any] | None] | None = None
        found: tuple[bool, str] | None = None
        try:
            checked = verify_checkpoint(self.dir)
            result = (checked, self._read_train_state(checked))
        except Exception as e:  # every rank raises, not only this one
            found = (isinstance(e, DamagedCheckpointError), str(e))
        with using_group(self.group, "checkpointer"):
            errors = gather_objects(found, self.group)
        failed = [rank for rank, error in enumerate(errors) if error is not None]
        if failed:
            damaged, message = errors[failed[0]]
            if len(failed) < len(errors):  # e.g. a file one node sees differently
                message += f" (as rank {failed[0]} sees it)"
            raise (DamagedCheckpointError if damaged else CheckpointError)(message)
        assert result is not None
        return result

    def _read_train_state(self, checked: CheckedCheckpoint) -> dict[str, Any] | None:
        if self.load_trainer_state is False:
            return None
        rank = get_rank()
        # A checkpoint of fewer ranks: a new rank starts from rank 0's state.
        return load_train_state(self.dir, rank if rank < checked.marker["world_size"] else 0)

    def _load_from(self, source: str, metadata: Metadata, thread_count: int | None) -> None:
        dir, train_module = self.dir, self.train_module
        load_optim_state = self.load_optim_state
        has_optim = any(key.startswith("optim.") for key in metadata.state_dict_metadata)
        if load_optim_state and not has_optim:
            raise CheckpointError(f"{dir} holds no optimizer state; set load_optim_state=False")
        state = train_module.state_dict_to_load(
            optim=has_optim if load_optim_state is None else load_optim_state
        )
        model_state = state.get("model", {})
        # Under pipeline parallelism each rank holds some of the parameters: the checkpoint
        # must match what all ranks hold together.
        with using_group(self.group, "checkpointer"):
            held = set().union(*gather_objects(sorted(model_state), self.group))
        mismatch = describe_shape_mismatch(
            dir, metadata, model_state, self.current_config, held_elsewhere=held
        )
        if mismatch is not None:
            raise CheckpointError(mismatch)
        change = describe_computation_change(dir, self.current_config)
        if change is not None:
            raise CheckpointError(change)
        dcp_dir = io.join_path(source, MODEL_AND_OPTIM)
        try:
            load_state_dict(dcp_dir, state, process_group=self.group, thread_count=thread_count)
        except (Exception, CheckpointException) as e:  # raised on every rank alike
            damage = _damage(e)
            if damage is not None:
                raise DamagedCheckpointError(f"checkpoint {dir}: {damage}") from None
            raise CheckpointError(f"loading checkpoint {dir} failed: {describe_error(e)}") from None
        train_module.load_state_dict(state)


def _damage(error: BaseException) -> str | None:
    """The damage to the shards that DCP's ``error`` reports (the lowest rank's), if it is
    damage: DCP gathers every rank's failure, so every rank finds the same."""
    failures = error.failures if isinstance(error, CheckpointException) else {0: error}
    for _, failure in sorted(failures.items()):
        cause = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(cause, DamagedCheckpointError):
            return f"shard {MODEL_AND_OPTIM}/{cause}"
        if isinstance(cause, FileNotFoundError):  # removed since it was checked
            return f"a shard is missing ({cause})"
    return None


def describe_shape_mismatch(
    dir: str,
    metadata: Metadata,
    model_state: dict[str, Any],
    current_config: str | bytes | None,
    held_elsewhere: Collection[str] = (),
) -> str | None:
    """A message naming the config fields, then the tensors, whose shapes differ, or that one
    side has and the other lacks (another ``n_layers``, say), or ``None``. ``held_elsewhere``:
    parameter names other ranks hold (pipeline stages), which this rank may lack."""
    differing = []
    for fqn, tensor in model_state.items():
        saved = metadata.state_dict_metadata.get(f"model.{fqn}")
        if not isinstance(saved, TensorStorageMetadata) or not hasattr(tensor, "shape"):
            continue
        if tuple(saved.size) != tuple(tensor.shape):
            differing.append(f"{fqn}: {list(saved.size)} saved, {list(tensor.shape)} here")
    saved_keys = {
        k[len("model.") :] for k in metadata.state_dict_metadata if k.startswith("model.")
    }
    only_here = sorted(k for k in model_state if k not in saved_keys)
    only_saved = sorted(saved_keys - model_state.keys() - set(held_elsewhere))
    for keys, where in ((only_here, "not in the checkpoint"), (only_saved, "not in this model")):
        if keys:
            more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
            differing.append(f"{', '.join(keys[:3])}{more} {where}")
    if not differing:
        return None
    message = f"checkpoint {dir} holds a model of another shape"
    fields = _config_differences(dir, current_config)
    if fields:
        message += " (checkpoint -> this run): " + ", ".join(fields) + "; tensors"
    message += ": " + "; ".join(differing[:3])
    if len(differing) > 3:
        message += f"; and {len(differing) - 3} more"
    return message + ". Build the model with the checkpoint's settings, or start a new run."


def describe_computation_change(dir: str, current_config: str | bytes | None) -> str | None:
    """A message naming the model config fields that make the checkpoint's weights compute
    something else in this run (same tensor shapes, other heads or rotary angles, say), how
    to resume, and how to start a new run from those weights on purpose; or ``None``.

    Both configs come from the run's ``config.json`` (in the checkpoint, and the one this run
    writes); without either, or with a model config that is not a
    :class:`~olmolike.nn.TransformerConfig`, there is nothing to compare.
    """
    sections = _model_sections(dir, current_config)
    if sections is None:
        return None
    try:
        saved, now = (TransformerConfig.from_dict(s) for s in sections)
    except (ConfigurationError, TypeError, ValueError):
        return None  # the run's own kind of model: its shapes are still checked
    changes = computation_changes(saved, now)
    if not changes:
        return None
    found = ", ".join(f"model.{k}: {old!r} -> {new!r}" for k, (old, new) in changes.items())
    restore = " ".join(model_override(k, old) for k, (old, _) in changes.items())
    allowed = ",".join(changes)
    return (
        f"checkpoint {dir} was trained with another model config (checkpoint -> this run): "
        f"{found}. Its tensors have the same shapes, but under this config they would compute "
        f"something else. To resume, build the model as the checkpoint was: {restore}. To "
        f"start a new run from these weights on purpose, give it another save folder and "
        f"--train_module.init_weights={dir} --train_module.init_weights_allowed_changes=[{allowed}]"
    )


def _model_sections(
    dir: str, current: str | bytes | None
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The ``model`` sections of the checkpoint's ``config.json`` and of ``current``."""
    configs = _configs(dir, current)
    if configs is None:
        return None
    saved, now = (config.get("model") for config in configs)
    return (saved, now) if isinstance(saved, dict) and isinstance(now, dict) else None


def _configs(dir: str, current: str | bytes | None) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The checkpoint's ``config.json`` and ``current`` (this run's), parsed; ``None`` if
    either is missing or no JSON mapping."""
    if current is None:
        return None
    try:
        saved = json.loads(io.read_bytes(io.join_path(dir, "config.json")))
        now = json.loads(current)
    except (FileNotFoundError, ValueError):
        return None
    return (saved, now) if isinstance(saved, dict) and isinstance(now, dict) else None


def _config_differences(dir: str, current: str | bytes | None) -> list[str]:
    configs = _configs(dir, current)
    if configs is None:
        return []
    old_flat, new_flat = _flatten(configs[0]), _flatten(configs[1])
    keys = sorted(
        k for k in old_flat.keys() | new_flat.keys() if old_flat.get(k) != new_flat.get(k)
    )
    # The model's own fields decide shapes: name only those when some differ.
    keys = [k for k in keys if k.startswith("model.")] or keys
    named = [f"{k}: {old_flat.get(k)!r} -> {new_flat.get(k)!r}" for k in keys[:5]]
    return named + ([f"and {len(keys) - 5} more"] if len(keys) > 5 else [])


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        flat: dict[str, Any] = {}
        for key, item in value.items():
            flat.update(_flatten(item, f"{prefix}{key}."))
        return flat
    return {prefix[:-1]: value}
