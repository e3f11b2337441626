"""Periodic evaluation during training: held-out LM loss and perplexity, across ranks.

Over SFT data (:class:`~olmolike.data.sft_dataset.SFTDataset`), the dataset's labels are used
as they are, so the loss is over the held-out completions' tokens only, and packed examples
are evaluated each alone (their ``doc_ids`` reach the model).
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ...data.numpy_dataset import NumpyDatasetConfig, NumpyFSLDataset
from ...data.sft_dataset import SFTDataset, SFTDatasetConfig
from ...distributed.utils import get_rank, get_world_size, is_distributed
from ...exceptions import ConfigurationError, DataError
from ...nn.functional import cross_entropy_loss
from ..common import Duration, DurationUnit
from .callback import Callback

if TYPE_CHECKING:
    from ..train_module import TrainModule

__all__ = [
    "Evaluator",
    "EvaluatorCallback",
    "LMEvaluator",
    "LMEvaluatorCallbackConfig",
    "SFTEvaluatorCallbackConfig",
    "evaluator_callbacks",
]

log = logging.getLogger(__name__)


class Evaluator(ABC):
    """Computes named metrics over some data with the train module's model.

    The callback sets ``eval_duration`` (how much of the data to use) and ``log_interval``
    (batches between progress lines) before each evaluation; an evaluator honours them where
    it can (:class:`LMEvaluator` does).
    """

    eval_duration: Duration | None = None
    log_interval: int | None = None

    def __init__(self, name: str) -> None:
        self.name = name

    @abstractmethod
    def evaluate(self, train_module: TrainModule) -> dict[str, torch.Tensor]:
        """Metrics already reduced over all ranks (every rank must call this together)."""


class LMEvaluator(Evaluator):
    """Mean cross-entropy and perplexity of next-token prediction on a token dataset.

    Instances are dealt round-robin to the data-parallel ranks (the train module's
    ``dp_process_group``, all ranks without one) and none is dropped. Every rank
    runs the same number of forward passes (a rank that has run out runs a batch whose labels
    are all ignored), because a sharded model needs every rank in every forward.
    """

    def __init__(
        self,
        name: str,
        dataset: NumpyFSLDataset | SFTDataset,
        *,
        rank_batch_instances: int,
        max_batches: int | None = None,
        device: torch.device,
        label_ignore_index: int = -100,
    ) -> None:
        super().__init__(name)
        self.dataset = dataset
        self.rank_batch_instances = rank_batch_instances
        self.max_batches = max_batches
        self.device = device
        self.ignore_index = label_ignore_index

    def _rank_batches(self, group: dist.ProcessGroup | None) -> tuple[list[list[int]], int]:
        """This data-parallel rank's batches (the ranks of a tensor-parallel group score the
        same ones together) and how many batches the rank with the most has."""
        world, rank = get_world_size(group), get_rank(group)
        limit = self._instance_limit(world)
        mine = list(range(rank, limit, world))
        per_rank = math.ceil(limit / world)
        count = math.ceil(per_rank / self.rank_batch_instances)
        size = self.rank_batch_instances
        return [mine[i * size : (i + 1) * size] for i in range(count)], count

    def _instance_limit(self, world: int) -> int:
        """How many instances (the first ones) an evaluation scores.

        ``max_batches`` counts batches as one process would run them, so the scored subset is
        the same at every world size; ``eval_duration`` in steps counts global batches (all
        ranks' together), in tokens rounds up to whole global batches, in epochs is one pass.
        """
        limit = len(self.dataset)
        if self.max_batches is not None:
            limit = min(limit, self.max_batches * self.rank_batch_instances)
        duration, global_batch = self.eval_duration, self.rank_batch_instances * world
        if duration is not None and duration.unit == DurationUnit.steps:
            limit = min(limit, duration.value * global_batch)
        elif duration is not None and duration.unit == DurationUnit.tokens:
            batch_tokens = global_batch * len(self.dataset[0]["input_ids"])
            limit = min(limit, math.ceil(duration.value / batch_tokens) * global_batch)
        return limit

    def _batch(self, indices: list[int]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The model's inputs (``input_ids``, and ``doc_ids`` if the data has them) and labels:
        the dataset's own (masked) labels if it has them, else the next tokens."""
        placeholder = not indices  # this rank ran out: a batch whose labels are all ignored
        items = [self.dataset[i] for i in (indices or [0])]
        inputs: dict[str, torch.Tensor] = {
            key: torch.stack([item[key] for item in items]).to(self.device)
            for key in ("input_ids", "doc_ids")
            if key in items[0]
        }
        ids = inputs["input_ids"]
        if placeholder:
            labels = torch.full_like(ids, self.ignore_index)
        elif "labels" in items[0]:
            labels = torch.stack([item["labels"] for item in items]).to(self.device)
            labels = labels.masked_fill(labels == -100, self.ignore_index)
        else:
            labels = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=self.ignore_index)
        return inputs, labels

    def evaluate(self, train_module: TrainModule) -> dict[str, torch.Tensor]:
        totals = torch.zeros(2, device=self.device, dtype=torch.float64)  # loss sum, tokens
        group = train_module.dp_process_group
        batches, count = self._rank_batches(group)
        for i, indices in enumerate(batches, start=1):
            if self.log_interval and (i % self.log_interval == 0 or i == count):
                log.info("[eval=%s,step=%d/%d]", self.name, i, count)
            inputs, labels = self._batch(indices)
            logits = train_module.eval_batch(inputs)
            loss_sum, _ = cross_entropy_loss(
                logits, labels, ignore_index=self.ignore_index, reduction="sum"
            )
            totals[0] += loss_sum.double()
            totals[1] += (labels != self.ignore_index).sum()
        if is_distributed():
            dist.all_reduce(totals, group=group)
        ce_loss = (totals[0] / totals[1].clamp(min=1)).float()
        return {"CE loss": ce_loss, "PPL": ce_loss.exp()}


