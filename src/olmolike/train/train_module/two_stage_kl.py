"""Two-stage training: cross-entropy, then cross-entropy plus a true KL to a frozen snapshot.

Steps ``1 .. stage1_steps`` train on cross-entropy alone. At the first step of stage 2 the
policy's current weights are copied into a frozen :class:`ReferenceModel` (sharded like the
policy), and from then on the loss is ``CE + beta * KL(policy || reference)`` with the exact
per-token KL over the whole vocabulary (:func:`~olmolike.nn.functional.token_kl_divergence`).

The snapshot is part of the run, not an external model: its weights are in the train module's
state (saved in every checkpoint, with a flag saying whether it was taken), so a resume after
the boundary gets the snapshot back instead of re-taking it from later weights. The LR
schedule is the parent's and spans both stages (the trainer's ``max_duration``). Each stage's
data comes from its own loader through a :class:`~olmolike.data.staged.StagedDataLoader`,
whose boundary must be ``stage1_steps`` (checked when the trainer is built).

Compared with the approximation ``CE + beta * (nll_policy - stopgrad(nll_reference))``, whose
gradient is exactly ``(1 + beta)`` times the CE gradient (it only rescales the learning rate),
the exact KL pulls the whole next-token distribution towards the snapshot's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn as nn

from ...data.staged import StagedDataLoader
from ...exceptions import ConfigurationError
from ...nn.functional import cross_entropy_loss, token_kl_divergence
from ...utils import get_default_device
from ..common import ReduceType
from .reference import ReferenceModel
from .train_module import is_padding, labels_from_batch
from .transformer import TransformerTrainModule, TransformerTrainModuleConfig, _doc_kwargs

__all__ = ["TwoStageKLTrainModule", "TwoStageKLTrainModuleConfig"]

log = logging.getLogger(__name__)


@dataclass
class TwoStageKLTrainModuleConfig(TransformerTrainModuleConfig):
    """A :class:`TransformerTrainModuleConfig` for two stages: cross-entropy only, then
    cross-entropy plus ``beta`` times the KL to a snapshot of the stage-1 model."""

    pipeline_refusal: ClassVar[str | None] = (
        "its stage-2 loss needs a frozen snapshot's logits next to the model's, and the "
        "pipelined step runs the plain LM loss only"
    )

    stage1_steps: int = 0
    """Optimizer steps of stage 1 (CE only); the snapshot is taken before step
    ``stage1_steps + 1``. The trainer's ``max_duration`` is the length of both stages."""
    beta: float = 0.1
    """Weight of ``KL(policy || snapshot)`` in stage 2; 0 makes stage 2 plain CE (and still
    records the KL, which is how the example measures drift)."""

    def validate(self) -> None:
        super().validate()
        if self.stage1_steps < 0:
            raise self._invalid("stage1_steps", f"must be >= 0, got {self.stage1_steps}")
        if self.beta < 0:
            raise self._invalid("beta", f"must be >= 0, got {self.beta}")
        if self.z_loss_multiplier is not None or self.label_smoothing:
            raise self._invalid(
                "z_loss_multiplier",
                "two-stage KL training supports neither z-loss nor label smoothing; unset them",
            )

    def build(
        self,
        model: nn.Module,
        device: torch.device | None = None,
        dp_process_group: dist.ProcessGroup | None = None,
    ) -> TwoStageKLTrainModule:
        self.validate()
        return TwoStageKLTrainModule(self, model, device or get_default_device(), dp_process_group)


