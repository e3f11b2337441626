"""Removing old checkpoints without holding up training.

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

from .. import io
from ..distributed.checkpoint_format import MARKER
from ..threads import DaemonThreadPool

__all__ = ["in_flight", "purge", "wait_for_purges"]

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
