"""Turn a DCP checkpoint into plain files that load without ``torch.distributed``.

Train checkpoints keep model and optimizer state as DCP shards (one set per rank), which only
``torch.distributed.checkpoint`` can read. Evaluation, inference and conversion tools want
ordinary files; :func:`unshard_checkpoint` writes them from a plain process (no process group):

* the model weights, keyed by plain FQNs (so ``load_state_dict(..., strict=True)`` on the
  unwrapped model accepts them), in torch (``.pt``) or safetensors format, as one file, one
  file per tensor, or chunks of whole tensors; the folder holds the same files as OLMo-core's.
  Every file holds a ``{fqn: tensor}`` dict: merging all of them gives the state dict;
* the optimizer state as ``optim.pt``, always torch format because it holds non-tensor values,
  shaped like ``get_optimizer_state_dict``: ``state`` by FQN, ``param_groups``.

Memory: every format streams. The DCP metadata gives every shape and dtype, so each output
file's layout is fixed before any data is read; the tensors are then loaded one at a time (one
``dcp.load`` each), written at their place and dropped. Peak memory is about twice the largest
tensor (DCP deserializes a stored tensor or shard, then copies it into the target) plus the
optimizer's non-tensor values (a few numbers per parameter group), whatever the size of the
model; the first torch-format file also costs ~30 MiB once, for the modules FakeTensorMode
imports. Measured for 8 tensors of 4 MiB: +8 MiB peak RSS in every format.

* safetensors: the header goes first, then each tensor's bytes in header order;
* torch: ``torch.save`` needs the whole object, so the file is first saved without tensor data
  (``torch.serialization.skip_data`` over FakeTensors, which own no memory), and each tensor's
  bytes are then written at its storage's offset in the archive, found by loading that skeleton
  under ``FakeTensorMode`` (the way torch's serialization notes describe). ``torch.load`` does
  not check the zip CRC32 fields, which stay those of the empty skeleton: generic zip tools
  (``zipfile.testzip``, ``unzip -t``) report them as wrong.

Each output is written under a temporary sibling name and renamed into place when complete.
The checkpoint may be remote (read in place, or first downloaded with ``pre_download``); the
output is local.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import operator
import os
import shutil
import struct
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
from torch._subclasses.fake_tensor import FakeTensorMode

from .. import io
from ..config import Config, StrEnum
from ..exceptions import CheckpointError, DistributedContextError
from .checkpoint_reader import CheckpointSource, SavedTensor, StatePath, nest, open_checkpoint

__all__ = ["UnshardStrategy", "UnshardStrategyType", "unshard_checkpoint"]

log = logging.getLogger(__name__)

_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint64: "U64",
    torch.uint32: "U32",
    torch.uint16: "U16",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class UnshardStrategyType(StrEnum):
    """The file layout of unsharded model weights."""

    one_file = "one_file"
    """All model tensors in one file (and the optimizer state in another)."""
    one_file_per_tensor = "one_file_per_tensor"
    """A directory with one file per model tensor, named by its key (``model-w1-weight.pt``)."""
    chunks = "chunks"
    """A directory of files of whole tensors up to a size (``chunk-00000.pt``, ...)."""


@dataclass
class UnshardStrategy(Config):
    """How to lay out the unsharded model weights (OLMo-core's fields and constructors)."""

    name: UnshardStrategyType = UnshardStrategyType.one_file
    """The layout; the constructors :meth:`one_file`, :meth:`one_file_per_tensor` and
    :meth:`chunks` name it for you."""
    chunk_size_bytes: int | None = None
    """For ``chunks``: the most tensor bytes per file (a bigger tensor gets a file of its own),
    so that no file outgrows what the tools reading it hold in memory."""

    def validate(self) -> None:
        size = self.chunk_size_bytes
        if self.name == UnshardStrategyType.chunks:
            if size is None:
                raise self._invalid("chunk_size_bytes", "is required by the chunks strategy")
            if size <= 0:
                raise self._invalid("chunk_size_bytes", f"must be > 0, got {size}")
        elif size is not None:
            # Silently ignoring it would hide a forgotten ``name=chunks``.
            raise self._invalid(
                "chunk_size_bytes", f"applies only to the chunks strategy, not {self.name}"
            )

    @classmethod
    def one_file(cls) -> UnshardStrategy:
        """All model tensors in one file."""
        return cls(name=UnshardStrategyType.one_file)

    @classmethod
    def one_file_per_tensor(cls) -> UnshardStrategy:
        """One file per model tensor."""
        return cls(name=UnshardStrategyType.one_file_per_tensor)

    @classmethod
    def chunks(cls, chunk_size_in_bytes: int) -> UnshardStrategy:
        """Files of whole tensors of at most ``chunk_size_in_bytes`` (unless one is bigger)."""
        return cls(name=UnshardStrategyType.chunks, chunk_size_bytes=chunk_size_in_bytes)


def _check_single_process() -> None:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise DistributedContextError(
            f"unshard_checkpoint runs in one process, but this one is rank "
            f"{dist.get_rank()} of a distributed run of {dist.get_world_size()}: call it after training, outside torchrun, "
            f"e.g. `olmolike unshard CHECKPOINT OUT` (or after dist.destroy_process_group())"
        )


def unshard_checkpoint(
    dir: str | Path,
    target_dir: str | Path,
    *,
    optim: bool | None = None,
    save_overwrite: bool = False,
    use_safetensors: bool = False,
    unshard_strategy: UnshardStrategy | None = None,
    pre_download: bool = False,
    work_dir: str | Path | None = None,
    quiet: bool = False,
) -> tuple[Path, Path | None]:
    """Write the model (and the optimizer) state of a checkpoint as plain files.

    ``dir`` is a DCP directory or a train checkpoint folder (``stepN/``), local or remote
    (``pre_download`` copies a remote one under ``work_dir`` first). ``optim=None`` unshards
    the optimizer state too when the layout is ``one_file`` in torch format and the checkpoint
    has one; ``optim=True`` writes ``optim.pt`` with any layout. ``quiet`` hides the progress
    bar (on stderr). Returns the paths of the model output (``model.pt``,
    ``model.safetensors`` or the directory ``model/``) and of ``optim.pt`` (or ``None``).

    :raises CheckpointError: if ``dir`` is not a checkpoint or lacks the requested state.
    :raises FileExistsError: if an output exists and ``save_overwrite`` is false.
    :raises DistributedContextError: if called from a process of a distributed run of more
        than one rank (every rank would write the same files at once).
    """
    _check_single_process()
    strategy = unshard_strategy or UnshardStrategy.one_file()
    target = _local(target_dir, "the output directory")
    with open_checkpoint(dir, pre_download=pre_download, work_dir=work_dir) as source:
        if optim is None:
            optim = (
                not use_safetensors
                and strategy.name == UnshardStrategyType.one_file
                and source.has("optim")
            )
        model_out, optim_out = _check_outputs(
            source, target, strategy, use_safetensors, optim, save_overwrite
        )
        model = source.tensors_of("model")
        optim_tensors = source.tensors_of("optim") if optim else []
        target.mkdir(parents=True, exist_ok=True)
        with _Progress([*model, *optim_tensors], enabled=not quiet) as bar:
            with _replacing(model_out) as tmp:
                _write_model(tmp, strategy, use_safetensors, source, model, bar)
            log.info("Wrote the model weights of %s to %s", dir, model_out)
            if optim_out is not None:
                with _replacing(optim_out) as tmp:
                    objects = source.load_objects("optim")
                    _write_torch(tmp, optim_tensors, objects, source, bar)
                log.info("Wrote the optimizer state of %s to %s", dir, optim_out)
    return model_out, optim_out


def _check_outputs(
    source: CheckpointSource,
    target: Path,
    strategy: UnshardStrategy,
    use_safetensors: bool,
    optim: bool,
    save_overwrite: bool,
) -> tuple[Path, Path | None]:
    """Refuse, before writing anything, what would fail half-way; return the output paths."""
    model = source.tensors_of("model")
    if optim:
        source.tensors_of("optim")
    if use_safetensors:
        for tensor in model:
            _safetensors_dtype(tensor)
    if strategy.name == UnshardStrategyType.one_file_per_tensor:
        seen: dict[str, str] = {}
        for tensor in model:
            other = seen.setdefault(_file_stem(tensor), tensor.name)
            if other != tensor.name:
                raise CheckpointError(
                    f"{tensor.name} and {other} would share the file {_file_stem(tensor)}; "
                    "use the one_file or chunks strategy"
                )
    model_out = target / _model_name(strategy.name, use_safetensors)
    optim_out = target / "optim.pt" if optim else None
    for out in (model_out, optim_out):
        if out is not None and out.exists() and not save_overwrite:
            raise FileExistsError(
                f"{out} exists; pass --overwrite (save_overwrite=True from Python) to replace it"
            )
    return model_out, optim_out


def _local(path: str | Path, what: str) -> Path:
    if io.is_url(path):
        raise CheckpointError(f"unsharding writes to local paths only; {what} is {path}")
    return io.local_path(path)


# -- writing -----------------------------------------------------------------------------------


def _model_name(strategy: UnshardStrategyType, use_safetensors: bool) -> str:
    if strategy == UnshardStrategyType.one_file:
        return "model.safetensors" if use_safetensors else "model.pt"
    return "model"


def _write_model(
    out: Path,
    strategy: UnshardStrategy,
    use_safetensors: bool,
    source: CheckpointSource,
    tensors: list[SavedTensor],
    bar: _Progress,
) -> None:
    suffix = ".safetensors" if use_safetensors else ".pt"

    def write(path: Path, group: list[SavedTensor]) -> None:
        if use_safetensors:
            _write_safetensors(path, group, source, bar)
        else:
            _write_torch(path, group, [], source, bar)

    if strategy.name == UnshardStrategyType.one_file:
        write(out, tensors)
        return
    out.mkdir()
    if strategy.name == UnshardStrategyType.one_file_per_tensor:
        for tensor in tensors:
            write(out / f"{_file_stem(tensor)}{suffix}", [tensor])
        return
    assert strategy.chunk_size_bytes is not None  # validated by UnshardStrategy
    for i, group in enumerate(_chunks(tensors, strategy.chunk_size_bytes)):
        write(out / f"chunk-{i:05d}{suffix}", group)


def _file_stem(tensor: SavedTensor) -> str:
    """The file of a tensor of its own: its key with dashes for dots, as OLMo-core names it."""
    return tensor.key.replace(".", "-")


def _chunks(tensors: Iterable[SavedTensor], limit: int) -> list[list[SavedTensor]]:
    """Consecutive groups of at most ``limit`` bytes; a bigger tensor makes a group alone."""
    groups: list[list[SavedTensor]] = []
    size = 0
    for tensor in tensors:
        if not groups or size + tensor.nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(tensor)
        size += tensor.nbytes
    return groups


def _write_safetensors(
    path: Path, tensors: Sequence[SavedTensor], source: CheckpointSource, bar: _Progress
) -> None:
    """Write the header (all shapes are known), then each tensor's bytes as it is loaded."""
    if sys.byteorder != "little":
        raise CheckpointError("safetensors files are little-endian; use the torch format")
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for tensor in tensors:
        end = offset + tensor.nbytes
        header[tensor.name] = {
            "dtype": _safetensors_dtype(tensor),
            "shape": list(tensor.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for tensor in tensors:
            _write_bytes(f, source.load_tensor(tensor))
            bar.advance(tensor)


def _safetensors_dtype(tensor: SavedTensor) -> str:
    try:
        return _SAFETENSORS_DTYPES[tensor.dtype]
    except KeyError:
        raise CheckpointError(
            f"safetensors cannot store {tensor.name} ({tensor.dtype}); use the torch format"
        ) from None


def _write_torch(
    path: Path,
    tensors: Sequence[SavedTensor],
    objects: Sequence[tuple[StatePath, Any]],
    source: CheckpointSource,
    bar: _Progress,
) -> None:
    """``torch.save`` the nested state of ``tensors`` and ``objects``, one tensor in memory at a time.

    The archive is saved first with every storage's space reserved but unwritten; each tensor's
    bytes then go to the offset of its storage.
    """
    with FakeTensorMode():
        fakes = [(t.path, torch.empty(t.shape, dtype=t.dtype)) for t in tensors]
        with torch.serialization.skip_data(materialize_fake_tensors=True):
            torch.save(nest([*fakes, *objects]), path)
        # Loading under FakeTensorMode reads no data and tags storages with their offset.
        layout = torch.load(path, weights_only=True)
    with path.open("r+b") as f:
        for tensor in tensors:
            placeholder = functools.reduce(operator.getitem, tensor.path, layout)
            f.seek(placeholder.untyped_storage()._checkpoint_offset)
            _write_bytes(f, source.load_tensor(tensor))
            bar.advance(tensor)


def _write_bytes(f: IO[bytes], tensor: torch.Tensor) -> None:
    # A flat uint8 view of the contiguous tensor: no copy, and numpy has no bfloat16.
    f.write(tensor.reshape(-1).view(torch.uint8).numpy().data)


@contextlib.contextmanager
def _replacing(target: Path) -> Iterator[Path]:
    """Yield a temporary sibling of ``target`` to write; then move it into ``target``'s place."""
    tmp = target.with_name(f".{target.name}.tmp")
    _remove(tmp)  # the leftovers of an interrupted run
    try:
        yield tmp
    except BaseException:
        _remove(tmp)
        raise
    _remove(target)
    os.replace(tmp, target)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


class _Progress:
    """A rich progress bar over tensors and bytes, on stderr; nothing at all when disabled.

    Not even a disabled rich bar: stopping one still prints an empty line.
    """

    def __init__(self, tensors: Sequence[SavedTensor], *, enabled: bool) -> None:
        self._done = 0
        self._bar: Progress | None = None
        if enabled:
            self._bar = Progress(
                TextColumn("unsharding"),
                BarColumn(),
                TextColumn("{task.fields[done]}/{task.fields[count]} tensors"),
                DownloadColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
            )
            total = sum(t.nbytes for t in tensors)
            self._task = self._bar.add_task("", total=total, done=0, count=len(tensors))

    def __enter__(self) -> _Progress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()

    def advance(self, tensor: SavedTensor) -> None:
        self._done += 1
        if self._bar is not None:
            self._bar.update(self._task, advance=tensor.nbytes, done=self._done)
