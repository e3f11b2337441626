"""Saving a train checkpoint (the write side of :mod:`~olmolike.train.checkpoint`'s format and its commit
protocol): claim the target, let DCP write every rank's shards, add the trainer state and the
extra files, agree that every rank succeeded, then commit (marker last).

To an object store, a shard is uploaded as soon as DCP has written it (on a thread pool the
checkpointer owns), so uploading overlaps writing; the small files follow once DCP is done,
and rank 0 uploads the marker only after every rank reported its uploads complete. With
``throttle_uploads`` the ranks instead upload one after another once everything is written.
"""

from __future__ import annotations

import io as std_io
import json
import logging
import shutil
import socket
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ... import io
from ...distributed.checkpoint_format import (
    FORMAT_VERSION,
    MARKER,
    MODEL_AND_OPTIM,
    TRAIN_STATE,
    dir_is_checkpoint,
    in_flight,
    remove_checkpoint,
    step_of,
    wait_for_purges,
)
from ...distributed.checkpoint_save import agree_on_failures, write_synced
from ...distributed.utils import barrier, get_rank, get_world_size, using_group
from ...exceptions import CheckpointError
from .lease import SaveFolderLease

__all__ = ["CheckpointSave", "check_extra_file_name"]

log = logging.getLogger(__name__)

RESERVED_NAMES = frozenset({MARKER, MODEL_AND_OPTIM, TRAIN_STATE})


def check_extra_file_name(name: str) -> None:
    """Reject a name that could not be a plain file at the top of a checkpoint folder."""
    if not name or "/" in name or "\\" in name or name in (".", "..") or name in RESERVED_NAMES:
        raise CheckpointError(
            f"{name!r} cannot be a file of a checkpoint folder: use a plain file name such as "
            f"'config.json', other than {', '.join(sorted(RESERVED_NAMES))}"
        )