class TwoStageKLTrainModule(TransformerTrainModule):
    """Stage 1 trains on cross-entropy; at its end the model is snapshotted, and stage 2 adds
    the exact KL to that snapshot, which limits how far stage 2 drifts from stage 1."""

    config: TwoStageKLTrainModuleConfig

    def __init__(
        self,
        config: TwoStageKLTrainModuleConfig,
        model: nn.Module,
        device: torch.device,
        dp_process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(config, model, device, dp_process_group)
        # Allocated up front, sharded like the policy, so a checkpoint always has the same
        # layout; it holds meaningful weights only once `snapshot_taken` is set.
        self.reference = ReferenceModel.snapshot_of(
            self.model, source="policy snapshot", device=device, layout=self.layout
        )
        self.snapshot_taken = torch.zeros((), dtype=torch.int64)

    def on_attach(self) -> None:
        super().on_attach()
        loader = self.trainer.data_loader
        if not isinstance(loader, StagedDataLoader) or len(loader.stage_steps) != 2:
            return
        stage1, stage2 = loader.stage_steps
        if stage1 != self.config.stage1_steps:
            raise ConfigurationError(
                f"the data loader switches to stage 2's data after {stage1} steps but "
                f"stage1_steps is {self.config.stage1_steps}; make them equal so the snapshot "
                "is taken where the data changes",
                path="train_module.stage1_steps",
            )
        max_steps = self.trainer.max_steps
        if stage2 is not None and max_steps is not None and max_steps != stage1 + stage2:
            raise ConfigurationError(
                f"the two stages last {stage1} + {stage2} steps but max_duration is {max_steps} "
                f"steps; set max_duration to {stage1 + stage2} steps so that the LR schedule "
                "spans both stages exactly (hard_stop stops earlier without changing it)",
                path="max_duration",
            )

    @property
    def in_stage2(self) -> bool:
        return self.trainer.global_step > self.config.stage1_steps

    @torch.no_grad()
    def take_snapshot(self) -> None:
        """Copy the policy's weights (shard by shard) into the frozen reference."""
        for ref, pol in zip(self.reference.model.parameters(), self.model.parameters()):
            ref.copy_(pol)
        self.reference.source = f"policy@step {self.trainer.global_step - 1}"
        self.snapshot_taken.fill_(1)
        log.info("stage 2 begins: the reference is the policy after step %d",
                 self.trainer.global_step - 1)  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "reference": {"model": self.reference.model.state_dict(), "taken": self.snapshot_taken},
        }

    def state_dict_to_load(self, optim: bool = True) -> dict[str, Any]:
        return {
            **super().state_dict_to_load(optim),
            "reference": {"model": self.reference.model.state_dict(), "taken": self.snapshot_taken},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.pop("reference", None)
        if saved is not None:
            # DCP loaded the tensors in place; a torch.save-style dict is applied here.
            self.reference.model.load_state_dict(saved["model"])
            self.snapshot_taken.copy_(torch.as_tensor(saved["taken"]))
        super().load_state_dict(state_dict)

    def train_batch(self, batch: dict[str, Any], dry_run: bool = False) -> None:
        if not self.in_stage2:
            super().train_batch(batch, dry_run)
            return
        if not bool(self.snapshot_taken):  # a host value kept on CPU: no device sync
            self.take_snapshot()
        if not self.model.training:
            self.model.train()
        ignore = self.config.label_ignore_index
        ids, labels = batch["input_ids"], labels_from_batch(batch, ignore)
        doc_ids = batch.get("doc_ids")  # packed SFT data: attention within each document
        slices = self._microbatches(ids)
        count = self._global_token_count(labels)
        scale = count.reciprocal() * self.layout.averaged_ranks
        labels = self._local_labels(labels)
        ce_total = torch.zeros((), device=ids.device)
        kl_total = torch.zeros((), device=ids.device)
        for i, rows in enumerate(slices):
            with self._grad_sync(last=i == len(slices) - 1):
                if is_padding(rows):
                    self._padding_step(self.reference.model)
                    continue
                mb_ids, mb_labels = ids[rows], labels[rows]
                docs = None if doc_ids is None else doc_ids[rows]
                ref_logits = self.reference.logits(mb_ids, docs)
                with self._autocast, self._moe_share(mb_ids.numel()):
                    logits = self._forward_module(mb_ids, **_doc_kwargs(docs))
            ce, _ = cross_entropy_loss(logits, mb_labels, ignore_index=ignore, reduction="sum")
            mb_tokens = (mb_labels != ignore).sum()
            kl = token_kl_divergence(logits, ref_logits, mb_labels, ignore_index=ignore)
            kl_sum = kl * mb_tokens  # the masked mean back to a sum, normalised globally below
            ((ce + self.config.beta * kl_sum) * scale).backward()
            ce_total += ce.detach()
            kl_total += kl_sum.detach()
        self._record_moe(dry_run)
        if not dry_run:
            self.record_ce_loss(ce_total * scale, ReduceType.mean)
            self.record_metric("KL to snapshot", kl_total * scale, ReduceType.mean,
                               namespace="train")  # fmt: skip
            self.record_metric("stage", 2.0, namespace="train")