@dataclass
class _PeriodicEvaluation(Callback):
    eval_interval: int | None = 1000
    """Evaluate every this many steps; ``None`` evaluates only at ``fixed_steps`` (and on
    startup or finish if set)."""
    fixed_steps: list[int] | None = None
    """Also evaluate at exactly these steps."""
    eval_on_startup: bool = False
    """Also evaluate before the first step (step 0 metrics are logged with step 1's)."""
    eval_on_finish: bool = False
    """Also evaluate after the last step, if it is not already an evaluation step (off by
    default, as in OLMo-core)."""
    cancel_after_first_eval: bool = False
    """Stop the run after the first evaluation; with ``eval_on_startup`` this evaluates a
    loaded checkpoint without training."""
    eval_duration: Duration = field(default_factory=lambda: Duration.epochs(1))
    """How much of each evaluation set to use: ``epochs`` for all of it, or a number of
    batches (``steps``) or tokens from its start."""
    log_interval: int = 5
    """Batches between progress lines while an evaluation runs."""

    priority = 10  # before loggers, so the metrics of an eval step are in that step's log

    def validate(self) -> None:
        if self.eval_interval is not None and self.eval_interval < 1:
            raise ConfigurationError(
                f"must be >= 1 or null (only fixed_steps), got {self.eval_interval}",
                path="eval_interval",
            )
        if self.fixed_steps is not None and any(step < 0 for step in self.fixed_steps):
            raise ConfigurationError(
                f"steps must be >= 0, got {self.fixed_steps}", path="fixed_steps"
            )
        if self.log_interval < 1:
            raise ConfigurationError(f"must be >= 1, got {self.log_interval}", path="log_interval")
        if self.eval_duration.value < 1:
            raise ConfigurationError(
                f"must be at least 1 {self.eval_duration.unit}, got {self.eval_duration.value}",
                path="eval_duration",
            )

    @abstractmethod
    def _evaluators(self) -> list[Evaluator]: ...

    def pre_train(self) -> None:
        if self.eval_on_startup and not self.trainer.no_evals:
            self.perform_eval()

    def post_step(self) -> None:
        if self.trainer.no_evals:
            return
        interval = self.eval_interval
        due = interval is not None and self.step % interval == 0
        due = due or self.step in (self.fixed_steps or ())
        if due or (self.eval_on_finish and self.trainer.training_complete):
            self.perform_eval()

    def perform_eval(self, prefix: str = "eval") -> None:
        """Run every evaluator now (all ranks together); metrics are named
        ``{prefix}/{evaluator}/{metric}`` (e.g. ``eval/merged`` for averaged weights)."""
        train_module = self.trainer.train_module
        for evaluator in self._evaluators():
            evaluator.eval_duration = self.eval_duration
            evaluator.log_interval = self.log_interval
            metrics = evaluator.evaluate(train_module)
            for metric, value in metrics.items():
                self.trainer.record_metric(
                    f"{evaluator.name}/{metric}", value, None, namespace=prefix
                )
            log.info(
                "%s %s at step %d: %s",
                prefix,
                evaluator.name,
                self.step,
                ", ".join(f"{k}={v.item():.4f}" for k, v in metrics.items()),
            )
        if self.cancel_after_first_eval and prefix == "eval":
            # Every rank evaluates at the same step, so no agreement round is needed.
            self.trainer.cancel_run("cancel_after_first_eval is set", no_sync=True)


@dataclass
class EvaluatorCallback(_PeriodicEvaluation, name="evaluator"):
    """Runs the given :class:`Evaluator` objects periodically (built in Python, not a config)."""

    evaluators: list[Evaluator] = field(default_factory=list)
    """The :class:`Evaluator` objects run at each evaluation, in order (built in Python: they hold
    datasets and models, not config values)."""

    def _evaluators(self) -> list[Evaluator]:
        return self.evaluators