@dataclass
class CheckpointSave:
    """One save of a train checkpoint into ``target``, on every rank of ``group``.

    Call :meth:`begin` (collective), let DCP write into :attr:`dcp_dir` (passing
    :meth:`shard_written` to its writer, if not ``None``), then :meth:`finish` (collective).
    """

    target: str
    """The checkpoint folder being written (``.../step{N}``), local or a URL."""
    extra_files: dict[str, bytes]
    """Files written into the checkpoint besides the state, by name (the run's ``config.json``,
    say)."""
    work_dir: Path
    """A local directory where a save to a URL is staged before its upload."""
    group: dist.ProcessGroup | None
    """The process group of the ranks that save together (``None``: the default group)."""
    lease: SaveFolderLease | None
    """The save folder's lease: a save is refused once another run has taken the folder over.
    ``None``: no lease is held."""
    uploader: Executor
    """Runs the uploads to an object store; several threads upload several files at once."""
    throttle_uploads: bool
    """Upload the ranks' files one rank after another instead of all at once."""
    staging: Path = field(init=False)
    """Where the files are written first (set by :meth:`begin`): beside the target under a hidden
    name, or under ``work_dir`` for a URL."""
    remote: bool = field(init=False)
    """Whether the target is a URL (set by :meth:`begin`): the files are then uploaded from
    ``staging``."""
    _uploads: dict[Path, Future[Any]] = field(default_factory=dict, init=False)

    @property
    def dcp_dir(self) -> Path:
        """Where DCP writes the model and optimizer state."""
        return self.staging / MODEL_AND_OPTIM

    @property
    def shard_written(self) -> Callable[[Path], None] | None:
        """What DCP's writer calls with each finished shard: upload it at once (``None``
        unless the target is an object store and uploads are not throttled)."""
        return self._upload_now if self.remote and not self.throttle_uploads else None

    def begin(self, save_overwrite: bool) -> None:
        """Check the target, pick and clear the staging folder; raises on every rank."""
        target = self.target
        if in_flight([target]):  # saving a step again that is being removed
            wait_for_purges()
        for name in self.extra_files:
            check_extra_file_name(name)
        if dir_is_checkpoint(target) and not save_overwrite:
            raise CheckpointError(
                f"{target} already holds a checkpoint; set --trainer.save_overwrite=true (save_overwrite=True) to replace it"
            )
        self.remote = io.is_url(target)
        name = target.rsplit("/", 1)[-1]
        if self.remote:
            # Per rank, on each node's own disk: every rank cleans up what it staged itself.
            mine = self.work_dir / "checkpoint-staging" / f"rank{get_rank()}"
            shutil.rmtree(mine, ignore_errors=True)  # leftovers of interrupted saves
            self.staging = mine / name
        else:
            self.staging = Path(target).parent / f".{name}.tmp"
        error: Exception | None = None
        if get_rank() == 0:
            try:
                self._prepare_target()
            except Exception as e:
                error = e
        with using_group(self.group, "checkpointer"):
            agree_on_failures(f"preparing {self.target}", error, self.group)

    def _prepare_target(self) -> None:
        """Rank 0, before any rank writes: check the lease, clear what is in the way."""
        self._check_lease()
        if self.remote:
            # Marker first: from here on no reader trusts what the prefix holds.
            remove_checkpoint(self.target)
        else:
            shutil.rmtree(self.staging, ignore_errors=True)

    def prepare(self, train_state: dict[str, Any]) -> bytes:
        """This rank's part before DCP writes (rank-local: a failure here must be handed to
        the save's next agreement): the trainer state's bytes, and its folder."""
        state_bytes = serialize(train_state)
        (self.staging / TRAIN_STATE).mkdir(parents=True, exist_ok=True)
        return state_bytes

    def finish(self, state_bytes: bytes, ephemeral: bool, cause: BaseException | None) -> None:
        """Write this rank's trainer state (and rank 0 the extra files), upload, agree, commit.

        ``cause`` is the failure of the DCP save, if any (agreed, or this rank's own); every
        rank raises :class:`~olmolike.distributed.checkpoint_save.SaveFailedError` naming the
        failed ranks if any rank failed, and the checkpoint then has no marker.
        """
        rank = get_rank()
        if cause is not None:
            # Raised on every rank as the save's error, printed once: not logged twice.
            log.info("Writing the model and optimizer state of %s failed: %s", self.target, cause)
        error = cause
        try:
            if cause is None:
                write_synced(self.staging / TRAIN_STATE / f"rank{rank}.pt", state_bytes)
                if rank == 0:
                    for name, data in self.extra_files.items():
                        write_synced(self.staging / name, data)
        except Exception as e:
            log.info("Saving this rank's part of %s failed: %s", self.target, e)
            error = e
        if self.remote:  # also when failed: no upload may outlive the save
            try:
                self._finish_uploads(upload_rest=error is None)
            except Exception as e:
                log.info("Saving this rank's part of %s failed: %s", self.target, e)
                error = error or e
        self._agree(f"saving {self.target}", error)
        commit_error: Exception | None = None
        if rank == 0:
            try:
                self._commit(ephemeral)
            except Exception as e:
                log.info("Committing %s failed: %s", self.target, e)
                commit_error = e
        self._agree(f"committing {self.target}", commit_error)
        if self.remote:
            shutil.rmtree(self.staging.parent, ignore_errors=True)
        log.info("Saved checkpoint %s", self.target)

    def _agree(self, what: str, error: BaseException | None) -> None:
        """Raise on every rank if ``what`` failed on any (cleaning up what was staged)."""
        try:
            with using_group(self.group, "checkpointer"):
                agree_on_failures(what, error, self.group, consequence="it has no marker")
        except CheckpointError:
            self._clean_staging()
            raise

    def _clean_staging(self) -> None:
        """After a failed save (every rank is past writing): free the disk it used."""
        if self.remote:
            shutil.rmtree(self.staging.parent, ignore_errors=True)
        elif get_rank() == 0:
            shutil.rmtree(self.staging, ignore_errors=True)

    # -- uploading ---------------------------------------------------------------------------

    def _upload_now(self, path: Path) -> None:
        self._uploads[path] = self.uploader.submit(self._upload, path)

    def _upload(self, path: Path) -> None:
        io.persist(self.staging, self.target, path.relative_to(self.staging), overwrite=True)

    def _finish_uploads(self, upload_rest: bool) -> None:
        """Wait for the shards uploaded while DCP wrote, then upload the rest of this rank's
        files (DCP's ``.metadata`` and the small files), all of them before the marker."""
        errors = [f.exception() for f in list(self._uploads.values())]
        if self.throttle_uploads:  # every rank takes its turn: the turns are collectives
            self._take_turns(lambda: self._upload_rest(errors) if upload_rest else None)
        elif upload_rest:
            self._upload_rest(errors)

    def _upload_rest(self, errors: list[BaseException | None]) -> None:
        """Upload this rank's files not uploaded yet, unless an early upload failed."""
        for error in errors:
            if error is not None:
                raise error
        rest = sorted(
            (p for p in self.staging.rglob("*") if p.is_file() and p not in self._uploads),
            key=lambda p: (p.suffix != ".distcp", str(p)),  # shards first, as DCP writes them
        )
        if self.throttle_uploads:  # one at a time: this rank's turn
            for path in rest:
                self._upload(path)
            return
        for future in [self.uploader.submit(self._upload, path) for path in rest]:
            future.result()

    def _check_lease(self, *, renew: bool = False) -> None:
        """A run that lost its save folder's lease must not write there, nor vouch for
        anything (the lease's heartbeat keeps the error to raise). ``renew``: look at the
        lease now, not at the last heartbeat's finding (before a marker: a run given this
        run's id by mistake may have taken it over since)."""
        if self.lease is not None and renew:
            self.lease.heartbeat()
        if self.lease is not None and self.lease.lost is not None:
            raise self.lease.lost.with_traceback(None)

    def _commit(self, ephemeral: bool) -> None:
        self._check_lease(renew=True)
        marker = json.dumps(
            {
                "format_version": FORMAT_VERSION,
                "step": step_of(self.target),
                "ephemeral": ephemeral,
                "world_size": get_world_size(),
                "saved_at": time.time(),
                "host": socket.gethostname(),
            }
        )
        if self.remote:
            io.write_file(self.target, MARKER, marker, overwrite=True)
            return
        for folder in (self.staging / TRAIN_STATE, self.dcp_dir):
            io.fsync_path(folder)
        io.write_file(self.staging, MARKER, marker, overwrite=True)  # fsyncs it and its dir
        target = Path(self.target)
        if target.exists():
            remove_checkpoint(str(target))
        self.staging.rename(target)
        io.fsync_path(target.parent)

    # -- collectives -------------------------------------------------------------------------

    def _take_turns(self, upload: Callable[[], Any]) -> None:
        error: Exception | None = None
        for turn in range(get_world_size()):
            if turn == get_rank():
                try:
                    upload()
                except Exception as e:  # keep joining the barriers, or the others hang
                    error = e
            with using_group(self.group, "checkpointer"):
                barrier(self.group)
        if error is not None:
            raise error


def encode_extra_files(extra_files: Mapping[str, str | bytes] | None) -> dict[str, bytes]:
    """The extra files' contents as bytes (text as UTF-8)."""
    return {
        name: data.encode() if isinstance(data, str) else bytes(data)
        for name, data in (extra_files or {}).items()
    }


def serialize(state: dict[str, Any]) -> bytes:
    """``torch.save`` of the trainer state, into memory."""
    buffer = std_io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()
