"""TrainerConfig: every trainer setting as a plain, overridable config."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..config import Config
from ..distributed.utils import (
    destroy_group,
    get_world_size,
    is_distributed,
    is_shared_filesystem,
    new_group,
)
from ..io import is_url, local_path, removed_if_left_empty, url_to_fs
from ..utils import get_default_device
from .callbacks.callback import Callback, callback_registry
from .callbacks.checkpointer import CheckpointerCallback
from .callbacks.console_logger import ConsoleLoggerCallback
from .checkpoint import Checkpointer, CheckpointerConfig
from .checkpoint.lease import SaveFolderInUseError, current_lease, in_use_message, run_id
from .common import Duration, LoadStrategy, StepSkipRange

if TYPE_CHECKING:
    from ..data.data_loader import DataLoaderBase
    from .train_module import TrainModule
    from .trainer import Trainer

__all__ = ["TrainerConfig"]

_AS_THEY_ARE = (
    "save_folder",
    "max_duration",
    "save_overwrite",
    "load_path",
    "load_strategy",
    "load_trainer_state",
    "load_optim_state",
    "metrics_collect_interval",
    "cancel_check_interval",
    "hard_stop",
    "async_bookkeeping",
    "bookkeeping_soft_timeout",
    "train_timeout_seconds",
    "no_checkpoints",
    "no_evals",
)
"""The fields :meth:`TrainerConfig.build` passes to the ``Trainer`` as they are (the trainer's
fields of the same names); the others it builds or copies first."""


@dataclass
class TrainerConfig(Config):
    """A configuration class for building :class:`~olmolike.train.Trainer` instances.

    Each field below says what it sets; the :class:`~olmolike.train.Trainer` it builds holds
    the same settings.
    """

    save_folder: str
    """Where checkpoints and the run's files (config, metrics) go: a local directory, shared by
    every rank (several nodes need a shared filesystem), or a URL (``gs://``, ``s3://``). A folder
    that holds checkpoints is resumed from (see ``load_strategy``); one run writes to it at a time.
    """
    work_dir: str | None = None
    """Defaults to ``save_folder`` when that is local, else a directory under the system temp dir."""
    load_path: str | None = None
    """Another place to start from when the save folder holds no checkpoint: a checkpoint
    (``step{N}``) or a folder of them (its newest), e.g. another run's save folder. ``None``: none.
    """
    load_strategy: LoadStrategy = LoadStrategy.if_available
    """Whether to load a checkpoint when ``fit()`` starts: ``if_available`` (the save folder's
    newest, else ``load_path``'s, else start from scratch), ``always`` (no checkpoint is an error)
    or ``never``."""
    load_optim_state: bool | None = None
    """Whether a load restores the optimizer state: ``None`` if the checkpoint holds it, ``True``
    requires it, ``False`` starts the optimizer afresh."""
    load_trainer_state: bool | None = None
    """Whether a load restores the trainer's state (step, tokens seen, data loader position, RNG
    states): ``None`` if the checkpoint holds it, ``True`` requires it, ``False`` keeps only the
    weights (and optimizer state) and starts counting at step 0."""
    checkpointer: CheckpointerConfig = field(default_factory=CheckpointerConfig)
    """How checkpoints are written and read: threads, staging, uploads, the save folder's lease."""
    device: str | None = None
    """Where batches go. Defaults to where the train module's model lives (its ``device``, or
    its parameters'), so a model kept on the CPU trains on the CPU on a GPU machine too; a
    model still on the meta device, or none, means this rank's GPU if there is one, else the
    CPU. Set explicitly, it must match the model's device: the build refuses a mismatch
    rather than failing at the first forward pass."""
    save_overwrite: bool = False
    """Allow replacing checkpoints and files that already exist in the save folder; off, an existing
    checkpoint of the same step is an error, never overwritten."""
    max_duration: Duration = field(default_factory=lambda: Duration.epochs(1))
    """How long the run trains, in steps, tokens or epochs (:class:`~olmolike.train.Duration`). It
    sets the length of the LR schedule, so the step count must be known before the first step: with
    a data loader of unknown length, give steps or tokens."""
    cancel_check_interval: int = 25
    """Steps between the checks that every rank makes together of whether any rank was asked to stop
    (a signal, a callback's cancel): all stop at the same step. Each check is one small collective
    on the bookkeeping process group."""
    hard_stop: Duration | None = None
    """Stop at this point (steps, tokens or epochs) without changing ``max_duration``, so the LR
    schedule is the full run's: for a shortened ablation. ``None``: train to ``max_duration``."""
    metrics_collect_interval: int = 5
    """Steps between metric collections: the metrics of those steps are moved to the host in one
    transfer, reduced over ranks and handed to the callbacks' ``log_metrics`` then. A larger
    interval costs fewer device-to-host syncs; every step is still logged, later."""
    callbacks: dict[str, Callback] = field(default_factory=dict)
    """The callbacks, by name (a name is also how an override reaches one:
    ``--trainer.callbacks.checkpointer.save_interval=500``)."""
    async_bookkeeping: bool | None = None
    """Run the metric reductions and other bookkeeping collectives on a background thread with a
    process group of its own, off the training loop. ``None`` chooses: yes unless one process trains
    on the CPU (nothing to overlap there). Needs a backend that runs on the CPU (gloo)."""
    bookkeeping_soft_timeout: int = 30
    """Seconds a bookkeeping operation may run before a warning names it (a rank may be stalled);
    the operation goes on."""
    train_timeout_seconds: int | None = 300
    """After the first step, the timeout of the process groups (all but the checkpointer's,
    whose ranks wait at barriers while others upload) drops from the run's (the ``timeout``
    of ``prepare_training_environment``, for start-up) to this many seconds, so that a
    collective some rank never joins fails with an error naming it within minutes. ``None``
    keeps the run's timeout."""
    no_checkpoints: bool = False
    """Save no checkpoint at all (and so nothing to resume from), whatever the checkpointer callback
    says: for benchmarks and throwaway runs."""
    no_evals: bool = False
    """Run no evaluator callback: for benchmarks."""
    steps_to_skip: list[StepSkipRange] | None = None
    """Ranges of steps whose batches are read but not trained on
    (:class:`~olmolike.train.StepSkipRange`): to step over data that made a run diverge without
    changing what comes after. ``None``: none."""
    checkpoints_to_eval: list[str] | None = None
    """Checkpoints (or folders of them: their latest) that ``Trainer.eval_checkpoints()``
    evaluates; see ``build(eval_only=True)``."""

    def validate(self) -> None:
        if not self.save_folder:
            raise self._invalid("save_folder", "must be a local directory or a URL")
        if self.max_duration.value == 0:
            # Else a scheduler's ValueError about t_max, far from the setting that caused it.
            raise self._invalid(
                "max_duration.value", "must be >= 1: a run of length 0 trains nothing"
            )
        for name in (
            "cancel_check_interval",
            "metrics_collect_interval",
            "bookkeeping_soft_timeout",
        ):
            if getattr(self, name) < 1:
                raise self._invalid(name, f"must be >= 1, got {getattr(self, name)}")
        if self.train_timeout_seconds is not None and self.train_timeout_seconds < 1:
            raise self._invalid(
                "train_timeout_seconds",
                f"must be >= 1 or None (keep the run's timeout), got {self.train_timeout_seconds}",
            )
        if self.device is not None:
            try:
                torch.device(self.device)
            except RuntimeError:
                raise self._invalid("device", f"{self.device!r} is not a torch device") from None

    def _device_for(self, train_module: TrainModule) -> torch.device:
        model_device = _model_device(train_module)
        if self.device is None:
            return model_device or get_default_device()
        device = _normalized(torch.device(self.device))
        if model_device is not None and device != model_device:
            raise self._invalid(
                "device",
                f"{self.device!r}, but the train module's model is on {model_device}: batches "
                f"would not reach it. Leave device unset to train where the model is, or put "
                f"the model on {device} (the train module config's build(model, device=...))",
            )
        return device

    def add_callback(self, name: str, callback: Callback) -> None:
        """Add another callback; ``name`` must be unique."""
        if name in self.callbacks:
            raise self._invalid("callbacks", f"a callback named {name!r} already exists")
        self.callbacks[name] = callback

    def add_callbacks(self, callbacks: dict[str, Callback]) -> None:
        for name, callback in callbacks.items():
            self.add_callback(name, callback)

    def with_callback(self, name: str, callback: Callback) -> TrainerConfig:
        """A new config with one more callback."""
        return self.with_callbacks({name: callback})

    def with_callbacks(self, callbacks: dict[str, Callback]) -> TrainerConfig:
        """A new config with more callbacks (names must be unique)."""
        new = replace(self, callbacks=dict(self.callbacks))
        new.add_callbacks(callbacks)
        return new

    def with_recommended_evals(
        self,
        tokenizer: object = None,
        sequence_length: int | None = None,
        cluster: str | None = None,
        task_set: str | None = None,
        eval_interval: int = 10_000,
        lazy_load: bool = False,
        *,
        eval_data: list[str] | None = None,
    ) -> TrainerConfig:
        """A new config that also evaluates held-out LM loss every ``eval_interval`` steps and
        at the end (OLMo-core 3.0's method, as far as olmolike can follow it).

        OLMo-core adds its cluster's validation mixes and downstream tasks; olmolike has
        neither, so name the held-out token files (``.npy``) with ``eval_data``. ``tokenizer``
        and ``lazy_load`` are accepted for compatibility and not needed.
        """
        del tokenizer, lazy_load
        from ..data.numpy_dataset import NumpyDatasetConfig
        from .callbacks.evaluator import LMEvaluatorCallbackConfig

        if cluster is not None or task_set is not None:
            raise self._invalid(
                "callbacks",
                "olmolike has no cluster data mixes or downstream task sets; pass held-out "
                "token files as eval_data=[...] (and no cluster or task_set)",
            )
        if not eval_data or sequence_length is None:
            raise self._invalid(
                "callbacks",
                "with_recommended_evals needs eval_data (held-out .npy token files) and "
                "sequence_length",
            )
        evaluator = LMEvaluatorCallbackConfig(
            eval_dataset=NumpyDatasetConfig(paths=list(eval_data), sequence_length=sequence_length),
            eval_interval=eval_interval,
            eval_on_finish=True,
        )
        return self.with_callback("lm_evaluator", evaluator)

    def build(
        self,
        train_module: TrainModule,
        data_loader: DataLoaderBase,
        *,
        dp_process_group: dist.ProcessGroup | None = None,
        checkpointer_pg: dist.ProcessGroup | None = None,
        eval_only: bool = False,
    ) -> Trainer:
        """Build the trainer. Also re-validates, since fields may have changed since construction.

        :param dp_process_group: the data-parallel group (default: the train module's, which
            is all ranks unless it splits the model across ranks).
        :param checkpointer_pg: the group checkpoint I/O will use (default: all ranks).
        :param eval_only: for ``Trainer.eval_checkpoints()`` rather than ``fit()``: no
            checkpoint is saved and none is resumed from the save folder.
        """
        if eval_only:
            return replace(self, no_checkpoints=True, load_strategy=LoadStrategy.never).build(
                train_module,
                data_loader,
                dp_process_group=dp_process_group,
                checkpointer_pg=checkpointer_pg,
            )
        self.validate()
        if dp_process_group is None:
            dp_process_group = train_module.dp_process_group
        # A run refused here leaves no empty save folder (or work_dir) behind.
        with removed_if_left_empty(self.save_folder, self.work_dir):
            self._check_save_folder()
            self._check_same_on_every_rank()
            work_dir = Path(self.work_dir) if self.work_dir else self._default_work_dir()
            owned: list[dist.ProcessGroup] = []
            if checkpointer_pg is None and is_distributed():
                # Checkpoint collectives may run in a background thread: their own group.
                # It keeps the run's timeout: ranks take turns uploading a checkpoint, and
                # the others wait at a barrier meanwhile, for as long as the upload takes.
                checkpointer_pg = new_group("checkpointer", shorten_timeout=False)
                owned += [checkpointer_pg] if checkpointer_pg is not None else []
            try:
                return self._build_trainer(
                    train_module, data_loader, work_dir, dp_process_group, checkpointer_pg, owned
                )
            except BaseException:
                for group in owned:  # the trainer that would have destroyed it does not exist
                    destroy_group(group, barrier=False)
                raise

    def _build_trainer(
        self,
        train_module: TrainModule,
        data_loader: DataLoaderBase,
        work_dir: Path,
        dp_process_group: dist.ProcessGroup | None,
        checkpointer_pg: dist.ProcessGroup | None,
        owned: list[dist.ProcessGroup],
    ) -> Trainer:
        from .trainer import Trainer

        callbacks = dict(self.callbacks)
        # Defaults, unless the user has one of the kind (a user callback keeps its name): the
        # checkpointer, the console logger (metrics arrive once per collect interval: logging
        # them as they come costs least) and those the train module's metrics are meant for.
        defaults: dict[str, Callable[[], Callback]] = {
            "checkpointer": CheckpointerCallback,
            "console_logger": lambda: ConsoleLoggerCallback(
                log_interval=self.metrics_collect_interval
            ),
        }
        for name in train_module.default_callbacks():
            if name not in callback_registry:
                raise self._invalid(
                    "callbacks",
                    f"{type(train_module).__name__}.default_callbacks() names {name!r}, which "
                    "is no registered callback; import the module that defines it first",
                )
            defaults.setdefault(name, callback_registry[name])
        for name, default in defaults.items():
            kind = callback_registry[name]
            if not any(isinstance(cb, kind) for cb in callbacks.values()):
                callbacks.setdefault(name, default())
        _check_token_ids(train_module, data_loader)
        return Trainer(
            work_dir=work_dir,
            train_module=train_module,
            data_loader=data_loader,
            device=self._device_for(train_module),
            checkpointer=self.checkpointer.build(
                work_dir, save_overwrite=self.save_overwrite, process_group=checkpointer_pg
            ),
            callbacks=callbacks,
            dp_process_group=dp_process_group,
            steps_to_skip=list(self.steps_to_skip) if self.steps_to_skip else None,
            checkpoints_to_eval=list(self.checkpoints_to_eval or ()) or None,
            owned_process_groups=owned,
            **{name: getattr(self, name) for name in _AS_THEY_ARE},
        )

    def _check_same_on_every_rank(self) -> None:
        """Ranks must agree on where the run lives; checkpoints would otherwise split up."""
        if not is_distributed():
            return
        folders: list[str | None] = [None] * get_world_size()
        dist.all_gather_object(folders, self.save_folder)
        if len(set(folders)) > 1:
            listing = ", ".join(f"rank {i}: {f!r}" for i, f in enumerate(folders))
            raise self._invalid(
                "save_folder",
                f"differs between ranks ({listing}); every rank must use the same save "
                "folder, e.g. pick it on rank 0 and broadcast it",
            )

    def _check_save_folder(self) -> None:
        for name in ("save_folder", "work_dir"):
            folder = getattr(self, name)
            if folder and not is_url(folder):
                self._check_writable_directory(name, folder)
        if is_url(self.save_folder):
            url_to_fs(self.save_folder)  # a store that cannot be reached fails here, naming it
        holder = current_lease(self.save_folder, for_run=run_id())
        if holder is not None:  # the cause is another run: never advise save_overwrite here
            raise SaveFolderInUseError(in_use_message(self.save_folder, holder))
        if (
            self.load_strategy == LoadStrategy.never
            and not self.save_overwrite
            and not self.no_checkpoints
            and Checkpointer.contains_checkpoint(self.save_folder)
        ):
            raise self._invalid(
                "save_folder",
                f"{self.save_folder!r} already holds checkpoints and load_strategy is 'never', so "
                "this run would write over them. Use another save_folder, resume from them "
                "(load_strategy='if_available'), or set --trainer.save_overwrite=true (save_overwrite=True).",
            )
        if not is_url(self.save_folder) and get_world_size() > 1 and not is_shared_filesystem():
            raise self._invalid(
                "save_folder",
                f"{self.save_folder!r} is local, but the ranks run on several nodes without a "
                "shared filesystem. Use a URL (gs://, s3://), or pass shared_filesystem=True to "
                "prepare_training_environment() if the directory is on a shared drive.",
            )

    def _check_writable_directory(self, name: str, folder: str) -> None:
        """A local folder the run will write to is a directory that exists (or is created
        here) and accepts files: found now, not at the first save."""
        path = local_path(folder)
        fix = f"set trainer.{name} to a directory you can write to"
        if path.exists() and not path.is_dir():
            raise self._invalid(name, f"{folder!r} is a file, not a directory; {fix}")
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise self._invalid(name, f"cannot create {folder!r} ({e.strerror}); {fix}") from None
        if not os.access(path, os.W_OK | os.X_OK):
            raise self._invalid(name, f"{folder!r} is not writable (permissions); {fix}")

    def _default_work_dir(self) -> Path:
        if not is_url(self.save_folder):
            return local_path(self.save_folder)
        digest = hashlib.sha1(self.save_folder.encode()).hexdigest()[:12]
        return Path(tempfile.gettempdir()) / "olmolike" / digest


def _normalized(device: torch.device) -> torch.device:
    """``cuda`` as ``cuda:N`` (the current device), so two spellings of one device compare equal."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _model_device(train_module: TrainModule) -> torch.device | None:
    """Where the train module's model lives: its ``device`` attribute, else its first
    parameter's; ``None`` when it has neither or is still on the meta device."""
    device = getattr(train_module, "device", None)
    if isinstance(device, torch.device):
        return _normalized(device)
    model = getattr(train_module, "model", None)
    if isinstance(model, torch.nn.Module):
        for param in model.parameters():
            if param.device.type != "meta":
                return _normalized(param.device)
            break
    return None


def _check_token_ids(train_module: TrainModule, data_loader: DataLoaderBase) -> None:
    """Token ids the model's embedding has no row for fail as one :class:`DataError` naming
    the file and the id, at build where the data's metadata records its largest id, else when
    the instance is read: never as an ``IndexError`` inside the forward pass."""
    dataset = getattr(data_loader, "dataset", None)
    check = getattr(dataset, "check_token_ids_below", None)
    model = getattr(train_module, "model", None)
    if check is None or not isinstance(model, torch.nn.Module):
        return
    embedding = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    if embedding is not None:
        check(embedding.num_embeddings, "the model's vocabulary size")