@dataclass
class _HeldOutLoss(_PeriodicEvaluation):
    """The loss of one :class:`LMEvaluator` on a held-out dataset built from config values
    (its subclasses name the dataset and the batch sizes)."""

    _built: list[Evaluator] = field(default_factory=list, init=False, repr=False)

    def post_attach(self) -> None:
        self._built = [_lm_evaluator(self)]

    def _evaluators(self) -> list[Evaluator]:
        return self._built

    def state_dict(self) -> dict[str, Any]:
        return {}


@dataclass
class LMEvaluatorCallbackConfig(_HeldOutLoss, name="lm_evaluator"):
    """Validation loss and perplexity on held-out token data, from config values alone."""

    eval_dataset: NumpyDatasetConfig | None = None
    """The held-out token data (``prepare-data``'s ``val`` split, say); required. Its
    ``sequence_length`` is that of the instances evaluated."""
    eval_batch_size: int = 8
    """Instances per forward pass on each rank."""
    max_batches: int | None = None
    """Evaluate on the first ``max_batches * eval_batch_size`` instances (``None``: all of them).

    Counted as one process would, not per rank, so a validation curve scores the same
    instances, and means the same, at any world size."""
    label: str = "lm"
    """The metrics are named ``eval/{label}/CE loss`` and ``eval/{label}/PPL``."""

    def validate(self) -> None:
        super().validate()
        if self.eval_dataset is None:
            raise ConfigurationError("is required: the held-out token data", path="eval_dataset")
        if self.eval_batch_size < 1:
            raise ConfigurationError(
                f"must be >= 1, got {self.eval_batch_size}", path="eval_batch_size"
            )
        if self.max_batches is not None and self.max_batches < 1:
            # Zero batches would report a loss of 0 and a perplexity of 1: a silent wrong metric.
            raise ConfigurationError(
                f"must be >= 1 or null (the whole dataset), got {self.max_batches}",
                path="max_batches",
            )
        if not self.label.strip():
            raise ConfigurationError(
                "must not be empty: it names the metrics (eval/{label}/CE loss)", path="label"
            )


@dataclass
class SFTEvaluatorCallbackConfig(_HeldOutLoss, name="sft_evaluator"):
    """Loss on held-out SFT examples (``prepare-data --sft --val-fraction``): the mean
    cross-entropy over their completions' tokens only, logged as ``eval/{label}/CE loss``."""

    eval_dataset: SFTDatasetConfig | None = None
    """The held-out SFT data: the ``val`` split of a ``prepare-data --sft`` folder; required."""
    eval_batch_size: int = 8
    """Sequences per forward pass on each rank."""
    max_batches: int | None = None
    """Evaluate on at most this many batches per rank (``None``: every held-out sequence)."""
    label: str = "sft"
    """Names the metrics: ``eval/{label}/CE loss`` and ``eval/{label}/PPL``."""

    def validate(self) -> None:
        super().validate()
        if self.eval_dataset is None:
            raise ConfigurationError(
                "is required: the SFT folder's 'val' split", path="eval_dataset"
            )
        if self.eval_batch_size < 1 or (self.max_batches is not None and self.max_batches < 1):
            raise ConfigurationError(
                "eval_batch_size and max_batches must be >= 1 (max_batches may be null)",
                path="eval_batch_size",
            )


def evaluator_callbacks(paths: list[str], callbacks: Iterable[Callback]) -> list[Any]:
    """The callbacks that evaluate ``paths`` (``Trainer.eval_checkpoints``); raises if there
    is nothing to do."""
    if not paths:
        raise ConfigurationError(
            "lists no checkpoint; set it, or pass the checkpoints to eval_checkpoints()",
            path="checkpoints_to_eval",
        )
    evaluators = [cb for cb in callbacks if hasattr(cb, "perform_eval")]
    if not evaluators:
        raise ConfigurationError(
            "has no evaluator callback (e.g. LMEvaluatorCallbackConfig) to run on the checkpoints",
            path="callbacks",
        )
    return evaluators


def _lm_evaluator(callback: Any) -> LMEvaluator:
    """The evaluator of an LM or SFT evaluator callback: its ``eval_dataset``, batch size and
    batch limit, on the trainer's device."""
    assert callback.eval_dataset is not None
    try:
        dataset = callback.eval_dataset.build()
    except DataError as e:
        # Named here: the training data is another dataset with the same kinds of error.
        raise ConfigurationError(f"is unusable: {e}", path="eval_dataset") from e
    return LMEvaluator(
        callback.label,
        dataset,
        rank_batch_instances=callback.eval_batch_size,
        max_batches=callback.max_batches,
        device=callback.trainer.device,
        label_ignore_index=getattr(callback.trainer.train_module, "label_ignore_index", -100),
    )
