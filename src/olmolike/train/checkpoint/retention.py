"""Retention: which checkpoints go once a save is complete (:func:`retain`), and removing
them without holding up training (:func:`purge`).

Retention (rank 0, after a save completes) removes whole checkpoints: hundreds of megabytes to
many gigabytes of shards, which can take seconds on a slow disk and longer on an object store.
:func:`purge` does only the cheap, decisive part on the caller's thread: it deletes the marker
(from then on no reader trusts the folder) and, on a local disk, renames the folder out of the
way (``.purging-step{N}-{id}``, invisible to finders and to ``remove_abandoned``). The files are
deleted on a background thread. No collective depends on a purge, so there is no step to agree
on; the run waits for its purges only when it gives up its save folder (:func:`wait_for_purges`),
and a purge killed half-way leaves a marker-less folder that a later purge or save removes.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Collection
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from pathlib import Path

from ... import io
from ...distributed.checkpoint_format import (
    MARKER,
    STEP_DIR,
    dir_is_checkpoint,
    find_checkpoints,
)
from ...distributed.checkpoint_format import remove_abandoned as remove_unmarked
from ...threads import DaemonThreadPool

__all__ = ["in_flight", "purge", "remove_abandoned", "retain", "step_of", "wait_for_purges"]

log = logging.getLogger(__name__)

PURGING_PREFIX = ".purging-"

_lock = threading.Lock()
_in_flight: dict[str, Future[None]] = {}
_pool: DaemonThreadPool | None = None


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


def retain(
    folder: str,
    saved: str,
    *,
    ephemeral: bool,
    own_ephemeral: list[str],
    old_runs: Collection[str],
    in_progress: Collection[str],
    remove_others: bool,
    max_checkpoints: int | None,
) -> None:
    """What rank 0 removes from ``folder`` once the checkpoint ``saved`` is complete.

    Ephemeral checkpoints of earlier steps than ``saved`` (only those in ``own_ephemeral``,
    this run's, unless ``remove_others``), so a newer one is never removed in favour of an
    older one (two async saves may complete at once); the checkpoints of earlier runs listed
    in ``old_runs``; step folders without a marker (a removal or save killed half-way), except
    those of saves ``in_progress``; and, after a permanent save, the oldest permanent ones
    beyond ``max_checkpoints``. Every removal is a :func:`purge`: the marker now, the files in
    the background, so a large checkpoint never holds up the training thread. Removed paths
    leave ``own_ephemeral``.
    """
    saved_step = step_of(saved)
    for step, old in find_checkpoints(folder, ephemeral=True):
        own = old in own_ephemeral
        if saved_step is not None and step < saved_step and (own or remove_others):
            log.info("Removing ephemeral checkpoint %s", old)
            purge(old)
            if own:
                own_ephemeral.remove(old)
    for old in old_runs:
        if dir_is_checkpoint(old):
            log.info("Removing checkpoint %s of an earlier run (remove)", old)
            purge(old)
    remove_abandoned(folder, keep=[saved, *in_progress])
    if ephemeral or max_checkpoints is None:
        return
    permanent = list(find_checkpoints(folder, ephemeral=False))
    for _, old in permanent[: max(0, len(permanent) - max_checkpoints)]:
        log.info("Removing checkpoint %s (max_checkpoints=%d)", old, max_checkpoints)
        purge(old)


def remove_abandoned(folder: str, keep: Collection[str] = ()) -> list[str]:
    """Delete step folders without a marker, except those in ``keep`` and those being purged
    (see :func:`~olmolike.distributed.checkpoint_format.remove_abandoned`)."""
    return remove_unmarked(folder, keep=[*keep, *in_flight()])


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
