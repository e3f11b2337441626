"""Direct Preference Optimization: a transformer trained on pairs against a frozen reference.

:class:`DPOTrainModule` is a :class:`TransformerTrainModule` whose step scores each pair's
chosen and rejected responses in one forward (the batch from
:class:`~olmolike.data.preference.PreferenceDataLoader` stacks them) and minimises
:func:`~olmolike.nn.functional.dpo_loss`; sharding, the LR schedule, clipping and the optimizer
step are the parent's. The reference's log-probs come from a :class:`ReferenceModel`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn as nn

from ...data.preference import PreferenceDataLoader
from ...exceptions import ConfigurationError
from ...nn.functional import DPOLossType, check_label_smoothing, dpo_loss
from ...nn.moe import aux_loss_weight
from ...utils import get_default_device
from ..common import ReduceType
from .reference import (
    ReferenceModel,
    cached_reference_logps,
    check_same_architecture,
    split_sequence_log_probs,
)
from .train_module import agreed_microbatches, is_padding, labels_from_batch, microbatch_rows
from .transformer import TransformerTrainModule, TransformerTrainModuleConfig

__all__ = ["DPOTrainModule", "DPOTrainModuleConfig"]


@dataclass
class DPOTrainModuleConfig(TransformerTrainModuleConfig):
    """A :class:`TransformerTrainModuleConfig` plus the preference loss.

    ``rank_microbatch_size`` counts the tokens of one side: a micro-batch of ``m`` pairs runs
    ``2 m`` sequences (chosen and rejected) through the model in one forward.
    """

    pipeline_refusal: ClassVar[str | None] = (
        "its loss compares the policy's and the frozen reference model's log-probabilities "
        "of both responses of a pair, and the pipelined step runs the plain LM loss only"
    )

    beta: float = 0.1
    """Strength of the implicit KL constraint to the reference: larger keeps the policy
    closer to it. 0.1 is the usual DPO value; IPO's beta is its tau."""
    loss_type: DPOLossType = DPOLossType.sigmoid
    """The preference loss, under TRL's names (see :class:`DPOLossType`)."""
    label_smoothing: float = 0.0
    """For ``cdpo`` and ``robust`` only: the assumed probability that a pair's labels are
    flipped. The other loss types refuse a non-zero value (TRL ignores it there)."""
    reference: str | None = None
    """The frozen reference's weights: a Hugging Face model folder or an olmolike checkpoint
    or save folder (its newest checkpoint), local or remote. It must have the policy's
    architecture. ``None`` uses the policy's initial weights: those of ``init_weights`` when
    set, else the policy as built. Only its source and fingerprint go into checkpoints, so a
    resume must be able to load the same weights again (a different reference is refused)."""
    precompute_reference_logps: bool = False
    """Score every pair of the training data with the reference once, before the first step,
    and cache the result in the work dir (keyed by the reference's and the data's
    fingerprints, so a resume or a rerun reads it back): each step then runs the policy's
    forward only. Needs a :class:`~olmolike.data.preference.PreferenceDataLoader`."""

    def validate(self) -> None:
        super().validate()
        if self.beta <= 0:
            raise self._invalid("beta", f"must be positive, got {self.beta}")
        if (problem := check_label_smoothing(self.loss_type, self.label_smoothing)) is not None:
            raise self._invalid("label_smoothing", problem)

    def build(
        self,
        model: nn.Module,
        device: torch.device | None = None,
        dp_process_group: dist.ProcessGroup | None = None,
        *,
        reference: nn.Module | None = None,
        reference_source: str | None = None,
    ) -> DPOTrainModule:
        """``reference`` is an unsharded model holding the reference weights, which takes
        precedence over the ``reference`` field; ``reference_source`` names it in logs and
        checkpoints."""
        self.validate()
        return DPOTrainModule(
            self,
            model,
            device or get_default_device(),
            dp_process_group,
            reference=reference,
            reference_source=reference_source,
        )


