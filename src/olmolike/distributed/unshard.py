"""Turn a DCP checkpoint into plain files that load without ``torch.distributed``.

Train checkpoints keep model and optimizer state as DCP shards (one set per rank), which only
``torch.distributed.checkpoint`` can read. Evaluation, inference and conversion tools want
ordinary files; :func:`unshard_checkpoint` writes them from a plain process (no process group):

* the model weights, keyed by plain FQNs (so ``load_state_dict(..., strict=True)`` on the
  unwrapped model accepts them), in torch (``.pt``) or safetensors format, as one file, one
  file per tensor, or chunks of whole tensors plus an ``index.json`` (HF's ``weight_map``).
  Every file holds a ``{fqn: tensor}`` dict: merging all of them gives the state dict;
* optionally the optimizer state as ``optim.pt``, always torch format because it holds
  non-tensor values, shaped like ``get_optimizer_state_dict``: ``state`` by FQN, ``param_groups``.

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
Only local paths are supported, for the checkpoint and for the output.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import logging
import math
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
import torch.distributed.checkpoint as dcp
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from .. import io
from ..config import Config, StrEnum
from ..exceptions import CheckpointError
from .checkpoint_format import MARKER, MODEL_AND_OPTIM, dir_is_checkpoint

__all__ = ["UnshardStrategy", "UnshardStrategyType", "unshard_checkpoint"]

log = logging.getLogger(__name__)

_DCP_METADATA = ".metadata"  # the file DCP's FileSystemWriter writes last
_INDEX = "index.json"
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

_StatePath = tuple[str | int, ...]
"""Where a value sits in the nested state below its top-level name, e.g. ``("state", fqn, "step")``."""


class UnshardStrategyType(StrEnum):
    one_file = "one_file"
    """All model tensors in one file."""
    one_file_per_tensor = "one_file_per_tensor"
    """A directory with one file per tensor, named by its FQN."""
    chunks = "chunks"
    """A directory of files of whole tensors up to a size, plus ``index.json``."""


@dataclass
class UnshardStrategy(Config):
    """How to lay out the unsharded model weights."""

    type: UnshardStrategyType = UnshardStrategyType.one_file
    chunk_size_in_bytes: int | None = None
    """For ``chunks``: the most tensor bytes per file (a bigger tensor gets a file of its own)."""

    def validate(self) -> None:
        size = self.chunk_size_in_bytes
        if self.type == UnshardStrategyType.chunks:
            if size is None:
                raise self._invalid("chunk_size_in_bytes", "is required by the chunks strategy")
            if size <= 0:
                raise self._invalid("chunk_size_in_bytes", f"must be > 0, got {size}")
        elif size is not None:
            # Silently ignoring it would hide a forgotten ``type=chunks``.
            raise self._invalid(
                "chunk_size_in_bytes", f"applies only to the chunks strategy, not {self.type}"
            )


def unshard_checkpoint(
    dir: str | Path,
    target_dir: str | Path,
    *,
    optim: bool = False,
    save_overwrite: bool = False,
    use_safetensors: bool = False,
    unshard_strategy: UnshardStrategy | None = None,
    progress: bool = False,
) -> tuple[str, str | None]:
    """Write the model (and, with ``optim``, the optimizer) state of a checkpoint as plain files.

    ``dir`` is a train checkpoint (``stepN/``) or a DCP directory. Returns the paths of the
    model output (``model.pt``, ``model.safetensors`` or the directory ``model/``) and of
    ``optim.pt`` (``None`` without ``optim``).

    :raises CheckpointError: if ``dir`` is not a checkpoint or lacks the requested state.
    :raises FileExistsError: if an output exists and ``save_overwrite`` is false.
    """
    strategy = unshard_strategy or UnshardStrategy()
    source = _Source(_dcp_dir(dir))
    model = source.tensors_of("model")
    optim_tensors = source.tensors_of("optim") if optim else []
    if use_safetensors:
        for tensor in model:
            _safetensors_dtype(tensor)  # fail before writing anything
    target = _local(target_dir, "the output directory")
    model_out = target / _model_name(strategy.type, use_safetensors)
    optim_out = target / "optim.pt" if optim else None
    for out in (model_out, optim_out):
        if out is not None and out.exists() and not save_overwrite:
            raise FileExistsError(
                f"{out} exists; pass --overwrite (save_overwrite=True from Python) to replace it"
            )
    target.mkdir(parents=True, exist_ok=True)
    with _Progress([*model, *optim_tensors], enabled=progress) as bar:
        with _replacing(model_out) as tmp:
            _write_model(tmp, strategy, use_safetensors, source, model, bar)
        log.info("Wrote the model weights of %s to %s", dir, model_out)
        if optim_out is not None:
            with _replacing(optim_out) as tmp:
                objects = source.load_objects("optim")
                _write_torch(tmp, optim_tensors, objects, source, bar)
            log.info("Wrote the optimizer state of %s to %s", dir, optim_out)
    return str(model_out), None if optim_out is None else str(optim_out)


# -- reading -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Tensor:
    """One saved tensor: its DCP key, its place in the nested state, its shape and dtype."""

    key: str
    path: _StatePath
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def name(self) -> str:
        """The dotted name; for a model tensor, its FQN."""
        return ".".join(map(str, self.path))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class _CachedMetadataReader(FileSystemReader):
    """A reader that unpickles ``.metadata`` once, not on each of the many loads."""

    def __init__(self, path: Path) -> None:
        super().__init__(str(path))
        self._metadata = super().read_metadata()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._metadata


class _WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, but non-tensor values are unpickled with ``weights_only=True``.

    The default runs arbitrary pickled code; these are plain numbers, strings and tuples.
    Works on flat state dicts only (``flatten_state_dict=False``), which is all we load.
    """

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False)

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        self.original_state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


