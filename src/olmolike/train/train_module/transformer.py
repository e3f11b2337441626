"""Train a transformer LM: micro-batches, loss, LR schedule, clipping, and its parallel layout
(DDP / FSDP2 / HSDP over the data dimensions, tensor parallelism within them)."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import checkpoint

from ...config import Config, DType
from ...distributed.expert_parallel import (
    ExpertParallelConfig,
    clip_grads_with_norm,
    grad_norm,
)
from ...distributed.mesh import ParallelDegrees
from ...distributed.parallel import DataParallelConfig, DataParallelType, apply_ddp
from ...distributed.pipeline import PipelineParallelConfig
from ...distributed.tensor_parallel import ContextParallelConfig, TensorParallelConfig
from ...distributed.utils import get_world_size
from ...exceptions import ConfigurationError
from ...nn.functional import cross_entropy_loss
from ...nn.moe import aux_loss_weight
from ...optim import AdamWConfig, OptimConfig, Scheduler, SchedulerUnits
from ...utils import get_default_device
from ..common import ReduceType
from ..weights import check_allowed_changes, load_init_weights
from .activation_checkpointing import ActivationCheckpointingConfig, ActivationCheckpointingMode
from .layout import ParallelLayout
from .moe import MoEMetrics
from .train_module import (
    ModelAndOptimTrainModule,
    agreed_microbatches,
    check_microbatches_fit,
    is_padding,
    labels_from_batch,
    microbatch_rows,
    padding_loss,
)

__all__ = [
    "ActivationCheckpointingConfig",
    "ActivationCheckpointingMode",
    "TransformerTrainModule",
    "TransformerTrainModuleConfig",
]

log = logging.getLogger(__name__)


@dataclass
class TransformerTrainModuleConfig(Config):
    """Everything about how a transformer is trained, built with :meth:`build`."""

    rank_microbatch_size: int
    """Tokens per forward/backward pass on one rank; the rank batch must be a multiple of it."""
    optim: OptimConfig = field(default_factory=AdamWConfig)
    """The optimizer (default AdamW with its defaults), built over the model's parameters."""
    scheduler: Scheduler | None = None
    """LR schedule over the trainer's ``max_duration``; ``None`` keeps the optimizer's LR."""
    max_grad_norm: float | None = None
    """Clip the total gradient norm (over all ranks' shards) to this value."""
    z_loss_multiplier: float | None = None
    """Weight of the z-loss (squared log-partition), which keeps logits from drifting; 1e-4 is
    a common choice for large runs."""
    label_smoothing: float = 0.0
    """Label smoothing of the cross-entropy loss, from 0 (none) to below 1: the share of the target
    probability spread evenly over the vocabulary."""
    label_ignore_index: int = -100
    """Label value whose positions are not trained on (padding, masked prompt tokens)."""
    autocast_precision: DType | None = None
    """Run forward and backward under ``torch.autocast`` in this dtype (e.g. bfloat16)."""
    compile_model: bool = False
    """``torch.compile`` each transformer block (the blocks are identical, so one compile)."""
    compile_backend: str = "inductor"
    """The ``torch.compile`` backend with ``compile_model`` (``inductor``; ``aot_eager`` compiles
    without generating kernels)."""
    dp_config: DataParallelConfig | None = None
    """Data parallelism over the ranks the other degrees leave; ``None`` means DDP when there
    are several data-parallel ranks."""
    tp_config: TensorParallelConfig | None = None
    """Tensor parallelism (innermost mesh dimension); ``None`` means none. Needs FSDP/HSDP
    (not DDP) when there are several data-parallel ranks."""
    cp_config: ContextParallelConfig | None = None
    """Context parallelism: every sequence split over ``cp_config.degree`` ranks, for
    sequences whose activations do not fit one device (see :class:`ContextParallelConfig`);
    ``None`` means none. The data dimensions take the ranks the other degrees leave."""
    ep_config: ExpertParallelConfig | None = None
    """Expert parallelism: every MoE layer's experts split over ``ep_config.degree`` ranks
    carved from the data ranks FSDP/HSDP shard over (see :class:`ExpertParallelConfig`);
    ``None`` means none (every data rank holds its shard of every expert)."""
    pp_config: PipelineParallelConfig | None = None
    """Pipeline parallelism: the layers split into stages over ``pp_config.degree`` ranks
    (:mod:`olmolike.train.train_module.pipeline`); the data dimensions take the other ranks."""
    ac_config: ActivationCheckpointingConfig | None = None
    """Activation checkpointing: recompute activations in the backward pass to save memory;
    ``None``: keep them all."""
    init_seed: int = 0
    """Seed for the weights when the model was built on the ``meta`` device."""
    init_weights: str | None = None
    """Start from these weights instead of random ones: a Hugging Face model folder
    (``config.json`` + ``*.safetensors``) or an olmolike checkpoint or save folder, local or
    remote. Weights only: the optimizer, schedule and step count start fresh. Loaded when
    ``fit()`` starts, after sharding and before step 1, and only if the run did not resume
    from a checkpoint: a resumed run continues from its own weights."""
    init_weights_allowed_changes: list[str] = field(default_factory=list)
    """Model config fields (``n_heads``, ``rope_theta``, ...) that may differ from the config
    ``init_weights`` were trained with, to start from them under another architecture on
    purpose (a longer context's ``rope_theta``, say). Empty: any difference that changes what
    the weights compute is refused."""

    pipeline_refusal: ClassVar[str | None] = None
    """Why this kind of training refuses ``pp_config`` (``None``: it runs pipelined). The
    pipelined step runs the plain LM loss; a subclass whose step runs more says why not."""

    context_parallel_refusal: ClassVar[str | None] = None
    """Why this kind of training refuses ``cp_config`` (``None``: it runs under context
    parallelism)."""

    def validate(self) -> None:
        if _degree(self.cp_config) > 1 and self.context_parallel_refusal:
            raise self._invalid(
                "cp_config",
                f"{type(self).__name__} does not run under context parallelism: "
                f"{self.context_parallel_refusal}; set cp_config=null",
            )
        if self.pp_config is not None and self.pp_config.degree > 1 and self.pipeline_refusal:
            raise self._invalid(
                "pp_config",
                f"{type(self).__name__} does not run under pipeline parallelism: "
                f"{self.pipeline_refusal}; set pp_config=null (use FSDP to fit the model)",
            )
        if self.rank_microbatch_size <= 0:
            raise self._invalid("rank_microbatch_size", "must be a positive number of tokens")
        check_allowed_changes(self.init_weights_allowed_changes, "init_weights_allowed_changes")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise self._invalid("max_grad_norm", f"must be positive, got {self.max_grad_norm}")
        if self.z_loss_multiplier is not None and self.z_loss_multiplier < 0:
            raise self._invalid("z_loss_multiplier", "must be >= 0")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise self._invalid("label_smoothing", "must be in [0, 1)")

    def parallel_degrees(
        self, world_size: int | None = None, *, local_world_size: int | None = None
    ) -> ParallelDegrees:
        """How many ranks each parallelism spans on ``world_size`` ranks (default: the run's),
        ``local_world_size`` of them per node (default: this node's).

        :raises ConfigurationError: degrees that do not multiply to the world size.
        """
        world = get_world_size() if world_size is None else world_size
        dp = self.dp_config or DataParallelConfig(name=DataParallelType.ddp)
        pp = _degree(self.pp_config)
        try:
            return dp.degrees(
                world,
                pp=pp,
                cp=_degree(self.cp_config),
                tp=_degree(self.tp_config),
                ep=_degree(self.ep_config),
                local_world_size=local_world_size,
            )
        except ConfigurationError as e:  # name the fields in full, as other errors do
            if e.path:  # one of dp_config's
                raise e.under("train_module.dp_config") from None
            set_ = [
                f"train_module.{name}_config.degree"
                for name, config in (
                    ("pp", self.pp_config),
                    ("cp", self.cp_config),
                    ("tp", self.tp_config),
                    ("ep", self.ep_config),
                )
                if _degree(config) > 1
            ]
            if len(set_) != 1:
                raise ConfigurationError(e.reason, path="train_module") from None
            raise ConfigurationError(e.reason, path=set_[0]) from None

    def build(
        self,
        model: nn.Module,
        device: torch.device | None = None,
        dp_process_group: dist.ProcessGroup | None = None,
    ) -> TransformerTrainModule:
        """Parallelise ``model`` (AC, compile, sharding), put it on ``device``, build the optimizer.

        ``model`` may live on the ``meta`` device: it is then sharded first and materialised
        shard by shard, so the full model never has to fit in one process's memory.
        """
        self.validate()
        if self.pp_config is not None and self.pp_config.degree > 1:
            return _pipelined[0](self, model, device or get_default_device())
        return TransformerTrainModule(self, model, device or get_default_device(), dp_process_group)


