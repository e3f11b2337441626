"""What one training step does: the model, its optimizer, the loss, data parallelism."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from ...distributed.checkpoint import apply_model_and_optim_state_dict, model_and_optim_state_dict
from ...distributed.utils import AgreedCounts, agree_counts, get_world_size, is_distributed
from ...exceptions import ConfigurationError
from ..common import ReduceType
from ..metric_buffer import MetricBuffer, _record_ce_loss, _record_metric

if TYPE_CHECKING:
    import torch.distributed as dist

    from ..trainer import Trainer

__all__ = ["BasicTrainModule", "ModelAndOptimTrainModule", "TrainModule"]


class TrainModule(ABC):
    """Owns the model and optimizer and knows how to train on one batch.

    The trainer calls, for every step: :meth:`train_batch` (forward and backward over
    micro-batches), then :meth:`optim_step`, then :meth:`zero_grads`. ``record_metric`` and
    ``record_ce_loss`` record into the trainer's metrics, as the trainer's methods do.
    """

    loss_metric: ClassVar[str] = "train/CE loss"
    """The metric holding the loss this module optimises, recorded by :meth:`record_loss`.
    Callbacks that watch "the loss" (stability monitor, progress bar) default to it, so a DPO
    run is watched on its DPO loss and no metric is named for a loss it is not. Pretraining
    and SFT keep OLMo-core's ``train/CE loss``."""

    dp_process_group: dist.ProcessGroup | None = None
    """The data-parallel group: the ranks that see different batches. Under tensor
    parallelism it is smaller than the world; the trainer checks the data loader against it.
    olmolike's train modules set it to a group whenever distributed (the default group when
    every rank sees its own batches; ``data_parallel_group()``), ``None`` only on one
    process: helpers that take ``None`` as "one process" (the GRPO loss's) then need no
    special case. The class default ``None`` (a module that sets nothing) means all ranks."""

    _metrics: MetricBuffer | None = None
    """The trainer's metric buffer, which :meth:`record_metric` records into directly."""

    def __init__(self) -> None:
        self._trainer: Trainer | None = None

    @property
    def trainer(self) -> Trainer:
        if self._trainer is None:
            raise RuntimeError(f"{type(self).__name__} is not attached to a trainer yet")
        return self._trainer

    def _attach_trainer(self, trainer: Trainer, metrics: MetricBuffer | None = None) -> None:
        self._trainer, self._metrics = trainer, metrics
        self.on_attach()

    def on_attach(self) -> None:  # noqa: B027 (an optional hook, not an abstract method)
        """Called once attached: check settings against the trainer and data loader here."""

    def on_fit_start(self, *, resumed: bool) -> None:  # noqa: B027 (optional, as on_attach)
        """Called when ``fit()`` starts, after the checkpoint it resumes from (``resumed``) was
        loaded and before any callback's ``pre_train``: the module's own start of a run, such
        as loading the pretrained weights a run that did not resume starts from."""

    def default_callbacks(self) -> tuple[str, ...]:
        """The registered names of callbacks this module's metrics are meant for (``moe_load``
        for an MoE model's expert loads): the trainer's config adds each one of whose kind the
        user configured none. A train module never adds a callback itself."""
        return ()

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Model and optimizer state, as ``{"model": ..., "optim": ...}``.

        Keyed by parameter names and made of (possibly sharded) tensors, so that
        ``torch.distributed.checkpoint`` can save it and reload it on any number of ranks.
        """

    @abstractmethod
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Apply a state dict of the form :meth:`state_dict` returns (``optim`` may be absent)."""

    def state_dict_to_save(self) -> dict[str, Any]:
        """What checkpoints save: by default :meth:`state_dict`."""
        return self.state_dict()

    def state_dict_to_load(self, optim: bool = True) -> dict[str, Any]:
        """The tensors a checkpoint is loaded into, in place, before :meth:`load_state_dict`."""
        state = self.state_dict()
        if not optim:
            state.pop("optim", None)
        return state

    @abstractmethod
    def train_batch(self, batch: dict[str, Any], dry_run: bool = False) -> None:
        """Forward and backward over ``batch``; ``dry_run`` records no metrics."""

    @abstractmethod
    def eval_batch(self, batch: dict[str, Any], labels: torch.Tensor | None = None) -> Any:
        """Evaluate ``batch`` without gradients: the loss if ``labels`` are given, else logits."""

    @abstractmethod
    def optim_step(self) -> None: ...

    @abstractmethod
    def zero_grads(self) -> None: ...

    def num_flops_per_token(self, seq_len: int) -> int | None:
        """FLOPs per trained token (forward and backward), for throughput metrics; ``None`` if unknown."""
        del seq_len
        return None

    # The trainer's: into its metric buffer, directly (the step's metrics take no detour).
    record_metric = _record_metric
    record_ce_loss = _record_ce_loss

    def _metric_buffer(self) -> tuple[MetricBuffer, int]:
        if self._metrics is None or self._trainer is None:
            return self.trainer._metric_buffer()
        return self._metrics, self._trainer.global_step

    def record_loss(
        self, value: float | torch.Tensor, reduce_type: ReduceType | None = None
    ) -> None:
        """Record the step's loss under :attr:`loss_metric`."""
        self.record_metric(self.loss_metric, value, reduce_type)