class _Source:
    """A DCP checkpoint read one value at a time, in a plain process (no process group)."""

    def __init__(self, dcp_dir: Path) -> None:
        self.dir = dcp_dir
        self._reader = _CachedMetadataReader(dcp_dir)
        metadata = self._reader.read_metadata()
        # The save planner's record of how it flattened the nested state: FQNs contain dots,
        # so the keys alone cannot be split back into paths.
        paths: dict[str, _StatePath] = metadata.planner_data or {}
        self._tensors: dict[str, list[_Tensor]] = {}
        self._objects: dict[str, list[tuple[str, _StatePath]]] = {}
        for key, item in metadata.state_dict_metadata.items():
            if key not in paths:
                raise CheckpointError(f"{dcp_dir} was not saved by DCP's default planner")
            top, path = str(paths[key][0]), paths[key][1:]
            if isinstance(item, TensorStorageMetadata):
                tensor = _Tensor(key, path, tuple(item.size), item.properties.dtype)
                self._tensors.setdefault(top, []).append(tensor)
            else:
                self._objects.setdefault(top, []).append((key, path))

    def tensors_of(self, top: str) -> list[_Tensor]:
        """The tensors saved under ``top`` (``"model"`` or ``"optim"``), in saved order."""
        if top not in self._tensors and top not in self._objects:
            raise CheckpointError(f"{self.dir} holds no {top} state")
        if top == "model" and "model" in self._objects:
            key = self._objects["model"][0][0]
            raise CheckpointError(
                f"{self.dir} holds a non-tensor model entry {key}; cannot unshard"
            )
        return self._tensors.get(top, [])

    def load_tensor(self, tensor: _Tensor) -> torch.Tensor:
        state = {tensor.key: torch.empty(tensor.shape, dtype=tensor.dtype)}
        self._load(state)
        return state[tensor.key]

    def load_objects(self, top: str) -> list[tuple[_StatePath, Any]]:
        """The non-tensor values saved under ``top``, with their paths."""
        entries = self._objects.get(top, [])
        state: dict[str, Any] = dict.fromkeys(key for key, _ in entries)
        if state:
            self._load(state)
        return [(path, state[key]) for key, path in entries]

    def _load(self, state: dict[str, Any]) -> None:
        planner = _WeightsOnlyLoadPlanner()
        dcp.load(state, storage_reader=self._reader, planner=planner, no_dist=True)


