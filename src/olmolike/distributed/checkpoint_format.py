"""The on-disk format of checkpoints: layout, marker, finding, removing, checking.

The bottom of the checkpoint layers (see ``docs/contributing-layers.md``): it knows names and
files, never a model, an optimizer or a trainer, so everything above may use it, including
offline tools such as :mod:`.unshard` that never import :mod:`olmolike.train`.

``{save_folder}/step{N}/`` is a checkpoint once its marker exists (see
:mod:`olmolike.train.checkpoint` for how saves get there). Removal deletes the marker first.

Removing a whole checkpoint (hundreds of megabytes to many gigabytes of shards) can take
seconds on a slow disk and longer on an object store. :func:`purge` does only the cheap,
decisive part on the caller's thread: it deletes the marker (from then on no reader trusts the
folder) and, on a local disk, renames the folder out of the way (``.purging-step{N}-{id}``,
invisible to finders and to :func:`remove_abandoned`). The files are deleted on a background
thread. No collective depends on a purge, so there is no step to agree on; a run waits for its
purges only when it gives up its save folder (:func:`wait_for_purges`), or when it saves a step
again that is being purged (:func:`in_flight`); a purge killed half-way leaves a marker-less
folder that a later purge or save removes.

A marker says every rank's files landed; it cannot say they are still there and whole. A
deleted, truncated or garbled shard (its CRCs are checked as it is read), an unreadable DCP
``.metadata``, a truncated or garbled ``rank{R}.pt`` or a malformed marker each becomes one
:class:`~olmolike.exceptions.DamagedCheckpointError` that names the checkpoint and what is
wrong, so a resume can fall back to the previous checkpoint instead of failing half-way
through loading (or, worse, loading garbage).
"""

from __future__ import annotations

import io as std_io
import json
import logging
import re
import threading
import uuid
from collections.abc import Collection, Iterator
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from .. import io
from ..config import Config
from ..exceptions import CheckpointError, DamagedCheckpointError
from ..threads import DaemonThreadPool
from .checkpoint_loading import dcp_reader
from .checkpoint_records import archive_problem

__all__ = [
    "DCP_METADATA",
    "FORMAT_VERSION",
    "MARKER",
    "MODEL_AND_OPTIM",
    "TRAIN_STATE",
    "CheckedCheckpoint",
    "CheckpointMetadata",
    "DamagedCheckpointError",
    "contains_checkpoint",
    "dcp_dir_of",
    "dcp_reader",
    "dir_is_checkpoint",
    "find_checkpoints",
    "in_flight",
    "latest_checkpoint",
    "load_train_state",
    "mark_damaged",
    "purge",
    "read_marker",
    "read_metadata",
    "remove_abandoned",
    "remove_checkpoint",
    "step_of",
    "verify_checkpoint",
    "wait_for_purges",
]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
"""The version of the checkpoint layout written in every marker."""
MARKER = ".olmolike-checkpoint.json"
"""The completion marker of a train checkpoint folder, written last."""
MODEL_AND_OPTIM = "model_and_optim"
"""The DCP directory of a train checkpoint folder: model and optimizer shards."""
TRAIN_STATE = "train"
"""The folder of a train checkpoint holding each rank's trainer state (``rank{R}.pt``)."""
DCP_METADATA = ".metadata"
"""The file that makes a directory a DCP checkpoint (DCP's writer writes it last)."""
STEP_DIR = re.compile(r"^step(\d+)$")
STAGING_DIR = re.compile(r"^\.step(\d+)\.tmp$")
_MARKER_FIELDS: dict[str, type | tuple[type, ...]] = {
    "format_version": int,
    "world_size": int,
    "ephemeral": bool,
}


PURGING_PREFIX = ".purging-"
"""Local folders being purged are renamed to ``.purging-step{N}-{id}``."""
_lock = threading.Lock()
_in_flight: dict[str, Future[None]] = {}
_pool: DaemonThreadPool | None = None

DAMAGED = ".olmolike-damaged.json"


def mark_damaged(dir: str, reason: str) -> None:
    """Demote a damaged checkpoint: keep why in ``.olmolike-damaged.json``, then delete its
    marker. It is then an abandoned folder (removed by retention) that a new save may replace.
    """
    io.write_file(dir, DAMAGED, json.dumps({"reason": reason}), overwrite=True)
    io.remove(io.join_path(dir, MARKER))


