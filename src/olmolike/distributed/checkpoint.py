"""Model and optimizer state through ``torch.distributed.checkpoint`` (DCP), with OLMo-core's API.

Every rank writes its own shards; the state dicts come from ``get_model_state_dict`` /
``get_optimizer_state_dict``, so DDP, FSDP2 (DTensor) and plain modules all save the same
fully-qualified parameter names, and a checkpoint saved on N ranks loads on M.

The functions of OLMo-core's ``olmo_core.distributed.checkpoint`` are here with its
signatures and meaning: save and load model and optimizer state (sync or async, optionally
with a flattened optimizer state, renamed parameters or a partial load), read a checkpoint's
metadata or chosen keys in a plain process, unshard it into plain files, and edit nested state
dicts by dotted keys. A save to a URL is written locally, then uploaded (object stores have
no rename, which DCP's writer needs). DCP's ``.metadata`` and non-tensor values are
read as data (:mod:`.checkpoint_unpickle`): reading a checkpoint runs no code, changes nothing
in the process and reads nothing outside it; a load that fails in olmolike's reader raises its
:class:`~olmolike.exceptions.CheckpointError`, not DCP's ``CheckpointException``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from .. import io
from ..exceptions import CheckpointError
from .checkpoint_download import local_copy
from .checkpoint_format import dcp_dir_of, read_metadata
from .checkpoint_loading import WeightsOnlyLoadPlanner, checkpoint_error_of, dcp_reader
from .checkpoint_reader import load_keys
from .checkpoint_save import Write, check_checkpoint_backend, in_background, save_local
from .checkpoint_upload import save_to_url
from .state_dict_keys import merge_state_dicts, prune_state_dict, swap_param_keys
from .unshard import UnshardStrategy, UnshardStrategyType, unshard_checkpoint
from .utils import is_distributed

__all__ = [
    "UnshardStrategy",
    "UnshardStrategyType",
    "apply_model_and_optim_state_dict",
    "async_save_model_and_optim_state",
    "async_save_state_dict",
    "check_checkpoint_backend",
    "get_checkpoint_metadata",
    "load_keys",
    "load_model_and_optim_state",
    "load_state_dict",
    "merge_state_dicts",
    "model_and_optim_state_dict",
    "prune_state_dict",
    "read_metadata",
    "save_model_and_optim_state",
    "save_state_dict",
    "swap_param_keys",
    "unshard_checkpoint",
]

log = logging.getLogger(__name__)

# DCP warns on every single-process save and load; one process is a normal mode here.
warnings.filterwarnings(
    "ignore",
    message=r"torch\.distributed is (disabled, )?unavailable or uninitialized, assuming the intent",
    category=UserWarning,
)


def model_and_optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer | None = None,
    *,
    flatten_optimizer_state: bool = False,
) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` keyed by parameter names, as DCP saves and loads it.

    ``flatten_optimizer_state`` keys the optimizer state ``state.{fqn}.{name}`` and
    ``param_groups.{fqn}.{name}``, which is needed when ranks hold different parameters in a
    param group (pipeline parallelism); saving and loading must agree on it.
    """
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optim is not None:
        options = StateDictOptions(flatten_optimizer_state_dict=flatten_optimizer_state)
        state["optim"] = get_optimizer_state_dict(model, optim, options=options)
    return state


def apply_model_and_optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer | None,
    state: dict[str, Any],
    *,
    strict: bool = True,
    flatten_optimizer_state: bool = False,
) -> None:
    """Set what :func:`model_and_optim_state_dict` returned (after loading into it)."""
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=strict))
    if optim is not None and "optim" in state:
        options = StateDictOptions(
            strict=strict, flatten_optimizer_state_dict=flatten_optimizer_state
        )
        set_optimizer_state_dict(model, optim, state["optim"], options=options)


def _writing(
    dir: str | Path,
    *,
    process_group: dist.ProcessGroup | None = None,
    save_overwrite: bool = False,
    thread_count: int | None = None,
    throttle_uploads: bool = False,
    on_shard_written: Callable[[Path], None] | None = None,
) -> Write:
    """How a save writes ``dir`` (the keyword arguments of :func:`save_state_dict`): into the
    local directory, or staged and uploaded to a URL; the one writing that every save here
    runs, blocking or in the background."""
    where: Callable[..., None] = save_local
    if io.is_url(dir):
        where = functools.partial(save_to_url, throttle_uploads=throttle_uploads)
    return functools.partial(
        where,
        str(dir) if io.is_url(dir) else dir,
        process_group=process_group,
        save_overwrite=save_overwrite,
        thread_count=thread_count,
        on_shard_written=on_shard_written,
    )


