"""Train checkpoints: a folder per step, complete only once its marker exists.

Layout of ``{save_folder}/step{N}/``::

    model_and_optim/          DCP shards (every rank writes its own) and DCP's .metadata
    train/rank{R}.pt          trainer state of rank R (counters, RNG, data position, callbacks)
    config.json, ...          files added with ``extra_files`` (rank 0), e.g. the run's config
    .olmolike-checkpoint.json the completion marker, written last

The commit protocol never lets a reader see a partial checkpoint:

* local folders: every rank writes into ``.step{N}.tmp`` beside the target; once all ranks
  report success, rank 0 writes the marker into it and renames it into place (atomic);
* object stores (no atomic rename): rank 0 first deletes whatever the target prefix holds
  (its marker first, then every object, e.g. shards of a larger world size), then every rank
  writes into a staging folder of its own under ``work_dir`` and uploads the files it wrote;
  once all ranks report success, rank 0 uploads the marker last.

Removing a checkpoint deletes its marker first; :meth:`Checkpointer.purge_checkpoint` deletes
the rest in the background (:mod:`.checkpoint_purge`). A save that fails raises
:class:`~olmolike.exceptions.CheckpointError` on every rank and removes its staging folder.
Loading first checks that the checkpoint is intact (:mod:`.checkpoint_format`). Trainer state
is saved with ``torch.save`` and loaded with ``weights_only=True``: loading never runs code
from a file. The run's lease on the save folder (:mod:`.lease`) is held by the checkpointer.
"""

from __future__ import annotations

import io as std_io
import json
import logging
import shutil
import socket
import time
from collections.abc import Collection, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from .. import io
from ..config import Config
from ..distributed.checkpoint import (
    async_save_state_dict,
    check_checkpoint_backend,
    save_state_dict,
)
from ..distributed.checkpoint_format import (
    FORMAT_VERSION,
    MARKER,
    MODEL_AND_OPTIM,
    STEP_DIR,
    TRAIN_STATE,
    CheckpointMetadata,
    contains_checkpoint,
    describe_error,
    dir_is_checkpoint,
    find_checkpoints,
    fsync_dir,
    latest_checkpoint,
    read_marker,
    remove_abandoned,
    remove_checkpoint,
    write_synced,
)
from ..distributed.utils import (
    all_agree,
    barrier,
    broadcast_object,
    get_rank,
    get_world_size,
    is_distributed,
    using_group,
)
from ..exceptions import CheckpointError
from ..threads import DaemonThreadPool
from . import checkpoint_purge
from .checkpoint_load import CheckpointLoad
from .lease import DEFAULT_TIMEOUT, SaveFolderLease, acquire_lease

if TYPE_CHECKING:
    from .train_module import TrainModule

__all__ = ["CheckpointMetadata", "Checkpointer", "CheckpointerConfig"]

log = logging.getLogger(__name__)