def dir_is_checkpoint(dir: str | Path) -> bool:
    """Whether ``dir`` is a complete checkpoint (its marker exists)."""
    return io.exists(io.join_path(dir, MARKER))


def find_checkpoints(dir: str | Path, ephemeral: bool | None = None) -> Iterator[tuple[int, str]]:
    """Complete checkpoints ``(step, path)`` directly under ``dir``, by step.

    With ``ephemeral`` set, only those of that kind; a malformed marker is of neither kind.
    """
    found = []
    for name in io.list_dir(dir):
        match = STEP_DIR.match(name)
        path = io.join_path(dir, name)
        if match is None or not dir_is_checkpoint(path):
            continue
        if ephemeral is not None:
            try:
                if read_marker(path)["ephemeral"] != ephemeral:
                    continue
            except CheckpointError as e:
                log.warning("Skipping %s: %s", path, e)
                continue
        found.append((int(match.group(1)), path))
    yield from sorted(found)


def contains_checkpoint(dir: str | Path) -> bool:
    """Whether ``dir`` is a checkpoint or holds one."""
    return dir_is_checkpoint(dir) or any(True for _ in find_checkpoints(dir))


def latest_checkpoint(dir: str | Path) -> str:
    """The complete checkpoint with the highest step under ``dir``.

    :raises FileNotFoundError: if there is none.
    """
    found = list(find_checkpoints(dir))
    if not found:
        raise FileNotFoundError(f"no complete checkpoint in {dir}")
    return found[-1][1]


def remove_checkpoint(dir: str) -> None:
    """Delete a checkpoint, marker first: an interrupted removal leaves no 'complete' half."""
    io.remove(io.join_path(dir, MARKER))
    io.remove(dir, recursive=True)


def remove_abandoned(folder: str, keep: Collection[str] = ()) -> list[str]:
    """Delete step folders without a marker (a removal or a save that was killed) and local
    staging folders of saves that are not in progress; returns what was removed. Folders being
    purged are not its business: their purge removes them.

    Call it only from the run holding the folder's lease, naming in ``keep`` the checkpoints
    it is still saving (a remote save writes in place before its marker).
    """
    keep_names = {str(k).rstrip("/").rsplit("/", 1)[-1] for k in [*keep, *in_flight()]}
    removed = []
    for name in io.list_dir(folder):
        step, staging = STEP_DIR.match(name), STAGING_DIR.match(name)
        path = io.join_path(folder, name)
        if step and name not in keep_names and not dir_is_checkpoint(path):
            log.warning("Removing %s: a step folder without a marker (abandoned)", path)
        elif staging and f"step{staging.group(1)}" not in keep_names and not io.is_url(path):
            log.warning("Removing %s: the staging folder of an interrupted save", path)
        else:
            continue
        io.remove(path, recursive=True)
        removed.append(path)
    return removed


def purge(dir: str) -> Future[None]:
    """Remove the checkpoint ``dir``: its marker now, its files in the background.

    The future completes once the files are gone (a failure is logged, not raised: the
    folder has no marker any more, so nothing trusts what is left).
    """
    global _pool
    path = str(dir).rstrip("/")
    io.remove(io.join_path(path, MARKER))  # marker first, as for every removal
    doomed = path
    if not io.is_url(path) and Path(path).exists():
        doomed = str(Path(path).with_name(f"{PURGING_PREFIX}{Path(path).name}-{uuid.uuid4().hex}"))
        Path(path).rename(doomed)
    with _lock:
        if _pool is None:
            _pool = DaemonThreadPool(1, "checkpoint-purge")
        future = _pool.submit(_remove, path, doomed)
        _in_flight[path] = future
    return future


