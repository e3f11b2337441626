"""The transformer train module under pipeline parallelism (``pp_config.degree > 1``).

Each rank holds its stages of the model (:class:`~olmolike.nn.transformer_stage.TransformerParts`,
under the unsplit model's parameter names, so checkpoints move between layouts) and runs a
``torch.distributed.pipelining`` schedule over the step's micro-batches. Everything the
trainer and callbacks see is what they see without a pipeline:

- the loss (CE, z-loss) is computed on the last stage, normalised by the global token count
  exactly as without a pipeline, and shared with every pipeline rank by one all-reduce per
  step, so each rank records the same metric values;
- a mixture of experts' auxiliary losses are attached to each MoE block's output
  (:mod:`olmolike.nn.moe`), so every stage's backward backpropagates its own blocks' losses,
  each micro-batch's weighted by its share of the step as without a pipeline;
- the gradient norm is that of the whole model (squares summed over the pipeline ranks), and
  clipping uses it;
- data parallelism (FSDP, HSDP, or replication for ``ddp``) runs over the data dimensions of
  the device mesh; the ranks of one pipeline read the same batch;
- tensor parallelism (``tp_config``) splits the whole model with the same plan as without a
  pipeline, on the mesh's ``tp`` dimension, before it is cut into stages: the stages pass
  each rank's sequence shard of the hidden states on as plain tensors
  (:class:`~olmolike.nn.transformer_stage.TransformerStage`), the last stage's loss is
  vocabulary-parallel, and the sequence is padded to a multiple of the ``tp`` degree so every
  rank's shard has the same, fixed shape.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from ...distributed.parallel import DataParallelConfig, DataParallelType
from ...distributed.pipeline import (
    PipelineParallelConfig,
    build_schedule,
    clip_grad_norm_across_stages,
    split_layers,
)
from ...distributed.utils import gather_objects, get_world_size
from ...exceptions import ConfigurationError
from ...nn.functional import cross_entropy_loss
from ...nn.moe import aux_loss_weight
from ...nn.transformer import Transformer
from ...nn.transformer_config import TransformerConfig
from ...nn.transformer_stage import TransformerParts, TransformerStage
from ..common import ReduceType
from .train_module import agree_counts, microbatch_rows
from .transformer import (
    TransformerTrainModule,
    TransformerTrainModuleConfig,
    _doc_kwargs,
    _pipelined,
)

__all__ = ["PipelineTransformerTrainModule", "check_pipeline"]


def _group_key(index: int, group: dict[str, Any]) -> Any:
    """A param group's identity on every rank: its name if it has one (a rank may lack a
    group another has), else its position."""
    return group.get("name", index)


log = logging.getLogger(__name__)

_CACHED_SCHEDULES = 4
"""Schedules kept for reuse; each holds receive buffers for one micro-batch shape."""


def check_pipeline(config: TransformerTrainModuleConfig, model: TransformerConfig, tp: int) -> None:
    """What a pipeline of ``config.pp_config`` refuses for ``model`` with ``tp``-way tensor
    parallelism: no process group needed, so it is said before any is made."""
    assert config.pp_config is not None
    if model.tie_weights:
        raise ConfigurationError(
            "tie_weights shares the embedding with the output head, but they live on the "
            "first and last pipeline stages; set model.tie_weights=false to pipeline",
            path="model.tie_weights",
        )
    split_layers(model.n_layers, config.pp_config.num_stages)  # too few layers?
    if tp > 1 and model.max_sequence_length % tp:
        # The stages pass each rank an equal sequence shard: every sequence is padded to a
        # multiple of tp, which must still fit the model's positions.
        padded = -(-model.max_sequence_length // tp) * tp
        raise ConfigurationError(
            f"under pipeline parallelism every sequence is padded to a multiple of the "
            f"tensor-parallel degree ({tp}), so one of max_sequence_length "
            f"({model.max_sequence_length}) tokens would become {padded}, longer than the "
            f"model's positions; set model.max_sequence_length to a multiple of {tp} "
            f"(e.g. {padded})",
            path="model.max_sequence_length",
        )


class PipelineTransformerTrainModule(TransformerTrainModule):
    """:class:`TransformerTrainModule` with the model cut into pipeline stages (module doc)."""

    model: TransformerParts

    def __init__(
        self, config: TransformerTrainModuleConfig, model: nn.Module, device: torch.device
    ) -> None:
        # What pipelining refuses is said before the device mesh is built.
        self._check_model(config, model)
        super().__init__(config, model, device)
        self._whole_model_groups = self._gather_param_groups()

    def _parallelize(self, model: nn.Module) -> None:
        pp = self._pp
        assert isinstance(model, Transformer)
        layers = split_layers(model.config.n_layers, pp.num_stages)
        if self.config.compile_model or self.config.ac_config is not None:
            self._wrap_blocks(model)
        self.layout.expert_parallel(model)
        self.layout.tensor_parallel(model)
        self.layout.split_sequences(model)
        dp = self._dp_config_under_pipeline(self.config.dp_config)
        assert self.layout.mesh is not None  # a pipeline always splits the ranks
        self.mesh = self.layout.mesh
        self.tp_mesh = self.mesh["tp"] if self.layout.degrees.tp > 1 else None
        self.pp_group: dist.ProcessGroup = self.mesh["pp"].get_group()
        self.pp_rank = self.mesh["pp"].get_local_rank()
        self.stage_indices = pp.stage_indices(self.pp_rank)
        last = pp.num_stages - 1
        self.stages = [
            TransformerStage(model, layers[s], first=s == 0, last=s == last, tp_mesh=self.tp_mesh)
            for s in self.stage_indices
        ]
        self.model = TransformerParts(self.stages)
        self._place(model, dp)
        self._schedules: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self._losses: list[torch.Tensor] = []
        self._loss_scale = torch.ones(())
        log.info(
            "pipeline rank %d of %d runs stages %s (layers %s) with %s",
            self.pp_rank, pp.degree, self.stage_indices,
            [list(layers[s]) for s in self.stage_indices], pp.schedule,
        )  # fmt: skip

    @staticmethod
    def _check_model(config: TransformerTrainModuleConfig, model: nn.Module) -> None:
        if not isinstance(model, Transformer):
            raise ConfigurationError(
                f"pipeline parallelism splits an olmolike Transformer by layers; got "
                f"{type(model).__name__}",
                path="train_module.pp_config",
            )
        tp = config.tp_config.degree if config.tp_config is not None else 1
        check_pipeline(config, model.config, tp)

    def _place(self, model: Transformer, dp: DataParallelConfig | None) -> None:
        """Put the stages on the device, shard each over the data dimensions (every stage is
        an FSDP root, as the pipeline schedule expects), and materialise a meta model."""
        parts = self.model
        on_meta = any(p.is_meta for p in parts.parameters())
        if not on_meta:
            parts.to(self.device)
            for stage in self.stages:
                stage.rope.to(self.device)
        if dp is not None:
            for stage in self.stages:
                self.layout.fully_shard(stage, dp)
        if on_meta:
            parts.materialize(self.device, seed=self.config.init_seed)
        self.layout.finish(model, sharded=dp is not None)

    def _wrap_blocks(self, model: Transformer) -> None:
        """Activation checkpointing and compile work per block, as without a pipeline."""
        if self.config.ac_config is not None:
            self._apply_activation_checkpointing(model, self.config.ac_config)
        if self.config.compile_model:
            for block in model.blocks:
                block.compile(backend=self.config.compile_backend)

    def _dp_config_under_pipeline(self, dp: DataParallelConfig | None) -> DataParallelConfig | None:
        """Data parallelism over the mesh's data ranks (the world over the pipeline and
        tensor-parallel degrees). DDP is run as FSDP2 replication (HSDP with shards of one
        rank): the pipeline schedule drives FSDP2's gradient sync."""
        dp_ranks = self.layout.degrees.dp
        if dp_ranks * self.layout.degrees.cp <= 1:
            return None
        if dp is None or dp.name == DataParallelType.ddp:
            # Replicated over the data ranks; the context ranks (if any) shard.
            return DataParallelConfig(name=DataParallelType.hsdp, num_replicas=dp_ranks)
        return dp

    # -- checkpoints --------------------------------------------------------------------------

    def _gather_param_groups(self) -> dict[Any, list[str]]:
        """Each optimizer param group's parameter names over the whole model (all stages).

        A checkpoint's optimizer ``param_groups`` name their parameters; saved as this rank's
        names, the pipeline ranks would write different values under one key. Saved with the
        whole model's names (as one process saves them), every layout writes and reads the
        same thing, and loading picks each rank's own parameters out of them."""
        names = {id(p): name for name, p in self.model.named_parameters()}
        local = {
            _group_key(i, group): [names[id(p)] for p in group["params"]]
            for i, group in enumerate(self.optim.param_groups)
        }
        whole: dict[Any, list[str]] = {}
        for rank_groups in gather_objects(local, self.pp_group):
            for key, params in rank_groups.items():
                whole.setdefault(key, []).extend(params)
        return whole

    def _with_whole_model_groups(self, state: dict[str, Any]) -> dict[str, Any]:
        for i, group in enumerate(state.get("optim", {}).get("param_groups", [])):
            group["params"] = list(self._whole_model_groups[_group_key(i, group)])
        return state

    def state_dict(self) -> dict[str, Any]:
        return self._with_whole_model_groups(super().state_dict())

    def state_dict_to_load(self, optim: bool = True) -> dict[str, Any]:
        return self._with_whole_model_groups(super().state_dict_to_load(optim))

    # -- training ---------------------------------------------------------------------------

    @property
    def _pp(self) -> PipelineParallelConfig:
        assert self.config.pp_config is not None
        return self.config.pp_config

    @property
    def is_first_stage_rank(self) -> bool:
        return 0 in self.stage_indices

    @property
    def is_last_stage_rank(self) -> bool:
        return self._pp.num_stages - 1 in self.stage_indices

    def on_attach(self) -> None:
        super().on_attach()
        trainer_dp = self.trainer.dp_process_group
        if trainer_dp is None or get_world_size(trainer_dp) != self.dp_world_size:
            # Else each pipeline rank would read a different batch: the first stage's inputs
            # and the last stage's labels would not belong together.
            raise ConfigurationError(
                "under pipeline parallelism the ranks of one pipeline must read the same batch: "
                "build the trainer with dp_process_group=train_module.dp_process_group and the "
                "data loader for that group (dp_world_size=train_module.dp_world_size, dp_rank="
                "its rank in the group)",
                path="train_module.pp_config",
            )
        self._pp.check_microbatches(
            self.trainer.rank_batch_size // self.config.rank_microbatch_size
        )

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of one micro-batch, scaled as the whole step's; its CE and
        z-loss parts are kept for the metrics."""
        ce_loss, z_loss = cross_entropy_loss(
            logits,
            labels,
            ignore_index=self.config.label_ignore_index,
            reduction="sum",
            z_loss_multiplier=self.config.z_loss_multiplier,
            label_smoothing=self.config.label_smoothing,
        )
        z = torch.zeros_like(ce_loss) if z_loss is None else z_loss
        self._losses.append(torch.stack([ce_loss.detach(), z.detach()]))
        return (ce_loss + z) * self._loss_scale

    def _schedule(self, n: int, shape: tuple[int, ...], docs: bool, train: bool) -> Any:
        """A schedule for ``n`` micro-batches of ``shape`` (reused: a schedule's stages keep
        receive buffers sized for one shape)."""
        key = (n, shape, docs, train)
        schedule = self._schedules.pop(key, None)
        if schedule is None:
            schedule = build_schedule(
                self._pp,
                list(self.stages),
                self.stage_indices,
                n_microbatches=n,
                loss_fn=self._loss if train else None,
                group=self.pp_group,
                device=self.device,
            )
            if len(self._schedules) >= _CACHED_SCHEDULES:
                self._schedules.popitem(last=False)
        self._schedules[key] = schedule
        return schedule

    def train_batch(self, batch: dict[str, Any], dry_run: bool = False) -> None:
        input_ids, labels, doc_ids = self._training_inputs(batch)
        # Scaled by the number of ranks FSDP averages gradients across.
        self._loss_scale = (
            self._global_token_count(labels).reciprocal() * self.layout.averaged_ranks
        )
        input_ids, labels, docs, n = self._pad_to_agreed_microbatches(input_ids, labels, doc_ids)
        labels = self._local_labels(labels)
        self._losses = []
        schedule = self._schedule(n, tuple(input_ids.shape), docs is not None, train=True)
        # Every rank of the data group runs n micro-batches of one shape: each is 1 / (n x dp)
        # of the step's tokens, times dp for the gradients' average over the data ranks.
        with self._autocast, aux_loss_weight(1.0 / n):
            schedule.step(
                *([input_ids] if self.is_first_stage_rank else []),
                target=labels if self.is_last_stage_rank else None,
                return_outputs=False,  # else the last stage keeps every micro-batch's logits
                **_doc_kwargs(docs),
            )
        # The schedule's first step also runs the loss on placeholder tensors to learn the
        # shapes: the step's own losses are the last n.
        losses = self._losses[-n:] if self.is_last_stage_rank else []
        totals = torch.stack(losses).sum(0) if losses else torch.zeros(2)
        totals = totals.to(self.device) * self._loss_scale
        # The loss exists on the last stage only: one all-reduce per step on every pipeline
        # rank (the others add zeros) gives each rank the same values to record.
        dist.all_reduce(totals, group=self.pp_group)
        self._record_moe(dry_run)
        if dry_run:
            return
        self.record_ce_loss(totals[0], ReduceType.mean)
        if self.config.z_loss_multiplier is not None:
            self.record_metric("Z loss", totals[1], ReduceType.mean, namespace="train")
        if doc_ids is not None:
            padding = (doc_ids < 0).float().mean()
            self.record_metric("padding fraction", padding, ReduceType.mean, namespace="train")

    def _pad_to_agreed_microbatches(
        self, input_ids: torch.Tensor, labels: torch.Tensor, doc_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
        """The batch padded to the micro-batch count (and sequence length) every
        data-parallel rank agrees on: every pipeline then runs the same schedule on the same
        shapes, so FSDP's collectives (also those of a new schedule's shape inference) match.
        Padding has every label ignored: it adds nothing to loss or gradients."""
        per = microbatch_rows(
            input_ids, self.config.rank_microbatch_size, "train_module.rank_microbatch_size"
        )
        rows, seq = input_ids.shape
        n, seq = agree_counts([max(1, -(-rows // per)), seq], self.dp_process_group).max
        input_ids, labels, doc_ids = self._pad(input_ids, labels, doc_ids, n * per, seq)
        return input_ids, labels, doc_ids, n

    def _pad(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None,
        doc_ids: torch.Tensor | None,
        rows: int,
        seq: int,
    ) -> tuple[torch.Tensor, Any, Any]:
        """Right-pad to ``rows x seq``, the sequence up to a multiple of the tensor-parallel
        degree (equal sequence shards), or under context parallelism of what it splits
        evenly: token 0, ignored labels, padding documents (-1). Causal attention keeps the
        real tokens' results unchanged."""
        cp = self.layout.context_parallel
        seq = self.layout.degrees.tp * -(-seq // self.layout.degrees.tp)
        seq = seq if cp is None else cp.padded_length(seq)
        pad = (0, seq - input_ids.shape[1], 0, rows - input_ids.shape[0])
        if not any(pad):
            return input_ids, labels, doc_ids
        ignore = self.config.label_ignore_index
        return (
            F.pad(input_ids, pad, value=0),
            None if labels is None else F.pad(labels, pad, value=ignore),
            None if doc_ids is None else F.pad(doc_ids, pad, value=-1),
        )

    @torch.no_grad()
    def eval_batch(self, batch: dict[str, Any], labels: torch.Tensor | None = None) -> Any:
        """As without a pipeline, on every pipeline rank: the last stage's logits (or mean CE
        loss) are broadcast to the others. The batch is one micro-batch, padded to the shape
        every data-parallel rank agrees on (an evaluator's last batches differ by rank)."""
        rows, seq = batch["input_ids"].shape
        shape = agree_counts([rows, seq], self.dp_process_group).max
        input_ids, labels, doc_ids = self._pad(
            batch["input_ids"], labels, batch.get("doc_ids"), *shape
        )
        was_training = self.model.training
        self.model.eval()
        try:
            schedule = self._schedule(1, tuple(input_ids.shape), doc_ids is not None, train=False)
            with self._autocast:
                logits = schedule.step(
                    *([input_ids] if self.is_first_stage_rank else []), **_doc_kwargs(doc_ids)
                )
        finally:
            self.model.train(was_training)
        if labels is not None:
            loss = torch.zeros((), device=self.device)
            if self.is_last_stage_rank:
                loss = self._mean_loss(logits, labels)
            return self._from_last_stage(loss.float())
        return self._logits_from_last_stage(logits, input_ids.shape, rows, seq)

    def _logits_from_last_stage(
        self, logits: Any, padded: torch.Size, rows: int, seq: int
    ) -> torch.Tensor:
        """The last stage's logits of the batch's ``rows x seq`` tokens, on every pipeline
        rank. Under tensor parallelism each rank sends its vocabulary shard to the same rank
        of the other stages, and every rank returns the vocabulary-sharded DTensor a
        tensor-parallel model returns."""
        cp = self.layout.context_parallel
        if self.is_last_stage_rank:
            local = (logits.to_local() if isinstance(logits, DTensor) else logits).float()
            local = local if cp is None else cp.gather(local, padded[1])
        else:
            vocab = self.model.config.vocab_size // self.layout.degrees.tp
            local = torch.empty((*padded, vocab), device=self.device)
        local = self._from_last_stage(local.contiguous())[:rows, :seq]
        if self.tp_mesh is None:
            return local
        return DTensor.from_local(local, self.tp_mesh, [Shard(-1)], run_check=False)

    def _from_last_stage(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.broadcast(tensor, group=self.pp_group, group_src=self._pp.degree - 1)
        return tensor

    def _clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return clip_grad_norm_across_stages(self._params, max_norm, self.pp_group)


_pipelined.append(PipelineTransformerTrainModule)