@dataclass
class CheckpointerConfig(Config):
    """A configuration class for building :class:`Checkpointer` instances."""

    work_dir: str | None = None
    """Local directory for staging files; defaults to the trainer's ``work_dir``."""
    save_overwrite: bool | None = None
    """Overwrite existing checkpoints; defaults to the trainer's ``save_overwrite``."""
    pre_download: bool = False
    """Download a remote checkpoint to ``work_dir`` before loading it."""
    save_thread_count: int | None = None
    """Threads writing checkpoint files (per rank)."""
    load_thread_count: int | None = None
    """Threads reading checkpoint files (per rank)."""
    throttle_uploads: bool = False
    """Let ranks upload one after another, for object stores that limit request rates."""
    lease_timeout: float = DEFAULT_TIMEOUT
    """Seconds without a heartbeat after which a run's lease on its save folder is stale.

    A training run holds a lease on its save folder so that a second run cannot write there
    at the same time; the lease of a run that died is taken over once it is this old (at
    once if the dead run was on the same host). Heartbeats are sent every sixth of it.
    """

    def validate(self) -> None:
        for name in ("save_thread_count", "load_thread_count"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise self._invalid(name, f"must be >= 1 if set, got {value}")
        if self.lease_timeout <= 0:
            raise self._invalid("lease_timeout", f"must be > 0, got {self.lease_timeout}")

    def build(
        self,
        work_dir: Path,
        *,
        save_overwrite: bool,
        process_group: dist.ProcessGroup | None = None,
    ) -> Checkpointer:
        return Checkpointer(
            work_dir=Path(self.work_dir) if self.work_dir else work_dir,
            save_overwrite=save_overwrite if self.save_overwrite is None else self.save_overwrite,
            pre_download=self.pre_download,
            process_group=process_group,
            save_thread_count=self.save_thread_count,
            load_thread_count=self.load_thread_count,
            throttle_uploads=self.throttle_uploads,
            lease_timeout=self.lease_timeout,
        )


RESERVED_NAMES = frozenset({MARKER, MODEL_AND_OPTIM, TRAIN_STATE})


def check_extra_file_name(name: str) -> None:
    """Reject a name that could not be a plain file at the top of a checkpoint folder."""
    if not name or "/" in name or "\\" in name or name in (".", "..") or name in RESERVED_NAMES:
        raise CheckpointError(
            f"{name!r} cannot be a file of a checkpoint folder: use a plain file name such as "
            f"'config.json', other than {', '.join(sorted(RESERVED_NAMES))}"
        )


@dataclass
class _SavePlan:
    target: str
    staging: Path
    remote: bool
    extra_files: dict[str, bytes]


class Checkpointer:
    """Saves and loads train checkpoints (see the module docstring for the format)."""

    def __init__(
        self,
        work_dir: Path,
        save_overwrite: bool = False,
        pre_download: bool = False,
        process_group: dist.ProcessGroup | None = None,
        save_thread_count: int | None = None,
        load_thread_count: int | None = None,
        throttle_uploads: bool = False,
        lease_timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        if process_group is not None or is_distributed():
            check_checkpoint_backend(str(dist.get_backend(process_group)))
        self.work_dir = Path(work_dir)
        self.save_overwrite = save_overwrite
        self.pre_download = pre_download
        self.process_group = process_group
        self.save_thread_count = save_thread_count
        self.load_thread_count = load_thread_count
        self.throttle_uploads = throttle_uploads
        self._writer: DaemonThreadPool | None = None
        self._pending: Future[Any] | None = None
        # torch's public stager, copying synchronously into CPU buffers it allocates on first
        # use and reuses afterwards (fresh memory costs page faults on every save).
        self._stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=torch.cuda.is_available(),
                use_shared_memory=False,
                use_async_staging=False,
                use_non_blocking_copy=False,
            )
        )
        self.lease_timeout = lease_timeout
        self.lease: SaveFolderLease | None = None
        """The lease on the save folder while a run trains (held by rank 0 only)."""

    def acquire_lease(self, folder: str) -> None:
        """Take the lease on ``folder`` (see :mod:`.lease`); every rank raises if in use."""
        self.lease = acquire_lease(folder, self.lease_timeout, group=self.process_group)

    def release_lease(self) -> None:
        """Release the lease: the next run on the folder may start at once."""
        lease, self.lease = self.lease, None
        checkpoint_purge.wait_for_purges()  # the next run must not find half-removed folders
        if lease is not None:
            lease.release()

    # -- saving ------------------------------------------------------------------------------

    def save(
        self,
        dir: str,
        train_module: TrainModule,
        train_state: dict[str, Any],
        ephemeral: bool = False,
        extra_files: Mapping[str, str | bytes] | None = None,
    ) -> None:
        """Save model, optimizer and trainer state to ``dir``; returns once it is complete.

        ``extra_files`` (name to contents, from rank 0) are written into the checkpoint folder
        before its marker, so they are part of the checkpoint: present exactly when it is.
        """
        self.wait_for_pending_save()
        plan = self._begin(dir, extra_files)
        cause: BaseException | None = None
        try:
            save_state_dict(
                plan.staging / MODEL_AND_OPTIM,
                train_module.state_dict_to_save(),
                process_group=self.process_group,
                thread_count=self.save_thread_count,
            )
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            log.error("Writing the model and optimizer state of %s failed: %s", plan.target, e)
            cause = e
        self._finish(plan, _serialize(train_state), ephemeral, cause)

    def save_async(
        self,
        dir: str,
        train_module: TrainModule,
        train_state: dict[str, Any],
        ephemeral: bool = False,
        extra_files: Mapping[str, str | bytes] | None = None,
    ) -> Future[None]:
        """Like :meth:`save`, but returns once the state is copied to CPU memory.

        The files are written by a background thread on this checkpointer's process group;
        the returned future completes when the checkpoint is complete (or failed).
        """
        self.wait_for_pending_save()
        plan = self._begin(dir, extra_files)
        state_bytes = _serialize(train_state)
        try:
            dcp_future = async_save_state_dict(
                plan.staging / MODEL_AND_OPTIM,
                train_module.state_dict_to_save(),
                process_group=self.process_group,
                thread_count=self.save_thread_count,
                stager=self._stager,
            )
        except (Exception, CheckpointException) as e:  # planning failed, on every rank
            self._finish(plan, state_bytes, ephemeral, e)

        def finish() -> None:
            # The group belongs to this save (DCP's thread, then this one) until it is done.
            with using_group(self.process_group, "checkpointer"):
                cause: BaseException | None = None
                try:
                    dcp_future.result()
                except (Exception, CheckpointException) as e:  # a BaseException: never let it out
                    log.error(
                        "Writing the model and optimizer state of %s failed: %s", plan.target, e
                    )
                    cause = e
                self._finish(plan, state_bytes, ephemeral, cause)

        self._pending = self._writer_thread().submit(finish)
        return self._pending

    def prepare_async_staging(self, train_module: TrainModule) -> None:
        """Allocate the CPU buffers of async saves now, in the background.

        Otherwise the first async save allocates them while training waits. Call it once the
        optimizer has state (after the first step), so the buffers have their final shape.
        """
        self.wait_for_pending_save()
        self._pending = self._writer_thread().submit(
            self._stager.stage, train_module.state_dict_to_save()
        )

    def _writer_thread(self) -> DaemonThreadPool:
        if self._writer is None:
            self._writer = DaemonThreadPool(1, "checkpoint-writer")
        return self._writer

    def wait_for_pending_save(self) -> None:
        """Block until an earlier :meth:`save_async` is done (raising its error, if any).

        Saves never overlap: each one runs collectives on the checkpointer's group, and two
        at once could interleave them differently on different ranks.
        """
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _begin(self, dir: str, extra_files: Mapping[str, str | bytes] | None) -> _SavePlan:
        target = str(dir).rstrip("/")
        if checkpoint_purge.in_flight([target]):  # saving a step again that is being removed
            checkpoint_purge.wait_for_purges()
        extra = {
            name: data.encode() if isinstance(data, str) else bytes(data)
            for name, data in (extra_files or {}).items()
        }
        for name in extra:
            check_extra_file_name(name)
        if self.dir_is_checkpoint(target) and not self.save_overwrite:
            raise CheckpointError(
                f"{target} already holds a checkpoint; set --trainer.save_overwrite=true (save_overwrite=True) to replace it"
            )
        remote = io.is_url(target)
        name = target.rsplit("/", 1)[-1]
        if remote:
            # Per rank, on each node's own disk: every rank cleans up what it staged itself.
            mine = self.work_dir / "checkpoint-staging" / f"rank{get_rank()}"
            shutil.rmtree(mine, ignore_errors=True)  # leftovers of interrupted saves
            staging = mine / name
        else:
            staging = Path(target).parent / f".{name}.tmp"
        error: str | None = None
        if get_rank() == 0:
            error = self._prepare_target(target, staging, remote)
        error = self._broadcast(error)
        if error is not None:
            raise CheckpointError(error)
        (staging / TRAIN_STATE).mkdir(parents=True, exist_ok=True)
        return _SavePlan(target, staging, remote, extra)

    def _prepare_target(self, target: str, staging: Path, remote: bool) -> str | None:
        """Rank 0, before any rank writes: check the lease, clear what is in the way."""
        try:
            if self.lease is not None:
                self.lease.check()
            if remote:
                # Marker first: from here on no reader trusts what the prefix holds.
                self.remove_checkpoint(target)
            else:
                shutil.rmtree(staging, ignore_errors=True)
        except Exception as e:
            return f"cannot save {target}: {e}"
        return None

    def _finish(
        self, plan: _SavePlan, state_bytes: bytes, ephemeral: bool, cause: BaseException | None
    ) -> None:
        rank = get_rank()
        try:
            if cause is None:
                write_synced(plan.staging / TRAIN_STATE / f"rank{rank}.pt", state_bytes)
                if rank == 0:
                    for name, data in plan.extra_files.items():
                        write_synced(plan.staging / name, data)
                if plan.remote:
                    self._upload_own_files(plan)
        except Exception as e:
            log.exception("Saving this rank's part of %s failed", plan.target)
            cause = e
        if not self._all_agree(cause is None):
            self._clean_staging(plan)
            reason = f": {describe_error(cause)}" if cause is not None else ""
            raise CheckpointError(
                f"saving {plan.target} failed on at least one rank (this rank: "
                f"{'failed' if cause else 'ok'}{reason}); it has no marker"
            ) from None
        commit_error: Exception | None = None
        if rank == 0:
            try:
                self._commit(plan, ephemeral)
            except Exception as e:
                log.exception("Committing %s failed", plan.target)
                commit_error = e
        if not self._all_agree(commit_error is None):
            self._clean_staging(plan)
            raise CheckpointError(
                f"committing {plan.target} failed; it has no marker"
                + (f": {commit_error}" if commit_error else "")
            )
        if plan.remote:
            shutil.rmtree(plan.staging.parent, ignore_errors=True)
        log.info("Saved checkpoint %s", plan.target)

    def _clean_staging(self, plan: _SavePlan) -> None:
        """After a failed save (every rank is past writing): free the disk it used."""
        if plan.remote:
            shutil.rmtree(plan.staging.parent, ignore_errors=True)
        elif get_rank() == 0:
            shutil.rmtree(plan.staging, ignore_errors=True)

    def _upload_own_files(self, plan: _SavePlan) -> None:
        # Shards first, as DCP writes them; .metadata and the small files after.
        files = sorted(
            (p for p in plan.staging.rglob("*") if p.is_file()),
            key=lambda p: (p.suffix != ".distcp", str(p)),
        )
        if self.throttle_uploads:
            self._take_turns(lambda: self._upload(plan, files))
        else:
            self._upload(plan, files)

    def _upload(self, plan: _SavePlan, files: list[Path]) -> None:
        for path in files:
            relative = path.relative_to(plan.staging)
            io.persist(plan.staging, plan.target, relative, overwrite=True)

    def _commit(self, plan: _SavePlan, ephemeral: bool) -> None:
        if self.lease is not None:
            self.lease.check()  # a run that lost its lease must not vouch for anything
        marker = json.dumps(
            {
                "format_version": FORMAT_VERSION,
                "step": _step_of(plan.target),
                "ephemeral": ephemeral,
                "world_size": get_world_size(),
                "saved_at": time.time(),
                "host": socket.gethostname(),
            }
        )
        if plan.remote:
            io.write_file(plan.target, MARKER, marker, overwrite=True)
            return
        for folder in (plan.staging / TRAIN_STATE, plan.staging / MODEL_AND_OPTIM):
            fsync_dir(folder)
        io.write_file(plan.staging, MARKER, marker, overwrite=True)  # fsyncs it and its dir
        target = Path(plan.target)
        if target.exists():
            self.remove_checkpoint(str(target))
        plan.staging.rename(target)
        fsync_dir(target.parent)

    # -- loading -----------------------------------------------------------------------------

    def load(
        self,
        dir: str,
        train_module: TrainModule,
        *,
        load_trainer_state: bool | None = None,
        load_optim_state: bool | None = None,
        current_config: str | bytes | None = None,
    ) -> dict[str, Any] | None:
        """Load a checkpoint into ``train_module``; return this rank's trainer state, if loaded.

        ``None`` for either flag means: load it if the checkpoint has it. The checkpoint is
        checked first; :class:`CheckpointError` names what is wrong with it, on every rank.
        ``current_config`` (this run's ``config.json``) lets a shape mismatch name the config
        fields that differ.
        """
        load = CheckpointLoad(
            str(dir).rstrip("/"),
            train_module,
            self.process_group,
            load_trainer_state,
            load_optim_state,
            current_config,
        )
        state: dict[str, Any] | None = load.run(
            self.work_dir, self.pre_download, self.load_thread_count
        )
        return state

    # -- finding and removing ----------------------------------------------------------------

    def write_file(self, dir: str, fname: str, contents: str | bytes) -> str:
        """Write ``contents`` to ``dir/fname`` (local or remote); returns its path or URL."""
        return io.write_file(dir, fname, contents, overwrite=self.save_overwrite)

    CHECKPOINT_DIR: ClassVar[str] = "step{step}"
    """The name of a step's folder under the save folder (OLMo-core's name for the pattern)."""
    METADATA_FNAME: ClassVar[str] = MARKER
    """The metadata file of a checkpoint; in olmolike it is also the completion marker."""

    @classmethod
    def checkpoint_dirname(cls, step: int) -> str:
        """``step{N}``: the folder name of the checkpoint of ``step``."""
        return cls.CHECKPOINT_DIR.format(step=step)

    # The on-disk format's functions, also reachable from here (as in OLMo-core).
    dir_is_checkpoint = staticmethod(dir_is_checkpoint)
    find_checkpoints = staticmethod(find_checkpoints)
    contains_checkpoint = staticmethod(contains_checkpoint)
    latest_checkpoint = staticmethod(latest_checkpoint)
    checkpoint_metadata = staticmethod(read_marker)
    remove_checkpoint = staticmethod(remove_checkpoint)
    purge_checkpoint = staticmethod(checkpoint_purge.purge)
    """Like :meth:`remove_checkpoint`, but only the marker is removed before it returns: the
    files go in the background (retention that never holds up training)."""
    wait_for_purges = staticmethod(checkpoint_purge.wait_for_purges)

    @staticmethod
    def remove_abandoned(folder: str, keep: Collection[str] = ()) -> list[str]:
        """Delete step folders without a marker, except those in ``keep`` and those being
        purged (see :func:`~olmolike.distributed.checkpoint_format.remove_abandoned`)."""
        return remove_abandoned(folder, keep=[*keep, *checkpoint_purge.in_flight()])

    # -- collectives -------------------------------------------------------------------------

    def _all_agree(self, ok: bool) -> bool:
        with using_group(self.process_group, "checkpointer"):
            return all_agree(ok, self.process_group)

    def _broadcast(self, obj: Any) -> Any:
        with using_group(self.process_group, "checkpointer"):
            return broadcast_object(obj, group=self.process_group)

    def _take_turns(self, upload: Any) -> None:
        error: Exception | None = None
        for turn in range(get_world_size()):
            if turn == get_rank():
                try:
                    upload()
                except Exception as e:  # keep joining the barriers, or the others hang
                    error = e
            with using_group(self.process_group, "checkpointer"):
                barrier(self.process_group)
        if error is not None:
            raise error


def _serialize(state: dict[str, Any]) -> bytes:
    buffer = std_io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def _step_of(path: str) -> int | None:
    match = STEP_DIR.match(path.rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None