_pipelined: list[Callable[..., TransformerTrainModule]] = []
"""The pipelined train module :meth:`TransformerTrainModuleConfig.build` returns under
``pp_config``; :mod:`.pipeline` (a subclass, imported by this package) registers it."""


class TransformerTrainModule(ModelAndOptimTrainModule):
    """The train module for :class:`~olmolike.nn.Transformer` (or any LM with ``blocks``).

    The loss is normalised by the number of non-ignored tokens in the whole global batch (a
    count all-reduced across data-parallel ranks), so neither the micro-batch split nor the
    number of ranks changes the result: with masked labels (SFT), every trained token weighs
    the same whichever rank and micro-batch it falls in.

    A batch with ``doc_ids`` (packed SFT sequences) passes them to the model, which then keeps
    attention within each document; its share of padding (``doc_ids < 0``) is logged as
    ``train/padding fraction``.
    """

    def __init__(
        self,
        config: TransformerTrainModuleConfig,
        model: nn.Module,
        device: torch.device,
        dp_process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.device = device
        self.layout = ParallelLayout.build(
            config.parallel_degrees(), config.dp_config, device, dp_process_group
        )
        self.dp_process_group = self.layout.dp_process_group
        self.dp_world_size = self.layout.dp_world_size
        self.model = model
        self._parallelize(model)  # may replace self.model (a pipeline rank's stages)
        self._moe = MoEMetrics.of(self.model, replicas=self.layout.degrees.tp)
        self._step_tokens = 1
        """Tokens of the step over the data-parallel ranks (the MoE auxiliary losses' mean)."""
        self.optim = config.optim.build(self.model)
        self.scheduler = config.scheduler
        self._check_rewarm = False
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        self._autocast = (
            torch.autocast(device.type, dtype=config.autocast_precision.as_pt())
            if config.autocast_precision is not None
            else contextlib.nullcontext()
        )

    # -- building ---------------------------------------------------------------------------

    def _parallelize(self, model: nn.Module) -> None:
        config, layout = self.config, self.layout
        if config.pp_config is not None and config.pp_config.degree > 1:
            raise ConfigurationError(
                f"{type(self).__name__} runs no pipeline: build the train module with "
                "TransformerTrainModuleConfig.build(), which returns the pipelined one",
                path="train_module.pp_config",
            )
        on_meta = any(p.is_meta for p in model.parameters())
        if config.ac_config is not None:
            self._apply_activation_checkpointing(model, config.ac_config)
        if config.compile_model:
            for block in self._blocks(model):
                block.compile(backend=config.compile_backend)
        if not on_meta:
            model.to(self.device)
        if layout.sharded and self.dp_world_size != layout.degrees.dp:
            raise ConfigurationError(
                "FSDP/HSDP shard over all data-parallel ranks; a dp_process_group smaller than "
                "the world is only supported with DDP",
                path="dp_config.name",
            )
        layout.shard(model)
        if on_meta:
            self._materialize(model)
        layout.finish(model)
        if layout.ddp:
            self._ddp = apply_ddp(model, layout.gradient_group)

    def _materialize(self, model: nn.Module) -> None:
        materialize: Callable[..., Any] | None = getattr(model, "materialize", None)
        if materialize is None:
            raise ConfigurationError(
                f"{type(model).__name__} was built on the meta device but has no "
                "materialize(device, seed=...) method; build it on a real device instead",
                path="model",
            )
        materialize(self.device, seed=self.config.init_seed)

    @staticmethod
    def _blocks(model: nn.Module) -> Iterator[nn.Module]:
        blocks = getattr(model, "blocks", None)
        if blocks is None:
            raise ConfigurationError(
                f"{type(model).__name__} has no `blocks`: activation checkpointing and compile "
                "work per transformer block",
                path="model",
            )
        yield from blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks

    def _apply_activation_checkpointing(
        self, model: nn.Module, ac: ActivationCheckpointingConfig
    ) -> None:
        # Replacing `forward` on the instance (instead of wrapping the block in another module)
        # keeps parameter names, so checkpoints do not depend on whether AC was on.
        for index, block in enumerate(self._blocks(model)):
            if ac.selects(index):
                block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)

    # -- TrainModule --------------------------------------------------------------------------

    def on_attach(self) -> None:
        super().on_attach()
        self._check_batches()
        if self.scheduler is not None:
            # A schedule that needs the run's length fails here, before any step, not mid-run.
            try:
                self.scheduler.get_lr(1.0, 0, self._schedule_position()[1])
            except ConfigurationError as e:
                raise e.under("train_module.scheduler") from None

    def default_callbacks(self) -> tuple[str, ...]:
        return () if self._moe is None else ("moe_load",)

    def on_fit_start(self, *, resumed: bool) -> None:
        super().on_fit_start(resumed=resumed)
        if self.config.init_weights is not None:
            load_init_weights(
                self.model,
                self.config.init_weights,
                resumed=resumed,
                work_dir=self.trainer.work_dir,
                allowed_changes=self.config.init_weights_allowed_changes,
            )

    def _check_batches(self) -> None:
        """Refuse a data loader whose batches this module cannot split (before any step)."""
        check_microbatches_fit(
            self.trainer.rank_batch_size,
            self.config.rank_microbatch_size,
            "train_module.rank_microbatch_size",
        )

    def _training_inputs(
        self, batch: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The model in train mode, and the batch's token ids, next-token labels and document
        ids (``None``: unpacked sequences)."""
        if not self.model.training:  # train() walks every submodule: not on every step
            self.model.train()
        labels = labels_from_batch(batch, self.config.label_ignore_index)
        return batch["input_ids"], labels, batch.get("doc_ids")

    def train_batch(self, batch: dict[str, Any], dry_run: bool = False) -> None:
        input_ids, labels, doc_ids = self._training_inputs(batch)
        slices = self._microbatches(input_ids)
        # The denominator is this step's non-ignored token count over all ranks; each rank's
        # gradient is scaled by the number of ranks DDP and FSDP average over.
        scale = self._global_token_count(labels).reciprocal() * self.layout.averaged_ranks
        labels = self._local_labels(labels)
        ce_total = torch.zeros((), device=input_ids.device)
        z_total = torch.zeros((), device=input_ids.device)
        for i, rows in enumerate(slices):
            with self._grad_sync(last=i == len(slices) - 1):
                if is_padding(rows):
                    self._padding_step()
                    continue
                docs = None if doc_ids is None else doc_ids[rows]
                with self._autocast, self._moe_share(input_ids[rows].numel()):
                    logits = self._forward_module(input_ids[rows], **_doc_kwargs(docs))
                    ce_loss, z_loss = cross_entropy_loss(
                        logits,
                        labels[rows],
                        ignore_index=self.config.label_ignore_index,
                        reduction="sum",
                        z_loss_multiplier=self.config.z_loss_multiplier,
                        label_smoothing=self.config.label_smoothing,
                    )
                    loss = ce_loss if z_loss is None else ce_loss + z_loss
            (loss * scale).backward()
            ce_total += ce_loss.detach()
            if z_loss is not None:
                z_total += z_loss.detach()
        self._record_moe(dry_run)
        if dry_run:
            return
        # Mean-reduced across ranks, these are exactly the global per-token means.
        self.record_ce_loss(ce_total * scale, ReduceType.mean)
        if self.config.z_loss_multiplier is not None:
            self.record_metric("Z loss", z_total * scale, ReduceType.mean, namespace="train")
        if doc_ids is not None:
            padding = (doc_ids < 0).float().mean()
            self.record_metric("padding fraction", padding, ReduceType.mean, namespace="train")

    def _microbatches(self, input_ids: torch.Tensor) -> list[slice]:
        """This rank's micro-batches of ``rank_microbatch_size`` tokens, as row slices, padded
        to the count of the rank that needs the most (:func:`agreed_microbatches`)."""
        per = microbatch_rows(
            input_ids, self.config.rank_microbatch_size, "train_module.rank_microbatch_size"
        )
        slices, agreed = agreed_microbatches(
            input_ids.shape[0], per, self.dp_process_group, also=(input_ids.numel(),)
        )
        self._step_tokens = max(1, agreed.sum[1])
        return slices

    def _moe_share(self, tokens: int) -> contextlib.AbstractContextManager[None]:
        """The MoE auxiliary losses' gradient weight for a micro-batch of ``tokens`` tokens:
        its share of the step's tokens (on every data-parallel rank), times the ranks the
        gradients are averaged over (:func:`~olmolike.nn.moe.aux_loss_weight`). Under context
        parallelism a rank routes ``1 / cp`` of those tokens and the gradients are averaged
        over ``cp`` times more ranks: the two cancel."""
        return aux_loss_weight(tokens / self._step_tokens * self.dp_world_size)

    def _record_moe(self, dry_run: bool, *, passes: int = 1) -> None:
        """Record the MoE layers' routing of this step (nothing for a dense model);
        ``passes``: how many times the step's auxiliary-loss weights added up to one (GRPO's
        updates), so the recorded losses are their mean."""
        if self._moe is None:
            return
        if dry_run:  # a step that records nothing counts no routing either
            self._moe.record(self, weight_sum=1, collect=True, dry_run=True)
            return
        trainer = self.trainer
        step = trainer.global_step
        collect = step % trainer.metrics_collect_interval == 0 or step == trainer.max_steps
        weights = self.layout.averaged_ranks * passes  # what the weights sum to, all ranks
        self._moe.record(self, weight_sum=weights, collect=collect, dry_run=dry_run)

    def _padding_step(self, *references: nn.Module) -> None:
        """A micro-batch that changes nothing (:func:`padding_loss`): forwards of the frozen
        ``references`` and the model's forward and backward, each over one token. A rank with
        fewer micro-batches than another runs these, so it joins every one of the other's
        FSDP collectives, gradients included."""
        with torch.no_grad():
            for reference in references:
                padding_loss(reference, self.device)
        with self._autocast, aux_loss_weight(0.0):  # no MoE loss or routing counted either
            loss = padding_loss(self._forward_module, self.device)
        loss.backward()

    def _local_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """The labels of this rank's tokens: under context parallelism the model returns the
        logits of its share of each sequence only (padding, if any, is ignored)."""
        cp = self.layout.context_parallel
        return labels if cp is None else cp.shard(labels, pad_value=self.config.label_ignore_index)

    def _global_token_count(self, labels: torch.Tensor) -> torch.Tensor:
        count = (labels != self.config.label_ignore_index).sum()
        if self.dp_world_size > 1:
            dist.all_reduce(count, group=self.dp_process_group)
        return count.clamp(min=1).float()

    def _grad_sync(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        """Synchronise gradients only in the last micro-batch's backward."""
        if self._ddp is not None and not last:
            return self._ddp.no_sync()
        if isinstance(self.model, FSDPModule):
            self.model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    @torch.no_grad()
    def eval_batch(self, batch: dict[str, Any], labels: torch.Tensor | None = None) -> Any:
        """The logits of ``batch``, or with ``labels`` the mean CE loss over non-ignored tokens.

        Under tensor parallelism the logits are a DTensor sharded on the vocabulary: the losses
        of :mod:`olmolike.nn.functional` take it as it is; ``full_tensor()`` gathers it. Under
        context parallelism each rank computes its share of the tokens; the loss is over all
        of them and the logits are gathered, so every rank returns what one process would.
        """
        was_training = self.model.training
        self.model.eval()
        input_ids = batch["input_ids"]
        try:
            with self._autocast:
                logits = self.model(input_ids, **_doc_kwargs(batch.get("doc_ids")))
        finally:
            self.model.train(was_training)
        cp = self.layout.context_parallel
        if labels is None:
            return logits if cp is None else cp.gather(logits, input_ids.shape[1])
        return self._mean_loss(logits, labels)

    def _mean_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The mean CE loss over the non-ignored tokens of ``labels`` (whole sequences), from
        the ``logits`` this rank computed (its share of the tokens under context parallelism:
        the sum and the count are then added up over the context-parallel group)."""
        ignore, cp = self.config.label_ignore_index, self.layout.context_parallel
        if cp is None:
            return cross_entropy_loss(logits, labels, ignore_index=ignore, reduction="mean")[0]
        labels = self._local_labels(labels)
        ce_sum, _ = cross_entropy_loss(logits, labels, ignore_index=ignore, reduction="sum")
        sums = torch.stack([ce_sum.float(), (labels != ignore).sum().float()])
        dist.all_reduce(sums, group=cp.group)
        return sums[0] / sums[1].clamp(min=1)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._check_rewarm = "optim" in state_dict

    def optim_step(self) -> None:
        if self.scheduler is not None:
            current, t_max = self._schedule_position()
            if self._check_rewarm:
                self._check_rewarm = False
                self._warn_if_rewarmed(self.scheduler, current, t_max)
            self.scheduler.set_lr(self.optim, current, t_max)
        if self.config.max_grad_norm is not None:
            grad_norm = self._clip_grad_norm(self.config.max_grad_norm)
            self.record_metric("total grad norm", grad_norm, namespace="optim")
        for i, group in enumerate(self.optim.param_groups):
            name = group.get("name", f"group {i}")
            self.record_metric(f"LR ({name})", float(group["lr"]), namespace="optim")
        self.optim.step()

    def _clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients to a total norm of ``max_norm``; returns the norm before."""
        # The experts' gradients live on another mesh under expert parallelism: grad_norm
        # takes each mesh's norm, then theirs.
        norm = grad_norm([p.grad for p in self._params if p.grad is not None])
        clip_grads_with_norm(self._params, max_norm, norm)
        return norm

    def _warn_if_rewarmed(self, scheduler: Scheduler, current: int, t_max: int | None) -> None:
        """Warn when a resumed run's LR jumps up: its schedule was stretched, e.g. by extending
        ``max_duration`` of a finished run, so a decayed LR climbs back."""
        group = self.optim.param_groups[0]
        trained, now = float(group["lr"]), scheduler.get_lr(group["initial_lr"], current, t_max)
        if now <= trained * 1.05 or now - trained < 1e-3 * group["initial_lr"]:
            return
        log.warning(
            "The learning rate rises from %.3g (the checkpoint's last step) to %.3g at %s %d: "
            "%s now spans %s %s (max_duration changed), so a decayed LR is warmed up again. "
            "To extend runs smoothly, use a WSD schedule (train_module.scheduler): it holds the "
            "peak LR and decays only at the end, so a checkpoint from before the decay resumes "
            "into a longer run with no jump.",
            trained,
            now,
            scheduler.units.rstrip("s"),
            current,
            type(scheduler).__name__,
            t_max,
            scheduler.units,
        )

    def _schedule_position(self) -> tuple[int, int | None]:
        trainer = self.trainer
        if self.scheduler is not None and self.scheduler.units == SchedulerUnits.tokens:
            return trainer.global_train_tokens_seen, trainer.max_tokens
        return trainer.global_step, trainer.max_steps

    def zero_grads(self) -> None:
        self.optim.zero_grad(set_to_none=True)

    def num_flops_per_token(self, seq_len: int) -> int | None:
        own = getattr(self.model, "num_flops_per_token", None)
        return int(own(seq_len)) if callable(own) else None


def _degree(
    config: TensorParallelConfig
    | ContextParallelConfig
    | ExpertParallelConfig
    | PipelineParallelConfig
    | None,
) -> int:
    return 1 if config is None else config.degree


def _doc_kwargs(doc_ids: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The model's ``doc_ids`` argument, only when there are documents to separate: a model
    without that argument still trains on unpacked batches."""
    return {} if doc_ids is None else {"doc_ids": doc_ids}