class DPOTrainModule(TransformerTrainModule):
    """Trains on preference pairs with the DPO loss against a frozen reference model; build it
    with :meth:`DPOTrainModuleConfig.build`."""

    config: DPOTrainModuleConfig
    loss_metric = "train/DPO loss"

    def __init__(
        self,
        config: DPOTrainModuleConfig,
        model: nn.Module,
        device: torch.device,
        dp_process_group: dist.ProcessGroup | None = None,
        *,
        reference: nn.Module | None = None,
        reference_source: str | None = None,
    ) -> None:
        if reference is not None:
            check_same_architecture(model, reference)
        super().__init__(config, model, device, dp_process_group)
        weights = config.reference or config.init_weights
        if reference is not None:
            self.reference = ReferenceModel(
                reference,
                source=reference_source or "given model",
                device=device,
                layout=self.layout,
            )
        elif weights is not None:
            # The policy gets `init_weights` only when fit() starts: the reference loads them
            # now rather than snapshotting the policy's not yet loaded weights.
            self.reference = ReferenceModel.load(
                self.model, weights, device=device, layout=self.layout
            )
        else:
            self.reference = ReferenceModel.snapshot_of(
                self.model,
                source=reference_source or "initial policy",
                device=device,
                layout=self.layout,
            )
        self._cached_logps: torch.Tensor | None = None
        """``(pairs, 2)`` reference log-probs (chosen, rejected) of every training pair."""

    # -- checkpoint: the reference is identified, never saved -------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "reference": self.reference.identity()}

    def state_dict_to_load(self, optim: bool = True) -> dict[str, Any]:
        return {**super().state_dict_to_load(optim), "reference": {"source": "", "fingerprint": ""}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.pop("reference", None)
        if saved is not None:
            self.reference.check_identity(saved)
        super().load_state_dict(state_dict)

    def on_attach(self) -> None:
        super().on_attach()
        loader = self.trainer.data_loader
        if self.config.precompute_reference_logps and not isinstance(loader, PreferenceDataLoader):
            raise ConfigurationError(
                "precompute_reference_logps needs a PreferenceDataLoader (whose batches say "
                f"which pairs they hold), got {type(loader).__name__}; unset it or switch loaders",
                path="train_module.precompute_reference_logps",
            )

    # -- the step -----------------------------------------------------------------------------

    def train_batch(self, batch: dict[str, Any], dry_run: bool = False) -> None:
        if not self.model.training:
            self.model.train()
        ignore = self.config.label_ignore_index
        ids, labels = batch["input_ids"], labels_from_batch(batch, ignore)
        pairs = ids.shape[0] // 2
        if ids.shape[0] % 2:
            raise ConfigurationError(
                "a DPO batch stacks chosen over rejected and needs an even number of rows; "
                "use PreferenceDataLoader",
                path="data_loader",
            )
        per_mb = microbatch_rows(ids, self.config.rank_microbatch_size, "rank_microbatch_size")
        index = batch.get("index")
        if self.config.precompute_reference_logps and self._cached_logps is None:
            # The first step of the run, on every rank alike: the reference's forwards run once.
            self._cached_logps = self._cached_reference_logps()
        # Micro-batches count pairs; the same collective sums the pairs over the ranks.
        slices, agreed = agreed_microbatches(pairs, per_mb, self.dp_process_group, also=(pairs,))
        # Times the world size, as DDP / FSDP average over ranks: the mean over the global
        # batch's pairs, however many each rank holds. Under context parallelism every rank
        # of a group has the same loss (from the group's sums) and the gradient of its own
        # tokens: DDP / FSDP average over those ranks too, so the gradient's scale counts them.
        scale = self.dp_world_size / max(1, agreed.sum[1])
        grad_scale = scale * self.layout.degrees.cp
        live = self._cached_logps is None or index is None  # as _reference_log_probs decides
        live_reference = (self.reference.model,) if live else ()
        stats = torch.zeros(7, device=ids.device)
        for i, pair_rows in enumerate(slices):
            with self._grad_sync(last=i == len(slices) - 1):
                if is_padding(pair_rows):
                    self._padding_step(*live_reference)
                    continue
                rows = torch.arange(pairs, device=ids.device)[pair_rows].repeat(2)
                rows[len(rows) // 2 :] += pairs
                mb_ids, mb_labels = ids[rows], labels[rows]
                mb_index = None if index is None else index[pair_rows]
                ref_c, ref_r, lengths = self._reference_log_probs(mb_ids, mb_labels, mb_index)
                # An MoE policy's auxiliary losses: the mean over the step's pairs, as the loss.
                with self._autocast, aux_loss_weight(len(rows) // 2 * scale):
                    logits = self._forward_module(mb_ids)
            pol, _ = self._log_probs(logits, mb_labels)
            pol_c, pol_r = pol.chunk(2)
            len_c, len_r = lengths.chunk(2)
            out = dpo_loss(
                pol_c, pol_r, ref_c, ref_r, beta=self.config.beta,
                loss_type=self.config.loss_type, label_smoothing=self.config.label_smoothing,
                chosen_lengths=len_c, rejected_lengths=len_r,
            )  # fmt: skip
            n = pol_c.shape[0]
            (out.loss * n * grad_scale).backward()
            margin = out.chosen_rewards - out.rejected_rewards
            stats += torch.stack([
                out.loss.detach() * n, out.chosen_rewards.sum(), out.rejected_rewards.sum(),
                (margin > 0).float().sum(), margin.sum(), pol_c.detach().sum(),
                pol_r.detach().sum(),
            ])  # fmt: skip
        self._record_moe(dry_run)
        if not dry_run:
            self._record(stats * scale)

    def _log_probs(
        self, logits: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy's summed log-probs and token counts of whole rows, from the logits this
        rank computed (its share of the tokens under context parallelism)."""
        ignore, cp = self.config.label_ignore_index, self.layout.context_parallel
        return split_sequence_log_probs(logits, labels, cp, ignore)

    def _reference_log_probs(
        self, ids: torch.Tensor, labels: torch.Tensor, index: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._cached_logps is None or index is None:
            logps, lengths = self.reference.sequence_log_probs(
                ids, labels, ignore_index=self.config.label_ignore_index
            )
            ref_c, ref_r = logps.chunk(2)
            return ref_c, ref_r, lengths
        cached = self._cached_logps[index.cpu()].to(ids.device)
        lengths = (labels != self.config.label_ignore_index).sum(-1)
        return cached[:, 0], cached[:, 1], lengths

    def _cached_reference_logps(self) -> torch.Tensor:
        loader = self.trainer.data_loader
        assert isinstance(loader, PreferenceDataLoader)  # checked in on_attach
        micro_pairs = max(1, self.config.rank_microbatch_size // (loader.seq_len // 4))
        return cached_reference_logps(
            self.reference, loader, self.trainer.work_dir, micro_pairs,
            self.config.label_ignore_index, self.dp_process_group,
        )  # fmt: skip

    def _record(self, means: torch.Tensor) -> None:
        names = ("rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin",
                 "logps/chosen", "logps/rejected")  # fmt: skip
        self.record_loss(means[0], ReduceType.mean)
        for name, value in zip(names, means[1:]):
            self.record_metric(name, value, ReduceType.mean, namespace="train")

    @torch.no_grad()
    def preference_accuracy(self, batch: dict[str, Any]) -> torch.Tensor:
        """Fraction of pairs whose chosen response the policy prefers *relative to the
        reference* (positive implicit reward margin): the held-out DPO accuracy."""
        ignore = self.config.label_ignore_index
        ids, labels = batch["input_ids"], labels_from_batch(batch, ignore)
        was_training = self.model.training
        self.model.eval()
        try:
            pol, _ = self._log_probs(self.model(ids), labels)
        finally:
            self.model.train(was_training)
        ref, _ = self.reference.sequence_log_probs(ids, labels, ignore_index=ignore)
        pol_c, pol_r = pol.chunk(2)
        ref_c, ref_r = ref.chunk(2)
        margin = (pol_c - ref_c) - (pol_r - ref_r)
        # A tie (the policy is still the reference) counts half: chance level, not 0.
        return ((margin > 0).float() + 0.5 * (margin == 0).float()).mean()
