"""Evaluating saved checkpoints with the trainer's evaluator callbacks (OLMo-core 3.0's
``Trainer.eval_checkpoints``); ``Trainer`` inherits it."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..exceptions import CheckpointError, ConfigurationError
from .callbacks.callback import Callback
from .checkpoint import Checkpointer, CheckpointMetadata
from .trainer_io import TrainerCheckpointing

if TYPE_CHECKING:
    from .bookkeeping import BookkeepingRunner
    from .metrics import MetricBuffer

__all__ = ["TrainerEval"]

log = logging.getLogger(__name__)


class TrainerEval(TrainerCheckpointing):
    """:meth:`eval_checkpoints`."""

    callbacks: dict[str, Callback]
    checkpoints_to_eval: list[str] | None
    _hooks: dict[str, list[Callable[..., None]]]

    if TYPE_CHECKING:
        _metrics: MetricBuffer
        _bookkeeping: BookkeepingRunner
        _error: BaseException | None

        def _collect_metrics(self) -> None: ...
        def _handle_error(self, exc: BaseException) -> None: ...
        def _close(self) -> None: ...

    def eval_checkpoints(self, checkpoints: Sequence[str] | None = None) -> None:
        """Evaluate each checkpoint (default: ``checkpoints_to_eval``) with every evaluator
        callback, instead of training.

        Each checkpoint's model is loaded (not its optimizer or trainer state; a folder of
        checkpoints means its latest), evaluated, and its metrics are logged at the checkpoint's step to the logger
        callbacks. Every callback except the evaluators gets ``pre_train`` first and
        ``post_train`` last, as around training, so loggers open and close their runs. Build
        the trainer with ``build(..., eval_only=True)``: no checkpoint is saved and nothing is
        resumed from the save folder.
        """
        paths = list(self.checkpoints_to_eval or ()) if checkpoints is None else list(checkpoints)
        if not paths:
            raise ConfigurationError(
                "lists no checkpoint; set it, or pass the checkpoints to eval_checkpoints()",
                path="checkpoints_to_eval",
            )
        evaluators = [cb for cb in self.callbacks.values() if hasattr(cb, "perform_eval")]
        if not evaluators:
            raise ConfigurationError(
                "has no evaluator callback (e.g. LMEvaluatorCallbackConfig) to run on the "
                "checkpoints",
                path="callbacks",
            )
        self._error = None
        try:
            self._call_others("pre_train", evaluators)
            for path in paths:
                self._load_for_eval(path)
                log.info("Evaluating the checkpoint of step %d (%s)", self.global_step, path)
                self._metrics.begin_step(self.global_step)
                for evaluator in evaluators:
                    evaluator.perform_eval()
                self._collect_metrics()
                self._bookkeeping.wait_all()
            self._call_others("post_train", evaluators)
        except BaseException as exc:
            self._error = exc
            self._handle_error(exc)
            raise
        finally:
            self._close()

    def _load_for_eval(self, path: str) -> None:
        """The model of ``path`` (or of its latest checkpoint), and its step as the trainer's.

        Not its trainer state: the data position belongs to the run that saved it.
        """
        if not Checkpointer.dir_is_checkpoint(path) and Checkpointer.contains_checkpoint(path):
            path = Checkpointer.latest_checkpoint(path)
        self.load_checkpoint(path, load_trainer_state=False, load_optim_state=False)
        step = CheckpointMetadata.read(path).step
        if step is None:
            raise CheckpointError(f"{path} does not record its step; cannot log its metrics")
        self.global_step = step

    def _call_others(self, hook: str, evaluators: list[Callback]) -> None:
        for method in self._hooks[hook]:
            owner = getattr(method, "__self__", None)
            if not any(owner is evaluator for evaluator in evaluators):
                method()