class ModelAndOptimTrainModule(TrainModule):
    """A train module holding one ``model`` and one ``optim``: their state is its state."""

    model: nn.Module
    optim: torch.optim.Optimizer
    _ddp: DDP | None = None
    """The model wrapped in DDP, where DDP averages the gradients; ``None`` otherwise."""

    @property
    def _forward_module(self) -> nn.Module:
        """What the forward passes of training call: the DDP wrapper if there is one (its
        backward averages the gradients over the data-parallel ranks), else the model."""
        return self._ddp if self._ddp is not None else self.model

    def state_dict(self) -> dict[str, Any]:
        # An optimizer that has not stepped has no state to save; asking for its state dict
        # would create some (a zero-lr step), which changes Adam's step count for the run.
        return model_and_optim_state_dict(self.model, self.optim if self.optim.state else None)

    def state_dict_to_load(self, optim: bool = True) -> dict[str, Any]:
        return model_and_optim_state_dict(self.model, self.optim if optim else None)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        apply_model_and_optim_state_dict(self.model, self.optim, state_dict)

    def on_attach(self) -> None:
        check_vocab_fits(self.model, self.trainer.data_loader)


def data_parallel_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """A train module's data-parallel group: ``group``, or when distributed without one the
    default group (every rank its own batches), so ``None`` always means one process."""
    if group is None and is_distributed():
        return dist.group.WORLD
    return group


def check_vocab_fits(model: nn.Module, data_loader: Any) -> None:
    """Token ids the data may hold (its ``vocab_size``, from ``metadata.json``) must have
    embedding rows in the model: found before step 1, not as an index error inside it."""
    data_vocab = getattr(getattr(data_loader, "dataset", None), "vocab_size", None)
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if data_vocab is None or embedding is None or data_vocab <= embedding.num_embeddings:
        return
    raise ConfigurationError(
        f"the training data's vocabulary has {data_vocab} token ids (its metadata.json or "
        f"dataset vocab_size) but the model embeds only {embedding.num_embeddings}; set "
        f"model.vocab_size to at least {data_vocab} (tokenizer.padded_vocab_size()), or "
        "prepare the data with the model's tokenizer",
        path="model.vocab_size",
    )


def check_microbatches_fit(rank_batch_size: int, rank_microbatch_size: int, path: str) -> None:
    """A rank's batch must be a whole number of micro-batches (both in tokens)."""
    if rank_batch_size % rank_microbatch_size:
        raise ConfigurationError(
            f"the rank batch size ({rank_batch_size} tokens) must be a multiple of "
            f"rank_microbatch_size ({rank_microbatch_size} tokens)",
            path=path,
        )


def microbatch_rows(input_ids: torch.Tensor, rank_microbatch_size: int, path: str) -> int:
    """Sequences per micro-batch; the micro-batch size must be whole sequences."""
    seq_len = input_ids.shape[-1]
    if rank_microbatch_size % seq_len:
        raise ConfigurationError(
            f"must be a whole number of sequences: a multiple of the sequence length "
            f"({seq_len} tokens), got {rank_microbatch_size}",
            path=path,
        )
    return rank_microbatch_size // seq_len


def agreed_microbatches(
    rows: int,
    rows_per_microbatch: int,
    group: dist.ProcessGroup | None,
    *,
    also: tuple[int, ...] = (),
) -> tuple[list[slice], AgreedCounts]:
    """This rank's micro-batches, as row slices, in a number every rank of ``group`` agrees on.

    Under FSDP every forward all-gathers and every backward reduce-scatters, so a rank that ran
    fewer micro-batches than another would leave it waiting forever. Each rank counts the
    micro-batches of ``rows_per_microbatch`` rows its own ``rows`` need; all take the largest
    count (one all-gather of a few integers, :func:`~olmolike.distributed.utils.agree_counts`,
    none on one rank); a rank with fewer gets empty slices at the end, which the train module
    runs as padding micro-batches (:func:`padding_loss`). ``also`` rides along in the same
    collective: their maxima and sums over the ranks come back in the returned counts, after the
    micro-batch count.
    """
    agreed = agree_counts([count_microbatches(rows, rows_per_microbatch), *also], group)
    return padded_microbatches(slice(0, rows), rows_per_microbatch, agreed.max[0]), agreed


