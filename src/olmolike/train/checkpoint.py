"""Train checkpoints: a folder per step, complete only once its marker exists.

Layout of ``{save_folder}/step{N}/``::

    model_and_optim/          DCP shards (every rank writes its own) and DCP's .metadata
    train/rank{R}.pt          trainer state of rank R (counters, RNG, data position, callbacks)
    config.json, ...          files added with ``extra_files`` (rank 0), e.g. the run's config
    .olmolike-checkpoint.json the completion marker, written last

The commit protocol never lets a reader see a partial checkpoint:

* local folders: every rank writes into ``.step{N}.tmp`` beside the target; once all ranks
  report success, rank 0 writes the marker into it and renames it into place (atomic);
* object stores (no atomic rename): every rank writes locally, then uploads the files it
  wrote, in place; once all ranks report success, rank 0 uploads the marker last.

Removing a checkpoint deletes its marker first. Trainer state is saved with ``torch.save``
and loaded with ``weights_only=True``: loading never runs code from a file.
"""

from __future__ import annotations

import io as std_io
import json
import logging
import re
import shutil
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import fsspec
import torch
import torch.distributed as dist

from .. import io
from ..config import Config
from ..distributed.checkpoint import (
    ReusedBufferStager,
    async_save_state_dict,
    checkpoint_keys,
    load_state_dict,
    save_state_dict,
)
from ..distributed.utils import get_rank, get_world_size, is_distributed
from ..exceptions import CheckpointError
from .bookkeeping import DaemonThreadPool

if TYPE_CHECKING:
    from .train_module import TrainModule

__all__ = ["CheckpointMetadata", "Checkpointer", "CheckpointerConfig"]

log = logging.getLogger(__name__)