def step_of(path: str) -> int | None:
    """The step of the checkpoint folder ``path`` (``step{N}``), if it is named so."""
    match = STEP_DIR.match(str(path).rstrip("/").rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None


def in_flight(within: Collection[str] = ()) -> list[str]:
    """The checkpoints being purged (all, or those named in ``within``)."""
    with _lock:
        paths = list(_in_flight)
    wanted = {str(p).rstrip("/") for p in within}
    return [p for p in paths if not wanted or p in wanted]


def wait_for_purges() -> None:
    """Block until every purge started so far is done."""
    with _lock:
        futures = list(_in_flight.values())
    futures_wait(futures)


def _remove(path: str, doomed: str) -> None:
    try:
        io.remove(doomed, recursive=True)
        if not io.is_url(path):
            _remove_leftovers(Path(path).parent)
        log.info("Removed checkpoint %s", path)
    except Exception as e:
        log.warning("Removing checkpoint %s failed (it has no marker any more): %s", path, e)
    finally:
        with _lock:
            _in_flight.pop(path, None)


def _remove_leftovers(folder: Path) -> None:
    """Folders of purges that a killed process left half-removed."""
    for leftover in folder.glob(f"{PURGING_PREFIX}*"):
        io.remove(leftover, recursive=True)


def dcp_dir_of(dir: str | Path) -> str:
    """The DCP directory of ``dir``: ``dir/model_and_optim`` for a train checkpoint folder
    (which must be complete), or ``dir`` itself if it holds a DCP ``.metadata``.

    :raises CheckpointError: if ``dir`` is neither, or an incomplete train checkpoint.
    """
    text = str(dir).rstrip("/") or "/"
    inner = io.join_path(text, MODEL_AND_OPTIM)
    if io.exists(io.join_path(inner, DCP_METADATA)):
        if not dir_is_checkpoint(text):
            raise CheckpointError(f"{text} is an incomplete checkpoint (it has no {MARKER} marker)")
        return inner
    if io.exists(io.join_path(text, DCP_METADATA)):
        return text
    raise CheckpointError(
        f"{text} is not a checkpoint: expected a train checkpoint folder (stepN/ with "
        f"{MODEL_AND_OPTIM}/ inside) or a DCP directory (with a {DCP_METADATA} file)"
    )


def read_metadata(dir: str | Path) -> Metadata:
    """DCP's ``.metadata`` of the checkpoint in ``dir`` (which tensors, shapes, shard files),
    unpickled without running code from it (:mod:`.checkpoint_unpickle`).

    :raises CheckpointError: if it names anything DCP metadata is not made of.
    """
    return dcp_reader(dir).read_metadata()


def read_marker(dir: str | Path) -> dict[str, Any]:
    """The marker's contents; :class:`CheckpointError` if it is missing or malformed."""
    path = io.join_path(dir, MARKER)
    try:
        data = json.loads(io.read_bytes(path))
    except FileNotFoundError:
        raise DamagedCheckpointError(
            f"checkpoint {dir} has no {MARKER} marker (incomplete)"
        ) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise DamagedCheckpointError(
            f"checkpoint {dir}: its marker {MARKER} is not JSON ({e})"
        ) from None
    if not isinstance(data, dict):
        raise DamagedCheckpointError(f"checkpoint {dir}: its marker {MARKER} is not a JSON object")
    for name, kind in _MARKER_FIELDS.items():
        if not isinstance(data.get(name), kind):
            raise DamagedCheckpointError(
                f"checkpoint {dir}: its marker {MARKER} is malformed ({name!r} is "
                f"{data.get(name)!r})"
            )
    if data["world_size"] < 1:
        raise DamagedCheckpointError(
            f"checkpoint {dir}: its marker says world_size={data['world_size']}"
        )
    return data


@dataclass(frozen=True)
class CheckedCheckpoint:
    """What :func:`verify_checkpoint` read of a checkpoint, for the load to use."""

    marker: dict[str, Any]
    """The completion marker's contents (the step, the world size that saved it, ...)."""
    metadata: Metadata
    """DCP's ``.metadata``: every saved tensor's shape, dtype and where its shards are."""


def verify_checkpoint(dir: str) -> CheckedCheckpoint:
    """Raise :class:`DamagedCheckpointError` unless ``dir`` looks complete and intact.

    Checks the marker, the DCP metadata, that every shard it references exists with at least
    the bytes it references, and that every rank's trainer state exists. Reads only the
    marker, the metadata and two listings: the bytes of the shards are checked as the load
    reads them (see :mod:`.checkpoint_loading`), a trainer state by :func:`load_train_state`.
    """
    marker = read_marker(dir)
    dcp_dir = io.join_path(dir, MODEL_AND_OPTIM)
    try:
        metadata = read_metadata(dcp_dir)
    except FileNotFoundError:
        raise DamagedCheckpointError(
            f"checkpoint {dir}: {MODEL_AND_OPTIM}/.metadata is missing"
        ) from None
    except BaseException as e:  # DCP and pickle raise anything, including BaseExceptions
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise DamagedCheckpointError(
            f"checkpoint {dir}: {MODEL_AND_OPTIM}/.metadata is unreadable ({type(e).__name__}: "
            f"{str(e)[:200]})"
        ) from None
    sizes = _file_sizes(dcp_dir)
    for name, needed in sorted(_bytes_needed(metadata).items()):
        if name not in sizes:
            raise DamagedCheckpointError(
                f"checkpoint {dir}: shard {MODEL_AND_OPTIM}/{name} is missing"
            )
        if sizes[name] < needed:
            raise DamagedCheckpointError(
                f"checkpoint {dir}: shard {MODEL_AND_OPTIM}/{name} is truncated "
                f"({sizes[name]} of {needed} bytes)"
            )
    train_files = _file_sizes(io.join_path(dir, TRAIN_STATE))
    for rank in range(marker["world_size"]):
        if f"rank{rank}.pt" not in train_files:
            raise DamagedCheckpointError(
                f"checkpoint {dir}: {TRAIN_STATE}/rank{rank}.pt is missing"
            )
    return CheckedCheckpoint(marker, metadata)


def load_train_state(dir: str, rank: int) -> dict[str, Any]:
    """The trainer state saved by ``rank``; :class:`CheckpointError` if unreadable."""
    path = io.join_path(dir, f"{TRAIN_STATE}/rank{rank}.pt")
    try:
        data = io.read_bytes(path)
    except FileNotFoundError:
        raise DamagedCheckpointError(
            f"checkpoint {dir}: {TRAIN_STATE}/rank{rank}.pt is missing"
        ) from None
    problem = archive_problem(std_io.BytesIO(data))  # torch.load takes garbled tensors as they are
    if problem is None:
        try:
            state = torch.load(std_io.BytesIO(data), weights_only=True, map_location="cpu")
        except Exception as e:
            problem = f"{type(e).__name__}: {str(e)[:200]}"
    if problem is not None:
        raise DamagedCheckpointError(
            f"checkpoint {dir}: {TRAIN_STATE}/rank{rank}.pt is truncated or unreadable ({problem})"
        )
    if not isinstance(state, dict):
        raise DamagedCheckpointError(
            f"checkpoint {dir}: {TRAIN_STATE}/rank{rank}.pt holds no state dict"
        )
    return state


def _bytes_needed(metadata: Metadata) -> dict[str, int]:
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    return needed


def _file_sizes(dir: str) -> dict[str, int]:
    """Sizes of the files directly in ``dir`` (empty if it does not exist)."""
    fs, path = io.url_to_fs(dir)

    def listing() -> dict[str, int]:
        try:
            entries = fs.ls(path, detail=True, **({"refresh": True} if io.is_url(dir) else {}))
        except FileNotFoundError:
            return {}
        return {
            str(e["name"]).rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0)
            for e in entries
            if e.get("type") == "file"
        }

    return io.retry_network(listing, f"listing {dir}")


@dataclass
class CheckpointMetadata(Config):
    """What a checkpoint's marker file records about it (OLMo-core's ``CheckpointMetadata``).

    Read it with :meth:`read`; olmolike writes it when the checkpoint is complete.
    """

    ephemeral: bool | None = None
    """Whether the checkpoint is ephemeral (removed when the next one is saved)."""
    version: str = str(FORMAT_VERSION)
    """The version of the checkpoint format."""
    step: int | None = None
    """The step the checkpoint was saved at."""
    world_size: int | None = None
    """How many ranks saved it."""
    saved_at: float | None = None
    """When it was completed (seconds since the epoch)."""

    @classmethod
    def read(cls, dir: str | Path) -> CheckpointMetadata:
        """The metadata of the complete checkpoint ``dir``."""
        data = read_marker(dir)
        return cls(
            ephemeral=data.get("ephemeral"),
            version=str(data.get("format_version", FORMAT_VERSION)),
            step=data.get("step"),
            world_size=data.get("world_size"),
            saved_at=data.get("saved_at"),
        )