def count_microbatches(rows: int, rows_per_microbatch: int) -> int:
    """How many micro-batches ``rows`` rows need on their own (at least one)."""
    return max(1, -(-rows // rows_per_microbatch))


def padded_microbatches(rows: slice, rows_per_microbatch: int, count: int) -> list[slice]:
    """Consecutive slices of at most ``rows_per_microbatch`` of ``rows``, then empty ones (the
    padding micro-batches, see :func:`is_padding`) up to ``count`` slices in all."""
    start, stop = rows.start or 0, rows.stop
    slices = [
        slice(s, min(s + rows_per_microbatch, stop))
        for s in range(start, stop, rows_per_microbatch)
    ]
    return slices + [slice(stop, stop)] * (count - len(slices))


def is_padding(rows: slice) -> bool:
    """Whether a slice of :func:`agreed_microbatches` is a padding micro-batch (it has no rows)."""
    return rows.start == rows.stop


def padding_loss(module: nn.Module, device: torch.device) -> torch.Tensor:
    """A zero loss from a forward over one token: its backward adds exactly 0 to every gradient,
    yet runs the forward and backward collectives of a sharded model like any micro-batch."""
    return module(torch.zeros((1, 1), dtype=torch.long, device=device)).float().sum() * 0.0


def labels_from_batch(batch: dict[str, Any], ignore_index: int) -> torch.Tensor:
    """Next-token labels: ``batch["labels"]`` if given, else ``input_ids`` shifted left by one."""
    labels = batch.get("labels")
    if labels is None:
        labels = F.pad(batch["input_ids"][..., 1:], (0, 1), value=ignore_index)
    # Cross-entropy needs int64 targets; token files are often int32 (asked first: .long() is
    # a tensor op even when it changes nothing).
    return labels if labels.dtype == torch.int64 else labels.long()


class BasicTrainModule(ModelAndOptimTrainModule):
    """Trains any ``nn.Module`` that maps ``input_ids`` of shape ``(B, T)`` to logits ``(B, T, V)``.

    With several ranks the model is wrapped in DDP, and gradients are synchronised only on the
    last micro-batch. The loss is the mean cross-entropy over the non-ignored tokens of the
    whole rank batch, so the split into micro-batches does not change the result.

    :param rank_microbatch_size: tokens per forward/backward pass on this rank.
    :param max_grad_norm: clip the total gradient norm to this value, if set.
    """

    def __init__(
        self,
        model: nn.Module,
        optim: torch.optim.Optimizer,
        rank_microbatch_size: int,
        max_grad_norm: float | None = None,
        label_ignore_index: int = -100,
        dp_process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        if rank_microbatch_size <= 0:
            raise ConfigurationError(
                f"must be positive, got {rank_microbatch_size}", path="rank_microbatch_size"
            )
        if max_grad_norm is not None and max_grad_norm <= 0:
            raise ConfigurationError(f"must be positive, got {max_grad_norm}", path="max_grad_norm")
        self.model = model
        self.optim = optim
        self.rank_microbatch_size = rank_microbatch_size
        self.max_grad_norm = max_grad_norm
        self.label_ignore_index = label_ignore_index
        self._params = list(model.parameters())  # not a fresh generator every step
        self._dp_group = self.dp_process_group = data_parallel_group(dp_process_group)
        # A model sharded with FSDP2 (DTensor parameters) already synchronises its gradients.
        sharded = any(isinstance(p, DTensor) for p in model.parameters())
        if is_distributed() and get_world_size(dp_process_group) > 1 and not sharded:
            self._ddp = DDP(model, process_group=dp_process_group)

    def on_attach(self) -> None:
        super().on_attach()
        check_microbatches_fit(
            self.trainer.rank_batch_size, self.rank_microbatch_size, "rank_microbatch_size"
        )

    def train_batch(self, batch: dict[str, Any], dry_run: bool = False) -> None:
        if not self.model.training:  # train() walks every submodule: not on every step
            self.model.train()
        if "doc_ids" in batch:
            raise ConfigurationError(
                "the batches are packed SFT sequences (they carry doc_ids), which "
                "BasicTrainModule would train with attention across examples and a per-rank "
                "loss mean; train them with TransformerTrainModule",
                path="train_module",
            )
        input_ids = batch["input_ids"]
        labels = labels_from_batch(batch, self.label_ignore_index)
        rows = microbatch_rows(input_ids, self.rank_microbatch_size, "rank_microbatch_size")
        slices = None  # one process, one micro-batch: nothing to agree on
        if self._dp_group is not None or input_ids.shape[0] > rows:
            slices, _ = agreed_microbatches(input_ids.shape[0], rows, self._dp_group)
        if slices is None or (len(slices) == 1 and not is_padding(slices[0])):
            # One micro-batch, the common case: cross-entropy's own mean over the non-ignored
            # tokens is the same sum / count, bit for bit, without the separate count and
            # division ops (~0.1 ms a step on a small CPU model).
            logits = self._forward_module(input_ids)
            loss = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(),
                labels.reshape(-1),
                ignore_index=self.label_ignore_index,
            )
            loss.backward()
            mean_loss = loss.detach()
            # Some label is surely not ignored, known without a tensor op, if the labels are
            # shifted token ids of 2+ tokens and the ignore index is negative (never a token).
            if not (
                "labels" not in batch and self.label_ignore_index < 0 and input_ids.shape[-1] >= 2
            ):
                # With every label ignored the mean is 0/0 = NaN (the gradients are 0): report
                # the 0 of the micro-batch path, not a NaN that looks like divergence (a real
                # NaN from diverged weights must stay visible, so not nan_to_num).
                any_label = (labels != self.label_ignore_index).any()
                mean_loss = torch.where(any_label, mean_loss, 0.0)
        else:
            # Normalise by the whole rank batch's token count: the same loss for any split.
            num_tokens = (labels != self.label_ignore_index).sum().clamp(min=1)
            mean_loss = self._accumulate(input_ids, labels, slices, num_tokens)
        if not dry_run:
            self.record_ce_loss(mean_loss, ReduceType.mean)

    def _accumulate(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        slices: list[slice],
        num_tokens: torch.Tensor,
    ) -> torch.Tensor:
        """Forward and backward over micro-batches (padding ones included); gradients are
        synchronised on the last."""
        total = torch.zeros((), device=input_ids.device)
        for i, rows in enumerate(slices):
            last = i == len(slices) - 1
            sync = contextlib.nullcontext() if last or self._ddp is None else self._ddp.no_sync()
            with sync:
                if is_padding(rows):
                    padding_loss(self._forward_module, input_ids.device).backward()
                    continue
                loss_sum = self._loss_sum(self._forward_module(input_ids[rows]), labels[rows])
                (loss_sum / num_tokens).backward()
            total += loss_sum.detach()
        return total / num_tokens

    def _loss_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(),
            labels.reshape(-1),
            ignore_index=self.label_ignore_index,
            reduction="sum",
        )

    @torch.no_grad()
    def eval_batch(self, batch: dict[str, Any], labels: torch.Tensor | None = None) -> Any:
        self.model.eval()
        logits = self.model(batch["input_ids"])
        if labels is None:
            return logits
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(),
            labels.reshape(-1),
            ignore_index=self.label_ignore_index,
        )

    def optim_step(self) -> None:
        if self.max_grad_norm is not None:
            # Returns a device tensor: recording it costs no host sync.
            grad_norm = nn.utils.clip_grad_norm_(self._params, self.max_grad_norm)
            if isinstance(grad_norm, DTensor):
                grad_norm = grad_norm.full_tensor()
            self.record_metric("total grad norm", grad_norm, namespace="optim")
        for i, group in enumerate(self.optim.param_groups):
            self.record_metric(f"LR (group {i})", float(group["lr"]), namespace="optim")
        self.optim.step()

    def zero_grads(self) -> None:
        self.optim.zero_grad(set_to_none=True)

    def num_flops_per_token(self, seq_len: int) -> int | None:
        """The model's own count if it has ``num_flops_per_token``, else ``6 x parameters``.

        The fallback is the usual dense estimate (2 FLOPs forward, 4 backward per parameter);
        it leaves out attention and counts embedding parameters, so prefer a model that knows.
        """
        own = getattr(self.model, "num_flops_per_token", None)
        if callable(own):
            return int(own(seq_len))
        return 6 * sum(p.numel() for p in self.model.parameters())