def save_state_dict(
    dir: str | Path,
    state_dict: dict[str, Any],
    *,
    process_group: dist.ProcessGroup | None = None,
    save_overwrite: bool = False,
    thread_count: int | None = None,
    throttle_uploads: bool = False,
    on_shard_written: Callable[[Path], None] | None = None,
    failed: BaseException | None = None,
) -> None:
    """Save every rank's shards of ``state_dict`` into ``dir``, a local directory or a URL.

    ``dir`` must be empty or missing unless ``save_overwrite``. A URL is written locally
    first, then uploaded (see :mod:`.checkpoint_upload`), one rank after another with
    ``throttle_uploads``. ``thread_count`` threads (files per rank) write; by default
    :func:`~.checkpoint_save.default_thread_count`. ``on_shard_written(path)`` is called
    on a writing thread as each local shard file is complete (e.g. to upload it at once).

    A save that fails on any rank raises :class:`~.checkpoint_save.SaveFailedError` on every
    rank, naming the ranks that failed and their errors. ``failed`` is this rank's error from
    before the save (building its state, say): the rank still calls this, so that every rank
    learns it at the save's first agreement instead of waiting for it in a collective.
    """
    write = _writing(
        dir,
        process_group=process_group,
        save_overwrite=save_overwrite,
        thread_count=thread_count,
        throttle_uploads=throttle_uploads,
        on_shard_written=on_shard_written,
    )
    write(state_dict, failed=failed)


def async_save_state_dict(
    dir: str | Path,
    state_dict: dict[str, Any],
    *,
    stager: AsyncStager | None = None,
    failed: BaseException | None = None,
    **how: Any,
) -> Future[None]:
    """Copy ``state_dict`` to CPU memory now, write it to ``dir`` in a background thread.

    When this returns, later optimizer steps can no longer change what is saved. The
    ``process_group`` must support CPU tensors (gloo); use one that training does not use.
    Pass a stager kept across saves (torch's ``DefaultStager``) to reuse its CPU buffers
    instead of re-allocating the copy. The future completes once the files are written (and
    uploaded, for a URL). ``how`` holds the keyword arguments of :func:`save_state_dict`
    (``process_group``, ``save_overwrite``, ``thread_count``, ``throttle_uploads``,
    ``on_shard_written``), which the background thread runs: a rank whose copy fails passes
    its error on as ``failed``, so every rank's future raises it.
    """
    write = _writing(dir, **how)  # a wrong keyword fails here, not in the background
    group = how.get("process_group")
    return in_background(write, state_dict, process_group=group, stager=stager, failed=failed)


@contextlib.contextmanager
def _readable(
    dir: str | Path,
    process_group: dist.ProcessGroup | None,
    pre_download: bool,
    work_dir: str | Path | None,
    thread_count: int | None,
) -> Iterator[str]:
    """``dir``'s DCP directory, downloaded first (once per host) if remote and asked to."""
    dcp_dir = dcp_dir_of(dir)
    if not (pre_download and io.is_url(dcp_dir)):
        yield dcp_dir
        return
    with contextlib.ExitStack() as stack:
        base = work_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="olmolike-"))
        copy = local_copy(
            dcp_dir, Path(base), process_group=process_group, thread_count=thread_count
        )
        yield stack.enter_context(copy)


def load_state_dict(
    dir: str | Path,
    state_dict: dict[str, Any],
    *,
    process_group: dist.ProcessGroup | None = None,
    pre_download: bool = False,
    work_dir: str | Path | None = None,
    thread_count: int | None = None,
    metadata: Metadata | None = None,
) -> None:
    """Load saved values into the tensors of ``state_dict`` in place (any sharding, any ranks).

    ``dir`` is a DCP directory or a train checkpoint folder, local or remote; ``pre_download``
    copies a remote one under ``work_dir`` first, once per host. ``thread_count`` threads
    read (by default :func:`~.checkpoint_save.default_thread_count`). ``metadata``: the
    checkpoint's metadata if it was read already (by :func:`read_metadata`), not read again.
    """
    with _readable(dir, process_group, pre_download, work_dir, thread_count) as source:
        if metadata is None and not is_distributed():
            # Read (and checked) before dcp.load, which logs tracebacks when it cannot read
            # it; across ranks, dcp.load gathers every rank's failure (one rank's read
            # failing here alone would leave the others waiting in its collectives).
            metadata = read_metadata(source)
        _load(
            source,
            state_dict,
            process_group,
            strict=True,
            thread_count=thread_count,
            metadata=metadata,
        )


