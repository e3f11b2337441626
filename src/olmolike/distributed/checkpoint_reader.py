"""Reading a DCP checkpoint whole, one value at a time, in a plain process (no process group).

:func:`load_keys` (OLMo-core's name) returns chosen values of a checkpoint unsharded;
:mod:`.unshard` streams a whole checkpoint into plain files through :class:`CheckpointSource`.
Its ``.metadata`` and non-tensor values are unpickled by :mod:`.checkpoint_unpickle`:
reading a checkpoint never runs code from it.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from .. import io
from ..exceptions import CheckpointError
from .checkpoint_download import download_dir
from .checkpoint_format import dcp_dir_of
from .checkpoint_loading import dcp_reader
from .checkpoint_save import describe_error
from .checkpoint_unpickle import WeightsOnlyLoadPlanner

__all__ = ["CheckpointSource", "SavedTensor", "StatePath", "load_keys", "nest", "open_checkpoint"]

StatePath = tuple[str | int, ...]
"""Where a value sits in the nested state below its top-level name, e.g. ``("state", fqn, "step")``."""


@dataclass(frozen=True)
class SavedTensor:
    """One saved tensor: its DCP key, its place in the nested state, its shape and dtype."""

    key: str
    """The tensor's key in DCP's metadata (``model.blocks.0.attention.wq.weight``, say)."""
    path: StatePath
    """The tensor's place in the nested state dict, one key per level."""
    shape: tuple[int, ...]
    """The full (unsharded) shape."""
    dtype: torch.dtype
    """The dtype it was saved in."""

    @property
    def name(self) -> str:
        """The dotted name; for a model tensor, its FQN."""
        return ".".join(map(str, self.path))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class CheckpointSource:
    """A DCP directory, read one value (or a few) at a time, without a process group."""

    def __init__(self, dcp_dir: str) -> None:
        self.dir = dcp_dir
        self._reader: FileSystemReader = dcp_reader(dcp_dir)
        metadata = self._reader.read_metadata()
        # Unpickle .metadata once, not on each of the many loads.
        setattr(self._reader, "read_metadata", lambda *args, **kwargs: metadata)  # noqa: B010
        # The save planner's record of how it flattened the nested state: FQNs contain dots,
        # so the keys alone cannot be split back into paths.
        paths: dict[str, StatePath] = metadata.planner_data or {}
        self._tensors: dict[str, list[SavedTensor]] = {}
        self._objects: dict[str, list[tuple[str, StatePath]]] = {}
        self._full_paths: dict[str, StatePath] = {}
        for key, item in metadata.state_dict_metadata.items():
            if key not in paths:
                raise CheckpointError(f"{dcp_dir} was not saved by DCP's default planner")
            self._full_paths[key] = tuple(paths[key])
            top, path = str(paths[key][0]), tuple(paths[key][1:])
            if isinstance(item, TensorStorageMetadata):
                tensor = SavedTensor(key, path, tuple(item.size), item.properties.dtype)
                self._tensors.setdefault(top, []).append(tensor)
            else:
                self._objects.setdefault(top, []).append((key, path))
        self._metadata: Metadata = metadata

    def has(self, top: str) -> bool:
        """Whether anything was saved under ``top`` (e.g. ``"optim"``)."""
        return top in self._tensors or top in self._objects

    def tensors_of(self, top: str) -> list[SavedTensor]:
        """The tensors saved under ``top`` (``"model"`` or ``"optim"``), in saved order."""
        if not self.has(top):
            raise CheckpointError(f"{self.dir} holds no {top} state")
        if top == "model" and "model" in self._objects:
            key = self._objects["model"][0][0]
            raise CheckpointError(
                f"{self.dir} holds a non-tensor model entry {key}; cannot unshard"
            )
        return self._tensors.get(top, [])

    def load_tensor(self, tensor: SavedTensor) -> torch.Tensor:
        state = {tensor.key: torch.empty(tensor.shape, dtype=tensor.dtype)}
        self._load(state)
        return state[tensor.key]

    def load_objects(self, top: str) -> list[tuple[StatePath, Any]]:
        """The non-tensor values saved under ``top``, with their paths."""
        entries = self._objects.get(top, [])
        state: dict[str, Any] = dict.fromkeys(key for key, _ in entries)
        if state:
            self._load(state)
        return [(path, state[key]) for key, path in entries]

    def load_key(self, key: str) -> Any:
        """The value saved under the dotted ``key``: one value (``"model.w1.weight"``) or all
        those below it, nested as they were saved (``"model"``, ``"optim.state"``).

        :raises KeyError: if the checkpoint holds nothing under ``key``.
        """
        below: list[tuple[str, StatePath]] = []
        for dcp_key, full in self._full_paths.items():
            for depth in range(1, len(full) + 1):
                if ".".join(map(str, full[:depth])) == key:
                    below.append((dcp_key, full[depth:]))
                    break
        if not below:
            raise KeyError(key)
        tensors = self._metadata.state_dict_metadata
        state: dict[str, Any] = {
            k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
            if isinstance(m := tensors[k], TensorStorageMetadata)
            else None
            for k, _ in below
        }
        self._load(state)
        if len(below) == 1 and not below[0][1]:
            return state[below[0][0]]
        # Under a placeholder root, so that a list (e.g. ``param_groups``) stays a list.
        return nest((("", *path), state[k]) for k, path in below)[""]

    def _load(self, state: dict[str, Any]) -> None:
        # The state is flat (DCP keys), so the planner must not flatten it again.
        planner = WeightsOnlyLoadPlanner(flatten_state_dict=False)
        try:
            dcp.load(state, storage_reader=self._reader, planner=planner, no_dist=True)
        except CheckpointException as e:  # a BaseException, one per failed read
            raise CheckpointError(f"reading {self.dir} failed: {describe_error(e)}") from None


@contextlib.contextmanager
def open_checkpoint(
    dir: str | Path, *, pre_download: bool = False, work_dir: str | Path | None = None
) -> Iterator[CheckpointSource]:
    """A train checkpoint folder or DCP directory, local or remote, opened for reading.

    With ``pre_download`` a remote checkpoint is first copied under ``work_dir`` (a temporary
    directory if ``None``) and removed afterwards; otherwise it is read where it is.
    """
    dcp_dir = dcp_dir_of(dir)
    if not (pre_download and io.is_url(dcp_dir)):
        yield CheckpointSource(dcp_dir)
        return
    if work_dir is not None:
        Path(work_dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="download-", dir=work_dir) as local:
        download_dir(dcp_dir, Path(local) / "checkpoint")
        yield CheckpointSource(str(Path(local) / "checkpoint"))


def load_keys(
    dir: str | Path,
    keys: Iterable[str],
    *,
    pre_download: bool = False,
    work_dir: str | Path | None = None,
) -> Iterator[Any]:
    """The values saved under each of ``keys``, unsharded, in the order of ``keys``.

    A key is a dotted name as the checkpoint was saved: ``"model.w1.weight"`` gives that
    tensor, ``"model"`` or ``"optim.state.w1.weight"`` the nested dict of everything below it.
    ``dir`` is a DCP directory or a train checkpoint folder, local or remote. Runs in a plain
    process (no process group needed); the values are read when the generator first runs.

    :raises KeyError: for a key the checkpoint does not hold.
    """
    keys = list(keys)
    with open_checkpoint(dir, pre_download=pre_download, work_dir=work_dir) as source:
        values = [source.load_key(key) for key in keys]
    yield from values


def nest(items: Iterable[tuple[StatePath, Any]]) -> dict[str, Any]:
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