MARKER = ".olmolike-checkpoint.json"
MODEL_AND_OPTIM = "model_and_optim"
TRAIN_STATE = "train"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step(\d+)$")


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

    def validate(self) -> None:
        for name in ("save_thread_count", "load_thread_count"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise self._invalid(name, f"must be >= 1 if set, got {value}")

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
    ) -> None:
        self.work_dir = Path(work_dir)
        self.save_overwrite = save_overwrite
        self.pre_download = pre_download
        self.process_group = process_group
        self.save_thread_count = save_thread_count
        self.load_thread_count = load_thread_count
        self.throttle_uploads = throttle_uploads
        self._writer: DaemonThreadPool | None = None
        self._pending: Future[Any] | None = None
        self._stager = ReusedBufferStager()

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
        try:
            save_state_dict(
                plan.staging / MODEL_AND_OPTIM,
                train_module.state_dict_to_save(),
                process_group=self.process_group,
                thread_count=self.save_thread_count,
            )
            ok = True
        except Exception:
            log.exception("Writing the model and optimizer state of %s failed", plan.target)
            ok = False
        self._finish(plan, _serialize(train_state), ephemeral, ok)

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
        dcp_future = async_save_state_dict(
            plan.staging / MODEL_AND_OPTIM,
            train_module.state_dict_to_save(),
            process_group=self.process_group,
            thread_count=self.save_thread_count,
            stager=self._stager,
        )

        def finish() -> None:
            try:
                dcp_future.result()
                ok = True
            except BaseException:  # DCP's CheckpointException derives from BaseException
                log.exception("Writing the model and optimizer state of %s failed", plan.target)
                ok = False
            self._finish(plan, state_bytes, ephemeral, ok)

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
        extra = {
            name: data.encode() if isinstance(data, str) else bytes(data)
            for name, data in (extra_files or {}).items()
        }
        for name in extra:
            check_extra_file_name(name)
        if self.dir_is_checkpoint(target) and not self.save_overwrite:
            raise CheckpointError(
                f"{target} already holds a checkpoint; set save_overwrite=True to replace it"
            )
        remote = io.is_url(target)
        name = target.rsplit("/", 1)[-1]
        if remote:
            staging = self.work_dir / "checkpoint-staging" / name
        else:
            staging = Path(target).parent / f".{name}.tmp"
        if get_rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)  # leftovers of an interrupted save
        self._barrier()
        # Every rank creates it too: remote saves stage on each node's own disk.
        (staging / TRAIN_STATE).mkdir(parents=True, exist_ok=True)
        return _SavePlan(target, staging, remote, extra)

    def _finish(self, plan: _SavePlan, state_bytes: bytes, ephemeral: bool, ok: bool) -> None:
        rank = get_rank()
        cause: Exception | None = None
        try:
            if ok:
                (plan.staging / TRAIN_STATE / f"rank{rank}.pt").write_bytes(state_bytes)
                if rank == 0:
                    for name, data in plan.extra_files.items():
                        (plan.staging / name).write_bytes(data)
                if plan.remote:
                    self._upload_own_files(plan)
        except Exception as e:
            log.exception("Saving this rank's part of %s failed", plan.target)
            ok, cause = False, e
        if not self._all_agree(ok):
            raise CheckpointError(
                f"saving {plan.target} failed on at least one rank; it has no marker"
            ) from cause
        committed = True
        if rank == 0:
            try:
                self._commit(plan, ephemeral)
            except Exception:
                log.exception("Committing %s failed", plan.target)
                committed = False
        if not self._all_agree(committed):
            raise CheckpointError(f"committing {plan.target} failed; it has no marker")
        if plan.remote and rank == 0:
            shutil.rmtree(plan.staging, ignore_errors=True)
        log.info("Saved checkpoint %s", plan.target)

    def _upload_own_files(self, plan: _SavePlan) -> None:
        rank = get_rank()
        dcp_dir = plan.staging / MODEL_AND_OPTIM
        own = sorted(dcp_dir.glob(f"__{rank}_*.distcp"))
        if rank == 0:
            own += [p for p in dcp_dir.iterdir() if not p.name.endswith(".distcp")]
            own += [plan.staging / name for name in plan.extra_files]
        own.append(plan.staging / TRAIN_STATE / f"rank{rank}.pt")
        if self.throttle_uploads:
            self._take_turns(lambda: self._upload(plan, own))
        else:
            self._upload(plan, own)

    def _upload(self, plan: _SavePlan, files: list[Path]) -> None:
        for path in files:
            relative = path.relative_to(plan.staging)
            io.persist(plan.staging, plan.target, relative, overwrite=True)

    def _commit(self, plan: _SavePlan, ephemeral: bool) -> None:
        marker = json.dumps(
            {
                "format_version": FORMAT_VERSION,
                "step": _step_of(plan.target),
                "ephemeral": ephemeral,
                "world_size": get_world_size(),
                "saved_at": time.time(),
            }
        )
        if plan.remote:
            io.write_file(plan.target, MARKER, marker, overwrite=True)
            return
        io.write_file(plan.staging, MARKER, marker, overwrite=True)
        target = Path(plan.target)
        if target.exists():
            self.remove_checkpoint(str(target))
        plan.staging.rename(target)

    # -- loading -----------------------------------------------------------------------------

    def load(
        self,
        dir: str,
        train_module: TrainModule,
        *,
        load_trainer_state: bool | None = None,
        load_optim_state: bool | None = None,
    ) -> dict[str, Any] | None:
        """Load a checkpoint into ``train_module``; return this rank's trainer state, if loaded.

        ``None`` for either flag means: load it if the checkpoint has it.
        """
        dir = str(dir).rstrip("/")
        if not self.dir_is_checkpoint(dir):
            raise CheckpointError(f"{dir} is not a complete checkpoint (it has no {MARKER} marker)")
        source = self._local_copy(dir) if io.is_url(dir) and self.pre_download else dir
        dcp_dir = io.join_path(source, MODEL_AND_OPTIM)
        has_optim = "optim" in checkpoint_keys(dcp_dir)
        if load_optim_state and not has_optim:
            raise CheckpointError(f"{dir} holds no optimizer state; set load_optim_state=False")
        state = train_module.state_dict_to_load(
            optim=has_optim if load_optim_state is None else load_optim_state
        )
        load_state_dict(dcp_dir, state, process_group=self.process_group)
        train_module.load_state_dict(state)
        if load_trainer_state is False:
            return None
        return self._load_train_state(source, required=bool(load_trainer_state))

    def _load_train_state(self, dir: str, *, required: bool) -> dict[str, Any] | None:
        for name in (f"rank{get_rank()}.pt", "rank0.pt"):
            path = io.join_path(dir, f"{TRAIN_STATE}/{name}")
            if io.exists(path):
                data = io.read_bytes(path)
                return torch.load(std_io.BytesIO(data), weights_only=True, map_location="cpu")
        if required:
            raise CheckpointError(f"{dir} holds no trainer state; set load_trainer_state=False")
        return None

    def _local_copy(self, dir: str) -> str:
        local = self.work_dir / "checkpoint-download" / dir.rsplit("/", 1)[-1]
        if get_rank() == 0:
            shutil.rmtree(local, ignore_errors=True)
            fs, path = fsspec.core.url_to_fs(dir)
            # load_thread_count bounds the concurrent downloads of async stores (gcsfs, s3fs).
            batch = {"batch_size": self.load_thread_count} if self.load_thread_count else {}
            io.retry_network(
                lambda: fs.get(path, str(local), recursive=True, **batch), f"downloading {dir}"
            )
        self._barrier()
        return str(local)

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

    @classmethod
    def dir_is_checkpoint(cls, dir: str | Path) -> bool:
        """Whether ``dir`` is a complete checkpoint (its marker exists)."""
        return io.exists(io.join_path(dir, MARKER))

    @classmethod
    def find_checkpoints(
        cls, dir: str | Path, ephemeral: bool | None = None
    ) -> Iterator[tuple[int, str]]:
        """Complete checkpoints ``(step, path)`` directly under ``dir``, by step."""
        found = []
        for name in io.list_dir(dir):
            match = _STEP_DIR.match(name)
            path = io.join_path(dir, name)
            if match is None or not cls.dir_is_checkpoint(path):
                continue
            if (
                ephemeral is not None
                and cls.checkpoint_metadata(path).get("ephemeral") != ephemeral
            ):
                continue
            found.append((int(match.group(1)), path))
        yield from sorted(found)

    @classmethod
    def contains_checkpoint(cls, dir: str | Path) -> bool:
        """Whether ``dir`` is a checkpoint or holds one."""
        return cls.dir_is_checkpoint(dir) or any(True for _ in cls.find_checkpoints(dir))

    @classmethod
    def latest_checkpoint(cls, dir: str | Path) -> str:
        """The complete checkpoint with the highest step under ``dir``.

        :raises FileNotFoundError: if there is none.
        """
        found = list(cls.find_checkpoints(dir))
        if not found:
            raise FileNotFoundError(f"no complete checkpoint in {dir}")
        return found[-1][1]

    @classmethod
    def checkpoint_metadata(cls, dir: str | Path) -> dict[str, Any]:
        metadata = json.loads(io.read_bytes(io.join_path(dir, MARKER)))
        assert isinstance(metadata, dict)
        return metadata

    @classmethod
    def remove_checkpoint(cls, dir: str) -> None:
        """Delete a checkpoint, marker first: an interrupted removal leaves no 'complete' half."""
        io.remove(io.join_path(dir, MARKER))
        io.remove(dir, recursive=True)

    # -- collectives -------------------------------------------------------------------------

    def _all_agree(self, ok: bool) -> bool:
        if not is_distributed():
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.process_group)
        return bool(flag.item())

    def _barrier(self) -> None:
        if is_distributed():
            dist.barrier(group=self.process_group)

    def _take_turns(self, upload: Any) -> None:
        error: Exception | None = None
        for turn in range(get_world_size()):
            if turn == get_rank():
                try:
                    upload()
                except Exception as e:  # keep joining the barriers, or the others hang
                    error = e
            self._barrier()
        if error is not None:
            raise error


def _serialize(state: dict[str, Any]) -> bytes:
    buffer = std_io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def _step_of(path: str) -> int | None:
    match = _STEP_DIR.match(path.rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None


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
        data = Checkpointer.checkpoint_metadata(dir)
        return cls(
            ephemeral=data.get("ephemeral"),
            version=str(data.get("format_version", FORMAT_VERSION)),
            step=data.get("step"),
            world_size=data.get("world_size"),
            saved_at=data.get("saved_at"),
        )