def _load(
    dir: str,
    state_dict: dict[str, Any],
    group: dist.ProcessGroup | None,
    *,
    strict: bool,
    thread_count: int | None,
    metadata: Metadata | None = None,
) -> None:
    try:
        dcp.load(
            state_dict,
            storage_reader=dcp_reader(dir, thread_count, metadata),
            planner=WeightsOnlyLoadPlanner(allow_partial_load=not strict),
            process_group=group,
            no_dist=not is_distributed(),
        )
    except CheckpointException as e:  # (a BaseException) one of the readers': one line
        ours = checkpoint_error_of(e)
        if ours is None:
            raise
        raise ours from None


def get_checkpoint_metadata(dir: str | Path) -> Metadata:
    """DCP's metadata of a checkpoint (a DCP directory or a train checkpoint folder): every
    saved key with its shape and dtype, without reading any tensor."""
    return read_metadata(dcp_dir_of(dir))


def save_model_and_optim_state(
    dir: str | Path,
    model: nn.Module,
    optim: torch.optim.Optimizer | None = None,
    *,
    process_group: dist.ProcessGroup | None = None,
    save_overwrite: bool = False,
    flatten_optimizer_state: bool = False,
    thread_count: int | None = None,
    throttle_uploads: bool = False,
) -> None:
    """Save model (and optimizer) shards of every rank into ``dir`` (local or a URL).

    :raises FileExistsError: if ``dir`` is not empty and ``save_overwrite`` is false.
    """
    state = model_and_optim_state_dict(
        model, optim, flatten_optimizer_state=flatten_optimizer_state
    )
    save_state_dict(
        dir,
        state,
        process_group=process_group,
        save_overwrite=save_overwrite,
        thread_count=thread_count,
        throttle_uploads=throttle_uploads,
    )


def async_save_model_and_optim_state(
    dir: str | Path,
    model: nn.Module,
    optim: torch.optim.Optimizer | None = None,
    *,
    flatten_optimizer_state: bool = False,
    **how: Any,
) -> Future[None]:
    """:func:`save_model_and_optim_state` that returns once the state is copied to CPU
    memory; the future completes when the files are written. ``how`` holds the keyword
    arguments of :func:`save_model_and_optim_state` (``process_group``, ``save_overwrite``,
    ``thread_count``, ``throttle_uploads``). ``process_group`` must support CPU collectives
    (gloo), and must not be used by another thread until it completes."""
    state = model_and_optim_state_dict(
        model, optim, flatten_optimizer_state=flatten_optimizer_state
    )
    return async_save_state_dict(dir, state, **how)


def load_model_and_optim_state(
    dir: str | Path,
    model: nn.Module,
    optim: torch.optim.Optimizer | None = None,
    *,
    process_group: dist.ProcessGroup | None = None,
    key_mapping: Mapping[str, str] | None = None,
    pre_download: bool = False,
    work_dir: str | Path | None = None,
    strict: bool = True,
    flatten_optimizer_state: bool = False,
    thread_count: int | None = None,
) -> None:
    """Load model (and, if ``optim`` is given, optimizer) state saved with the functions here.

    Works across a change of the number of ranks and of sharding (DDP, FSDP2, one process).
    ``key_mapping`` maps a parameter's name here to its name in the checkpoint. With
    ``strict=False``, parameters the checkpoint lacks keep their current values instead of
    being an error. ``dir`` is a DCP directory or a train checkpoint folder, local or remote.
    """
    with _readable(dir, process_group, pre_download, work_dir, thread_count) as source:
        metadata = read_metadata(source)
        if optim is not None and not any(
            k.startswith("optim.") for k in metadata.state_dict_metadata
        ):
            raise CheckpointError(
                f"{dir} holds no optimizer state; load with load_optim_state=False to load "
                "only the model weights"
            )
        state = model_and_optim_state_dict(
            model, optim, flatten_optimizer_state=flatten_optimizer_state
        )
        if key_mapping:
            swap_param_keys(state, key_mapping, metadata=metadata)
        _load(
            source,
            state,
            process_group,
            strict=strict,
            thread_count=thread_count,
            metadata=metadata,
        )
        if key_mapping:
            swap_param_keys(state, key_mapping, reverse=True, quiet=True)
    apply_model_and_optim_state_dict(
        model, optim, state, strict=strict, flatten_optimizer_state=flatten_optimizer_state
    )
