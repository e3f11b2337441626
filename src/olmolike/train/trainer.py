"""The training loop and its state. Metrics, bookkeeping, cancellation, duration math and
checkpoints live in components of their own; this file wires them into the loop."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from .. import io
from ..config import check_choice_fields
from ..data.data_loader import DataLoaderBase
from ..distributed.utils import get_rank, get_world_size
from ..exceptions import ConfigurationError, DataError
from ..utils import move_to_device
from . import durations
from .background_ops import BookkeepingRunner, build_bookkeeping
from .callbacks.callback import Callback
from .callbacks.evaluator import evaluator_callbacks
from .callbacks.hooks import HookCaller
from .callbacks.speed_monitor import speed_of
from .cancellation import CancelCoordinator, exit_if_signaled
from .checkpoint import Checkpointer
from .checkpoint.run import RunCheckpoints, checkpoint_step
from .common import (
    Duration,
    DurationUnit,
    LoadStrategy,
    StepSkipRange,
    TrainingProgress,
)
from .metric_buffer import MetricBuffer, _record_ce_loss, _record_metric, metric_name
from .run_scope import RunScope
from .step_results import StepResults
from .train_module import TrainModule
from .trainer_parts import build_parts
from .trainer_state import TrainerStateDict, load_trainer_state_dict, trainer_state_dict

__all__ = ["Trainer", "TrainerStateDict"]

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class Trainer:
    """Language model trainer. Build it with :class:`~olmolike.train.TrainerConfig`."""

    work_dir: Path
    """A local directory for temporary files; :meth:`persist_working_file` uploads from it."""
    train_module: TrainModule
    """What one step does: the model, its optimizer and loss
    (:class:`~olmolike.train.train_module.TrainModule`)."""
    data_loader: DataLoaderBase
    """Which batches come next, and where a resumed run continues
    (:class:`~olmolike.data.DataLoaderBase`)."""
    device: torch.device
    """Where batches go: the device of the train module's model."""
    save_folder: str
    """Where checkpoints and run files go: a local directory (shared by all ranks) or a URL."""
    checkpointer: Checkpointer
    """Writes and reads the checkpoints (:class:`~olmolike.train.checkpoint.Checkpointer`)."""
    callbacks: dict[str, Callback]
    """The callbacks by name, called in priority order at each hook."""
    max_duration: Duration
    """How long to train. The step count must be known ahead of time (the LR schedule needs it)."""
    save_overwrite: bool = False
    """Whether existing checkpoints in the save folder may be replaced
    (:attr:`TrainerConfig.save_overwrite`)."""
    load_path: str | None = None
    """Where to load from when the save folder holds no checkpoint
    (:attr:`TrainerConfig.load_path`)."""
    load_strategy: LoadStrategy = LoadStrategy.if_available
    """Whether ``fit()`` loads a checkpoint first (:attr:`TrainerConfig.load_strategy`)."""
    load_trainer_state: bool | None = None
    """Whether a load restores the trainer state; ``None``: if the checkpoint has it
    (:attr:`TrainerConfig.load_trainer_state`)."""
    load_optim_state: bool | None = None
    """Whether a load restores the optimizer state; ``None``: if the checkpoint has it
    (:attr:`TrainerConfig.load_optim_state`)."""
    metrics_collect_interval: int = 5
    """Steps between metric collections; each costs one device-to-host transfer."""
    dp_process_group: dist.ProcessGroup | None = None
    """The process group of the data-parallel ranks (``None``: the default group), over which the
    loader splits batches and metrics are reduced."""
    global_step: int = 0
    """The current step, 1-based once training starts; never reset by an epoch."""
    global_train_tokens_seen: int = 0
    """Training tokens consumed so far over all ranks (saved with each checkpoint)."""
    global_train_petaflops: float = 0.0
    """Training compute so far over all ranks, in petaFLOPs, from the train module's FLOPs per token
    (saved with each checkpoint)."""
    epoch: int = 1
    """The current epoch (1-based)."""
    cancel_check_interval: int = 25
    """Steps between the agreed checks for a stop request
    (:attr:`TrainerConfig.cancel_check_interval`)."""
    hard_stop: Duration | None = None
    """Stop here without changing ``max_duration`` (and so without changing the LR schedule)."""
    async_bookkeeping: bool | None = None
    """Whether bookkeeping collectives run on a background thread; resolved when the trainer is
    built (:attr:`TrainerConfig.async_bookkeeping`)."""
    bookkeeping_soft_timeout: int = 30
    """Seconds before a slow bookkeeping operation is warned about
    (:attr:`TrainerConfig.bookkeeping_soft_timeout`)."""
    train_timeout_seconds: int | None = 300
    """After the first step, every process group's timeout drops to this (``None``: keep the
    run's timeout): a collective some rank never joins then fails with an error naming it."""
    no_checkpoints: bool = False
    """Save no checkpoint at all (:attr:`TrainerConfig.no_checkpoints`)."""
    no_evals: bool = False
    """Run no evaluator callback (:attr:`TrainerConfig.no_evals`)."""
    steps_to_skip: list[StepSkipRange] | None = None
    """Ranges of steps whose batches are not trained on (:attr:`TrainerConfig.steps_to_skip`)."""
    checkpoints_to_eval: list[str] | None = None
    """Checkpoints :meth:`eval_checkpoints` evaluates (OLMo-core 3.0)."""
    owned_process_groups: list[dist.ProcessGroup] = field(default_factory=list, repr=False)
    """Process groups made for this trainer (:meth:`TrainerConfig.build` makes the
    checkpointer's), destroyed with the bookkeeping group when ``fit()`` or
    ``eval_checkpoints()`` ends; groups passed in by the caller stay the caller's."""

    _bookkeeping: BookkeepingRunner = field(init=False, repr=False)
    _step_results: StepResults = field(init=False, repr=False)
    _cancel: CancelCoordinator = field(init=False, repr=False)
    _hooks: HookCaller = field(init=False, repr=False)
    _flops: durations.FlopCounter = field(init=False, repr=False)
    _blocking_ephemeral_checkpoints: set[str] = field(default_factory=set, init=False, repr=False)
    _checkpoints: RunCheckpoints = field(init=False, repr=False)
    _scope: RunScope = field(init=False, repr=False)

    def __post_init__(self) -> None:
        check_choice_fields(self)
        self.work_dir = Path(self.work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        group = self.dp_process_group
        self.data_loader.check_data_parallel(get_rank(group), get_world_size(group))
        self._bookkeeping, self.async_bookkeeping = build_bookkeeping(
            self.async_bookkeeping, self.device, self.bookkeeping_soft_timeout
        )
        try:
            self._wire()
        except BaseException:
            self._bookkeeping.close(clean=False)  # a trainer that fails to build holds nothing
            raise

    def _wire(self) -> None:
        """Build the components (``trainer_parts.py``), attach the train module and callbacks."""
        parts = build_parts(self, self._bookkeeping)
        self._flops, self._cancel, self._hooks = parts.flops, parts.cancel, parts.hooks
        self._checkpoints, self._step_results, self._scope = (
            parts.checkpoints,
            parts.step_results,
            parts.scope,
        )
        self.train_module._attach_trainer(self, self._step_results.metrics)
        self._hooks.attach(self, self.callbacks.values(), self.callbacks.values())

    # -- construction ------------------------------------------------------------------------

    def add_callback(self, name: str, callback: Callback) -> None:
        """Add a callback; ``name`` must be unique."""
        if name in self.callbacks:
            raise ConfigurationError(f"a callback named {name!r} already exists", path="callbacks")
        self.callbacks[name] = callback
        self._hooks.attach(self, self.callbacks.values(), [callback])

    def has_callback(self, cb_class: type[Callback]) -> bool:
        """Whether an instance of ``cb_class`` (or of a subclass) is attached."""
        return any(isinstance(cb, cb_class) for cb in self.callbacks.values())

    def get_callback_name(self, callback: Callback) -> str:
        """The name under which ``callback`` is attached."""
        names = [name for name, attached in self.callbacks.items() if attached is callback]
        if not names:
            raise ValueError(f"{type(callback).__name__} is not attached to this trainer")
        return names[0]

    @property
    def block_ephemeral_checkpoints(self) -> bool:
        """Whether some callback blocks ephemeral checkpoints right now (OLMo-core's name)."""
        return bool(self._blocking_ephemeral_checkpoints)

    def set_ephemeral_checkpoints_blocked(self, owner: str, blocked: bool) -> None:
        """Block (or stop blocking) ephemeral checkpoints on behalf of ``owner`` (a callback's
        name); they are saved again once no owner blocks them."""
        if blocked:
            self._blocking_ephemeral_checkpoints.add(owner)
        else:
            self._blocking_ephemeral_checkpoints.discard(owner)

    # -- sizes and durations -----------------------------------------------------------------

    @property
    def global_batch_size(self) -> int:
        """Global training batch size in tokens."""
        return self.data_loader.global_batch_size

    @property
    def rank_batch_size(self) -> int:
        """Tokens in each training batch on this rank."""
        return self.data_loader.rank_batch_size

    @property
    def tokens_per_batch(self) -> int:
        """Tokens in each training batch, all ranks together (OLMo-core's other name for
        :attr:`global_batch_size`)."""
        return self.global_batch_size

    @property
    def steps_per_epoch(self) -> int | None:
        return self.data_loader.total_batches

    @property
    def tokens_per_epoch(self) -> int | None:
        steps = self.steps_per_epoch
        return None if steps is None else steps * self.global_batch_size

    def convert_duration_to_steps(self, duration: Duration) -> int:
        """The global step at which ``duration`` is reached."""
        if duration.unit == DurationUnit.steps:
            return duration.value  # asked every step (progress, ETAs): no progress to read
        return durations.duration_to_steps(duration, self._progress())

    def _progress(self) -> durations.Progress:
        return durations.Progress(
            self.global_step,
            self.global_train_tokens_seen,
            self.global_batch_size,
            self.steps_per_epoch,
        )

    def _stop_step(self) -> int:
        return durations.stop_step(self.max_duration, self.hard_stop, self._progress())

    @property
    def max_steps(self) -> int | None:
        """The step ``max_duration`` ends at, or ``None`` if it cannot be known ahead of time."""
        try:
            return self.convert_duration_to_steps(self.max_duration)
        except ConfigurationError:
            return None

    @property
    def max_tokens(self) -> int | None:
        return durations.duration_to_tokens(self.max_duration, self._progress())

    @property
    def training_complete(self) -> bool:
        if self._cancel.canceled:
            return True
        if self.hard_stop is None and self.max_duration.unit == DurationUnit.steps:
            return self.global_step >= self.max_duration.value  # asked every step: no call
        return self.global_step >= self._stop_step()

    @property
    def training_progress(self) -> TrainingProgress:
        """Where the run stands, with speed figures from the speed monitor if there is one."""
        return durations.training_progress(
            self.max_duration, self.hard_stop, self._progress(), speed_of(self.callbacks.values())
        )

    # -- bookkeeping -------------------------------------------------------------------------

    @property
    def bookkeeping_device(self) -> torch.device:
        """Where bookkeeping collectives run: the CPU with gloo, else the training device."""
        return self._step_results.device

    @property
    def bookkeeping_pg(self) -> dist.ProcessGroup | None:
        """The bookkeeping thread's own process group, used by no other thread."""
        return self._bookkeeping.group

    @property
    def multi_thread_pool(self) -> Executor:
        """Threads for bookkeeping that involves no distributed communication."""
        return self._bookkeeping.multi_thread_pool

    @property
    def single_thread_pool(self) -> Executor:
        """The one thread on which bookkeeping collectives run, in submission order."""
        return self._bookkeeping.single_thread_pool

    def run_bookkeeping_op(
        self,
        op: Callable[..., T],
        *args: Any,
        cb: Callable[[T], None] | None = None,
        op_name: str | None = None,
        cancel_in_progress: bool | None = None,
        allow_multiple: bool = True,
        soft_timeout: int | None = None,
        distributed: bool = True,
        **kwargs: Any,
    ) -> Future[T]:
        """Run a bookkeeping op, in the background when bookkeeping is asynchronous; the
        arguments and when ``cb(result)`` runs are those of
        :meth:`~olmolike.train.background_ops.BookkeepingRunner.submit`."""
        return self._bookkeeping.submit(
            op,
            *args,
            cb=cb,
            op_name=op_name,
            soft_timeout=soft_timeout,
            distributed=distributed,
            allow_multiple=allow_multiple,
            cancel_in_progress=cancel_in_progress,
            **kwargs,
        )

    # -- cancellation ------------------------------------------------------------------------

    @property
    def is_canceled(self) -> bool:
        """Whether all ranks have agreed to stop (a request alone does not count yet)."""
        return self._cancel.canceled

    def cancel_run(self, reason: str, no_sync: bool = False) -> None:
        """Ask for the run to stop gracefully at the next cancel check.

        :param no_sync: only if every rank calls this at the same step: then the run stops at
            the end of the current step without a check.
        """
        self._cancel.request(reason, no_sync=no_sync)

    def check_if_canceled(self) -> None:
        """Start a check whether any rank canceled; all ranks must call it at the same step."""
        self._step_results.check_if_canceled(self.global_step)

    # -- metrics -----------------------------------------------------------------------------

    # One implementation, the train module's too: into the metric buffer, at the current step.
    record_metric = _record_metric
    record_ce_loss = _record_ce_loss

    def _metric_buffer(self) -> tuple[MetricBuffer, int]:
        return self._step_results.metrics, self.global_step

    def get_metric(self, name: str, namespace: str | None = None) -> torch.Tensor | None:
        """A metric recorded in the current step. Reading its value syncs with the device."""
        return self._step_results.metrics.get(self.global_step, metric_name(name, namespace))

    # -- state -------------------------------------------------------------------------------

    def state_dict(self) -> TrainerStateDict:
        """Trainer state (not model or optimizer): counters, data position, RNG, callbacks."""
        return trainer_state_dict(self)

    def load_state_dict(self, state_dict: TrainerStateDict) -> None:
        """Restore trainer state saved by :meth:`state_dict`."""
        load_trainer_state_dict(self, state_dict)

    # -- checkpoints and files ---------------------------------------------------------------

    @property
    def checkpoint_loaded(self) -> bool:
        """Whether a checkpoint has been loaded."""
        return self._checkpoints.loaded

    def checkpoint_dir(self, step: int | None = None) -> str:
        """The folder the checkpoint of ``step`` (default: the current step) is saved to."""
        step = self.global_step if step is None else step
        return io.join_path(self.save_folder, Checkpointer.checkpoint_dirname(step))

    def add_checkpoint_file(self, name: str, contents: str | bytes) -> None:
        """Include a file named ``name`` in every checkpoint saved from now on.

        Rank 0 writes it into the checkpoint folder before the completion marker, so a copied
        checkpoint folder carries it. Adding a name again replaces its contents.
        """
        self._checkpoints.add_file(name, contents)

    def save_checkpoint(self, ephemeral: bool = False) -> str:
        """Save a checkpoint of the current step to the save folder; returns its path."""
        path, _ = self._save(ephemeral, background=False)
        self._step_results.deliver_saves()  # every rank saved it just now: an agreed step
        return path

    def save_checkpoint_async(self, ephemeral: bool = False) -> tuple[str, Future[None]]:
        """Start saving a checkpoint of the current step; the future completes when it is whole."""
        return self._save(ephemeral, background=True)

    def _save(self, ephemeral: bool, *, background: bool) -> tuple[str, Future[None]]:
        """The checkpointer saves; the step component delivers the save's completion."""
        path = self.checkpoint_dir()
        future = self.checkpointer.save(
            path,
            self.train_module,
            self.state_dict(),
            ephemeral,
            self._checkpoints.extra_files,
            background=background,
        )
        self._step_results.track_save(path, future)
        return path, future

    def wait_for_checkpoints(self) -> None:
        """Wait for the background saves, then deliver their ``post_checkpoint_saved`` (or raise
        a failed save's error). Every rank calls it at the same point, e.g. in ``post_train``."""
        self._step_results.deliver_saves(wait=True)

    def load_checkpoint(
        self,
        dir: str | Path,
        *,
        load_trainer_state: bool | None = None,
        load_optim_state: bool | None = None,
        reset_optimizer_states_on_load: bool = False,
    ) -> None:
        """Load a checkpoint, or the latest one in a folder of checkpoints.

        :param reset_optimizer_states_on_load: after loading, start the optimizer's
            per-parameter state (moments, step counts) afresh while keeping its settings and
            the model's weights: e.g. to continue a run on new data without its old momentum.
        """
        path = self._checkpoints.load(
            dir,
            self.load_state_dict,
            load_trainer_state=load_trainer_state,
            load_optim_state=load_optim_state,
            reset_optimizer_states_on_load=reset_optimizer_states_on_load,
        )
        self._hooks("post_checkpoint_loaded", path)

    def maybe_load_checkpoint(
        self,
        dir: str | Path | None = None,
        *,
        load_trainer_state: bool | None = None,
        load_optim_state: bool | None = None,
        reset_optimizer_states_on_load: bool = False,
    ) -> bool:
        """Like :meth:`load_checkpoint`, but does nothing if ``dir`` (default: the save folder)
        holds no checkpoint. Returns whether one was loaded."""
        dir = self.save_folder if dir is None else dir
        if not Checkpointer.contains_checkpoint(dir):
            return False
        self.load_checkpoint(
            dir,
            load_trainer_state=load_trainer_state,
            load_optim_state=load_optim_state,
            reset_optimizer_states_on_load=reset_optimizer_states_on_load,
        )
        return True

    def write_file(self, name: str, contents: str | bytes, dir: str | Path | None = None) -> str:
        """Write ``contents`` to ``name`` under ``dir`` (default: the save folder)."""
        return io.write_file(dir or self.save_folder, name, contents, overwrite=self.save_overwrite)

    def persist_working_file(self, name: str | Path) -> str:
        """Copy ``work_dir/name`` to ``save_folder/name`` (nothing to do if they are the same)."""
        return io.persist(
            self.work_dir, self.save_folder, name, overwrite=self.save_overwrite, directory=False
        )

    def persist_working_subdir(self, name: str | Path) -> str:
        """Copy the directory ``work_dir/name`` to ``save_folder/name``."""
        return io.persist(
            self.work_dir, self.save_folder, name, overwrite=self.save_overwrite, directory=True
        )

    # -- the loop ----------------------------------------------------------------------------

    def fit(self) -> None:
        """Train until ``max_duration`` or ``hard_stop`` is reached or the run is canceled."""
        with self._cancel.signals_cancel(), self._scope.running():
            self._checkpoints.resume(self.load_checkpoint)
            self._stop_step()  # an unknown step count is a clear error now, not mid-run
            self._fit()
        exit_if_signaled(self._cancel.reason, self.global_step, self.save_folder)

    def eval_checkpoints(self, checkpoints: Sequence[str] | None = None) -> None:
        """Evaluate each checkpoint (default: ``checkpoints_to_eval``) with every evaluator
        callback, instead of training.

        Each checkpoint's model is loaded (not its optimizer or trainer state; a folder of
        checkpoints means its latest), evaluated, and its metrics are logged at the
        checkpoint's step to the logger callbacks. Every callback except the evaluators gets
        ``pre_train`` first and ``post_train`` last, as around training, so loggers open and
        close their runs. Build the trainer with ``build(..., eval_only=True)``: no checkpoint
        is saved and nothing is resumed from the save folder.
        """
        paths = list(self.checkpoints_to_eval or ()) if checkpoints is None else list(checkpoints)
        evaluators = evaluator_callbacks(paths, self.callbacks.values())
        with self._scope.running():
            self._hooks.call_except("pre_train", evaluators)
            for path in paths:
                self.load_checkpoint(path, load_trainer_state=False, load_optim_state=False)
                self.global_step = checkpoint_step(path)
                log.info("Evaluating the checkpoint of step %d (%s)", self.global_step, path)
                self._step_results.metrics.begin_step(self.global_step)
                for evaluator in evaluators:
                    evaluator.perform_eval()
                self._step_results.flush()
            self._hooks.call_except("post_train", evaluators)

    def _fit(self) -> None:
        # Warns, naming the field to change; else says what it trains.
        if not durations.nothing_to_train(
            self.max_duration, self.hard_stop, self._progress(), self.save_folder
        ):
            log.info(
                "Training from step %d to step %d (%s tokens per step, %d rank(s))",
                self.global_step,
                self._stop_step(),
                f"{self.global_batch_size:,d}",
                get_world_size(),
            )
        self.train_module.on_fit_start(resumed=self.checkpoint_loaded)
        self._hooks("pre_train")
        while not self.training_complete:
            self._fit_epoch()
        self._step_results.flush()
        self._cancel.log_outcome(self.global_step)
        self._hooks("post_train")
        self._step_results.flush()  # what post_train recorded or submitted, errors included
        done = "stopped (canceled)" if self.is_canceled else "done"
        log.info("Training %s at step %d", done, self.global_step)

    def _fit_epoch(self) -> None:
        loader = self.data_loader
        loader.reshuffle(epoch=self.epoch)
        self._hooks("pre_epoch")
        batches = iter(loader)
        trained_before = self.global_step
        exhausted = False
        # A loader that knows the epoch is over is not asked for another batch.
        while not self.training_complete and not loader.epoch_finished:
            for hook in self._hooks.table["pre_load_batch"]:  # the step's hooks: see _train_step
                hook()
            batch = next(batches, None)
            if batch is None:
                exhausted = True
                break
            self._train_step(batch)
        if (
            exhausted
            and self.global_step == trained_before
            and not self.data_loader.batches_processed
        ):
            raise DataError(f"the data loader produced no batches in epoch {self.epoch}")
        if exhausted or self.data_loader.epoch_finished:
            self._hooks("post_epoch")
            self.epoch += 1
            self.data_loader.reset()

    def _train_step(self, batch: dict[str, Any]) -> None:
        # The step's flow leaves this file for the train module, the hooks and the step
        # component, and does not come back to it in between (test_step_path.py counts it).
        step = self.global_step = self.global_step + 1
        tokens = self.data_loader.global_batch_size  # callbacks change it between steps only
        self.global_train_tokens_seen += tokens
        self._step_results.begin_step(step)
        batch = move_to_device(batch, self.device)
        # The step's hooks are called from their table (read each time: a hook may add a
        # callback), not through the HookCaller: most have no callbacks, and every call costs
        # a few microseconds with the caches cold after the step's compute.
        for hook in self._hooks.table["pre_step"]:
            hook(batch)
        if self.steps_to_skip and any(step in skip for skip in self.steps_to_skip):
            log.info(
                "Skipping step %d (steps_to_skip): its batch is consumed, not trained on", step
            )
        else:
            self.train_module.train_batch(batch)
            for hook in self._hooks.table["pre_optim_step"]:
                hook()
            self.train_module.optim_step()
            self.train_module.zero_grads()
            seq_len = int(batch["input_ids"].shape[-1])
            self.global_train_petaflops += self._flops.petaflops(seq_len, tokens)
        for hook in self._hooks.table["post_train_batch"]:
            hook()
        for hook in self._hooks.table["post_step"]:
            hook()
        self._step_results.end_step(step)
