"""A DCP save to an object store (``gs://``, ``s3://``, ...): written into a local staging
directory, and uploaded.

DCP's writer renames files, which object stores cannot do; so a save to a URL writes every
rank's files into a temporary local directory first (:func:`.checkpoint_save.write_shards`),
and each rank uploads what it wrote: a shard as soon as DCP has written it (on several
threads, while DCP writes the others), DCP's ``.metadata`` once every rank's shards are
uploaded (a reader takes a folder with ``.metadata`` for complete). With ``throttle_uploads``
the ranks upload one after another once everything is written, for stores that limit request
rates. Every step that can fail on one rank ends in an agreement of all ranks, so a failure
raises on every rank instead of leaving the others waiting in a collective: what a rank does
on its own (clearing, creating a staging folder) comes before the agreement, never after it.

Train checkpoints upload on their own terms (:mod:`olmolike.train.checkpoint.save`: the
marker last); this is the upload of the OLMo-core functions of
:mod:`~olmolike.distributed.checkpoint`.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch.distributed as dist

from .. import io
from ..threads import DaemonThreadPool
from .checkpoint_format import DCP_METADATA
from .checkpoint_save import (
    ShardWritten,
    agree_on_failures,
    default_thread_count,
    write_shards,
)
from .utils import all_agree, barrier, get_rank, get_world_size, is_distributed

__all__ = ["save_to_url"]


def save_to_url(
    url: str,
    state_dict: dict[str, Any],
    *,
    process_group: dist.ProcessGroup | None = None,
    save_overwrite: bool = False,
    thread_count: int | None = None,
    throttle_uploads: bool = False,
    on_shard_written: ShardWritten | None = None,
    failed: BaseException | None = None,
) -> None:
    """Save every rank's shards of ``state_dict`` to ``url``: written locally, then uploaded
    (see the module docstring); the arguments are :func:`.checkpoint_save.save_local`'s."""
    agree_on_failures(f"saving {url}", failed, process_group)
    threads = thread_count or default_thread_count()
    staged = _staged(
        url, process_group, save_overwrite, throttle_uploads, threads, on_shard_written
    )
    with staged as (local, shard_written):
        write_shards(local, state_dict, process_group, threads, shard_written, url)


class _EarlyUploads:
    """A rank's shards uploaded to ``url`` as DCP finishes each (unless throttled)."""

    def __init__(self, staging: Path, url: str, throttle: bool, threads: int) -> None:
        self.staging, self.url = staging, url
        self._pool = None if throttle else DaemonThreadPool(threads, "checkpoint-upload")
        self._started: dict[Path, Future[str]] = {}

    def hook(self, also: ShardWritten | None) -> ShardWritten | None:
        """What DCP's writer should call: start the upload (and call ``also``)."""
        pool = self._pool
        if pool is None:
            return also

        def written(path: Path) -> None:
            name = path.relative_to(self.staging)
            self._started[name] = pool.submit(
                io.persist, self.staging, self.url, name, overwrite=True
            )
            if also is not None:
                also(path)

        return written

    def finish(self) -> set[Path]:
        """Wait for every started upload (raising the first error); the names uploaded."""
        errors = [future.exception() for future in self._started.values()]
        self.close()
        for error in errors:
            if error is not None:
                raise error
        return set(self._started)

    def close(self) -> None:
        """Let the upload threads end (once the uploads started so far are done)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)


def _prepare_remote_dir(
    url: str, group: dist.ProcessGroup | None, save_overwrite: bool, error: str | None
) -> None:
    """Rank 0 checks (or, with ``save_overwrite``, clears) the prefix; every rank agrees,
    also on ``error``, this rank's failure to get ready."""
    if get_rank(group) == 0 and error is None:
        try:
            if save_overwrite:
                if io.exists(url):
                    io.remove(url, recursive=True)
            elif io.exists(url) and io.list_dir(url):
                error = f"{url} is not empty; pass save_overwrite=True to replace it"
        except Exception as e:  # every rank raises, not only this one
            error = f"cannot prepare {url}: {e}"
    if not all_agree(error is None, group):
        raise FileExistsError(error or f"{url} could not be prepared on another rank")


@contextlib.contextmanager
def _staged(
    url: str,
    group: dist.ProcessGroup | None,
    save_overwrite: bool,
    throttle: bool,
    threads: int,
    on_shard_written: ShardWritten | None,
) -> Iterator[tuple[Path, ShardWritten | None]]:
    """The local directory a save to ``url`` writes into, and what its writer calls with each
    finished shard (``on_shard_written``, and the start of its upload on one of ``threads``
    threads). The rest is uploaded after the save, if it succeeded."""
    staging: Path | None = None
    early: _EarlyUploads | None = None
    error: str | None = None
    try:
        staging = Path(tempfile.mkdtemp(prefix="olmolike-save-"))
        early = _EarlyUploads(staging, url, throttle, threads)
    except (OSError, RuntimeError) as e:  # told to every rank by the agreement next
        error = f"cannot stage the upload to {url} on rank {get_rank(group)}: {e}"
    try:
        _prepare_remote_dir(url, group, save_overwrite, error)
        assert staging is not None and early is not None
        try:
            yield staging, early.hook(on_shard_written)
        except BaseException:
            _wait_quietly(early)  # no upload outlives the save
            raise
        _upload(staging, url, group, throttle, early)
    finally:
        if early is not None:
            early.close()
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)


def _wait_quietly(early: _EarlyUploads) -> None:
    with contextlib.suppress(Exception):
        early.finish()


def _upload(
    staging: Path, url: str, group: dist.ProcessGroup | None, throttle: bool, early: _EarlyUploads
) -> None:
    """Every rank finishes uploading the files it wrote, then rank 0 uploads DCP's
    ``.metadata``."""

    files = sorted(p.relative_to(staging) for p in staging.rglob("*") if p.is_file())

    def upload_shards() -> None:
        done = early.finish()
        shards = [f for f in files if f.name != DCP_METADATA and f not in done]
        _upload_files(staging, url, shards, group, throttle)

    _agreeing(upload_shards, group, url)
    metadata = [f for f in files if f.name == DCP_METADATA]
    _agreeing(lambda: _upload_files(staging, url, metadata, None, False), group, url)


def _upload_files(
    staging: Path, url: str, files: list[Path], group: dist.ProcessGroup | None, throttle: bool
) -> None:
    def upload() -> None:
        for name in files:
            io.persist(staging, url, name, overwrite=True)

    if not throttle or not is_distributed():
        upload()
        return
    error: Exception | None = None
    for turn in range(get_world_size(group)):
        if turn == get_rank(group):
            try:
                upload()
            except Exception as e:  # keep joining the barriers, or the others hang
                error = e
        barrier(group)
    if error is not None:
        raise error


def _agreeing(step: Callable[[], None], group: dist.ProcessGroup | None, url: str) -> None:
    error: Exception | None = None
    try:
        step()
    except Exception as e:
        error = e
    agree_on_failures(f"uploading the checkpoint to {url}", error, group)