def _dcp_dir(dir: str | Path) -> Path:
    path = _local(dir, "the checkpoint")
    if (path / MODEL_AND_OPTIM / _DCP_METADATA).is_file():
        if not dir_is_checkpoint(path):
            raise CheckpointError(f"{path} is an incomplete checkpoint (it has no {MARKER} marker)")
        return path / MODEL_AND_OPTIM
    if (path / _DCP_METADATA).is_file():
        return path
    raise CheckpointError(
        f"{path} is not a checkpoint: expected a train checkpoint folder (stepN/ with "
        f"{MODEL_AND_OPTIM}/ inside) or a DCP directory (with a {_DCP_METADATA} file)"
    )


def _local(path: str | Path, what: str) -> Path:
    if io.is_url(path):
        raise CheckpointError(f"unsharding works on local paths only; {what} is {path}")
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
    source: _Source,
    tensors: list[_Tensor],
    bar: _Progress,
) -> None:
    suffix = ".safetensors" if use_safetensors else ".pt"

    def write(path: Path, group: list[_Tensor]) -> None:
        if use_safetensors:
            _write_safetensors(path, group, source, bar)
        else:
            _write_torch(path, group, [], source, bar)

    if strategy.type == UnshardStrategyType.one_file:
        write(out, tensors)
        return
    out.mkdir()
    if strategy.type == UnshardStrategyType.one_file_per_tensor:
        for tensor in tensors:
            write(out / f"{tensor.name}{suffix}", [tensor])
        return
    assert strategy.chunk_size_in_bytes is not None  # validated by UnshardStrategy
    weight_map = {}
    for i, group in enumerate(_chunks(tensors, strategy.chunk_size_in_bytes)):
        name = f"chunk-{i:05d}{suffix}"
        write(out / name, group)
        weight_map.update(dict.fromkeys((t.name for t in group), name))
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors)}, "weight_map": weight_map}
    (out / _INDEX).write_text(json.dumps(index, indent=2))


def _chunks(tensors: Iterable[_Tensor], limit: int) -> list[list[_Tensor]]:
    """Consecutive groups of at most ``limit`` bytes; a bigger tensor makes a group alone."""
    groups: list[list[_Tensor]] = []
    size = 0
    for tensor in tensors:
        if not groups or size + tensor.nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(tensor)
        size += tensor.nbytes
    return groups


def _write_safetensors(
    path: Path, tensors: Sequence[_Tensor], source: _Source, bar: _Progress
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


def _safetensors_dtype(tensor: _Tensor) -> str:
    try:
        return _SAFETENSORS_DTYPES[tensor.dtype]
    except KeyError:
        raise CheckpointError(
            f"safetensors cannot store {tensor.name} ({tensor.dtype}); use the torch format"
        ) from None


def _write_torch(
    path: Path,
    tensors: Sequence[_Tensor],
    objects: Sequence[tuple[_StatePath, Any]],
    source: _Source,
    bar: _Progress,
) -> None:
    """``torch.save`` the nested state of ``tensors`` and ``objects``, one tensor in memory at a time.

    The archive is saved first with every storage's space reserved but unwritten; each tensor's
    bytes then go to the offset of its storage.
    """
    with FakeTensorMode():
        fakes = [(t.path, torch.empty(t.shape, dtype=t.dtype)) for t in tensors]
        with torch.serialization.skip_data(materialize_fake_tensors=True):
            torch.save(_nest([*fakes, *objects]), path)
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


def _nest(items: Iterable[tuple[_StatePath, Any]]) -> dict[str, Any]:
    """Rebuild the nested state DCP flattened; an int in a path is a list index."""
    root: dict[str, Any] = {}
    for path, value in items:
        node: Any = root
        for key, next_key in itertools.pairwise(path):
            child = node.get(key) if isinstance(node, dict) else _list_item(node, key)
            if child is None:
                child = [] if isinstance(next_key, int) else {}
                _put(node, key, child)
            node = child
        _put(node, path[-1], value)
    return root


def _list_item(node: list[Any], index: Any) -> Any:
    return node[index] if index < len(node) else None


def _put(node: Any, key: str | int, value: Any) -> None:
    if isinstance(node, list):
        assert isinstance(key, int)
        node.extend([None] * (key + 1 - len(node)))
    node[key] = value


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

    def __init__(self, tensors: Sequence[_Tensor], *, enabled: bool) -> None:
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

    def advance(self, tensor: _Tensor) -> None:
        self._done += 1
        if self._bar is not None:
            self._bar.update(self._task, advance=tensor.nbytes, done=self._done)
