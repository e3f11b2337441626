"""A frozen reference model: what DPO and two-stage KL training compare the policy against.

The reference has the policy's architecture and is sharded like it (a plain replica under DDP
or on one rank, ``fully_shard``-ed the same way under FSDP2), is never trained (its parameters
have ``requires_grad=False`` and are in no optimizer), always runs in eval mode under
``torch.no_grad``, and is *identified*, not stored, in the policy's checkpoint: its source and a
content fingerprint go into the train module's state, and a resume that would use another
reference is refused.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ...data.preference import PreferenceDataLoader, split_pair_rows
from ...distributed.utils import broadcast_object, get_rank, get_world_size, is_distributed
from ...exceptions import CheckpointError, ConfigurationError
from ...nn.context_parallel import ContextParallel
from ...nn.functional import sequence_log_probs
from ..weights import load_pretrained_weights
from .layout import ParallelLayout

__all__ = [
    "ReferenceModel",
    "cached_reference_logps",
    "check_same_architecture",
    "model_fingerprint",
]

log = logging.getLogger(__name__)


def model_fingerprint(model: nn.Module) -> str:
    """SHA-256 of every parameter and buffer's name, shape, dtype and bytes (16 hex digits).

    Under FSDP2 each shard is gathered (a collective: every rank must call this), so the
    fingerprint is the same on every rank and for any sharding of the same weights.
    """
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        data = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{tuple(data.shape)}:{data.dtype};".encode())
        digest.update(data.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def check_same_architecture(policy: nn.Module, reference: nn.Module) -> None:
    """Raise a :class:`ConfigurationError` naming every config field where the two differ."""
    p_cfg, r_cfg = getattr(policy, "config", None), getattr(reference, "config", None)
    if dataclasses.is_dataclass(p_cfg) and dataclasses.is_dataclass(r_cfg):
        p_fields, r_fields = dataclasses.asdict(p_cfg), dataclasses.asdict(r_cfg)  # type: ignore[arg-type]
        differing = [
            f"{k}: policy {p_fields.get(k)!r} vs reference {r_fields.get(k)!r}"
            for k in sorted(set(p_fields) | set(r_fields))
            if p_fields.get(k) != r_fields.get(k) and k != "init_std"
        ]
        if differing:
            raise ConfigurationError(
                "the reference model's architecture differs from the policy's ("
                + "; ".join(differing)
                + "): load a reference of the policy's architecture",
                path="reference",
            )
    p_shapes = {k: tuple(v.shape) for k, v in policy.state_dict().items()}
    r_shapes = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    if p_shapes != r_shapes:
        diff = sorted(
            k for k in set(p_shapes) | set(r_shapes) if p_shapes.get(k) != r_shapes.get(k)
        )
        raise ConfigurationError(
            f"the reference model's parameters differ from the policy's in {diff[:5]}: load a "
            "reference of the policy's architecture",
            path="reference",
        )


def _empty_like(policy: nn.Module) -> nn.Module:
    """A new unsharded model of ``policy``'s architecture on the CPU (its weights are to be
    overwritten): built from its config when it has one, else a deep copy."""
    config = getattr(policy, "config", None)
    build = getattr(config, "build", None)
    return build(init_device="cpu") if callable(build) else copy.deepcopy(policy)


class ReferenceModel:
    """A frozen model, sharded like the policy, that scores responses without gradients."""

    def __init__(
        self,
        model: nn.Module,
        *,
        source: str,
        device: torch.device,
        layout: ParallelLayout | None = None,
    ) -> None:
        """Freeze ``model`` (unsharded, with the reference weights) and split it on the policy's
        ``layout`` (tensor parallelism, FSDP/HSDP; nothing for DDP or one process).

        ``source`` says where the weights came from (a path, or ``"policy@step N"`` for a
        snapshot); it is saved with the fingerprint to identify the reference in checkpoints.
        """
        model.to(device)
        model.eval()
        self.fingerprint = model_fingerprint(model)
        if layout is not None:
            layout.shard(model)
        model.requires_grad_(False)  # after sharding: tensor parallelism makes new parameters
        self.model = model
        self.context_parallel = None if layout is None else layout.context_parallel
        self.source = source
        log.info("reference model from %s, fingerprint %s", source, self.fingerprint)

    @classmethod
    def load(
        cls,
        policy: nn.Module,
        source: str,
        *,
        device: torch.device,
        layout: ParallelLayout | None = None,
    ) -> ReferenceModel:
        """A frozen model of ``policy``'s architecture with the weights of ``source``: a
        Hugging Face model folder or an olmolike checkpoint / save folder, local or remote.

        Every rank must call this (loading runs collectives when distributed).

        :raises ConfigurationError: if the weights are not of the policy's architecture.
        """
        model = _empty_like(policy)
        try:
            load_pretrained_weights(model, source)
        except ConfigurationError as e:
            raise ConfigurationError(
                f"the reference model must have the policy's architecture, and {source} does "
                f"not fit it ({e.reason}); or point the reference at weights of the policy's "
                "architecture, or unset it to use the policy's initial weights",
                path="reference",
            ) from None
        return cls(model, source=source, device=device, layout=layout)

    @classmethod
    def snapshot_of(
        cls,
        policy: nn.Module,
        *,
        source: str,
        device: torch.device,
        layout: ParallelLayout | None = None,
    ) -> ReferenceModel:
        """A frozen copy of ``policy``'s current weights (an unsharded policy, or a full state)."""
        state = {
            k: v.full_tensor() if isinstance(v, DTensor) else v
            for k, v in policy.state_dict().items()
        }
        model = _empty_like(policy)
        model.load_state_dict({k: v.detach().cpu().clone() for k, v in state.items()})
        return cls(model, source=source, device=device, layout=layout)

    @torch.no_grad()
    def sequence_log_probs(
        self, input_ids: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed response log-probs and token counts per row, in fp32, without autocast."""
        with torch.autocast(input_ids.device.type, enabled=False):
            logits = self.model(input_ids)
        return split_sequence_log_probs(logits, labels, self.context_parallel, ignore_index)

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The reference's logits; with ``doc_ids`` (packed SFT sequences) attention stays
        within each document, as the policy's does."""
        with torch.autocast(input_ids.device.type, enabled=False):
            if doc_ids is None:  # a model without documents need not take the argument
                return self.model(input_ids)
            return self.model(input_ids, doc_ids=doc_ids)

    def identity(self) -> dict[str, Any]:
        return {"source": self.source, "fingerprint": self.fingerprint}

    def check_identity(self, saved: dict[str, Any]) -> None:
        """Refuse to resume with a reference other than the one the checkpoint was trained with."""
        if saved.get("fingerprint") != self.fingerprint:
            raise CheckpointError(
                f"the checkpoint was trained against reference {saved.get('source')!r} "
                f"(fingerprint {saved.get('fingerprint')}), but this run loaded {self.source!r} "
                f"(fingerprint {self.fingerprint}): point the reference at the same weights"
            )


def split_sequence_log_probs(
    logits: torch.Tensor, labels: torch.Tensor, cp: ContextParallel | None, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~olmolike.nn.functional.sequence_log_probs` of whole sequences' ``labels``
    from ``logits`` that are, under context parallelism, this rank's share of the tokens: the
    sums over the shares are added up over the context-parallel group (each rank's gradient
    flows to its own share)."""
    if cp is None:
        return sequence_log_probs(logits, labels, ignore_index=ignore_index)
    local = cp.shard(labels, pad_value=ignore_index)
    logps, lengths = sequence_log_probs(logits, local, ignore_index=ignore_index)
    return cp.sum(logps), cp.sum(lengths)


def cached_reference_logps(
    reference: ReferenceModel,
    loader: PreferenceDataLoader,
    work_dir: Path,
    micro_pairs: int,
    ignore_index: int = -100,
    dp_process_group: torch.distributed.ProcessGroup | None = None,
) -> torch.Tensor:
    """The reference's summed log-probs ``(pairs, 2)`` (chosen, rejected) of every pair the
    loader holds, read from ``work_dir`` if a run computed them before, else computed now
    (each data-parallel rank of ``dp_process_group`` scores its share, the shares are
    gathered; the ranks of a tensor-parallel group score the same share together) and written
    there by rank 0.

    The file is named by the reference's and the data's fingerprints, so other weights or
    other data never read it. Every rank must call this: rank 0 decides whether the file is
    there and shares what it read, so a node-local ``work_dir`` works too.
    """
    path = (
        Path(work_dir) / f"dpo-reference-logps-{reference.fingerprint}-{loader.fingerprint[:16]}.pt"
    )
    cached: torch.Tensor | None = None
    if get_rank() == 0 and path.is_file():
        cached = torch.load(path, weights_only=True)
    if is_distributed():
        cached = broadcast_object(cached)
    if cached is not None:
        log.info("reference log-probs of %d pairs read from %s", cached.shape[0], path)
        return cached
    logps = _score_all_pairs(
        reference, loader.instances, micro_pairs, ignore_index, dp_process_group
    )
    if get_rank() == 0:
        tmp = path.with_name(path.name + ".tmp")
        torch.save(logps, tmp)
        os.replace(tmp, path)
        log.info("reference log-probs of %d pairs cached in %s", logps.shape[0], path)
    return logps


@torch.no_grad()
def _score_all_pairs(
    reference: ReferenceModel,
    rows: torch.Tensor,
    micro_pairs: int,
    ignore_index: int,
    group: torch.distributed.ProcessGroup | None,
) -> torch.Tensor:
    """Every data-parallel rank scores a contiguous share of ``rows`` (padded with row 0 so
    that all ranks run the same forwards, as FSDP's collectives need), then the shares are
    gathered."""
    world, rank = get_world_size(group), get_rank(group)
    total = rows.shape[0]
    share = -(-total // world)
    mine = torch.arange(rank * share, (rank + 1) * share).clamp(max=total) % total
    device = next(reference.model.parameters()).device
    parts = []
    for start in range(0, share, micro_pairs):
        batch = split_pair_rows(rows[mine[start : start + micro_pairs]])
        logps, _ = reference.sequence_log_probs(
            batch["input_ids"].to(device), batch["labels"].to(device), ignore_index=ignore_index
        )
        parts.append(torch.stack(logps.chunk(2), dim=1).float())
    local = torch.cat(parts)
    if world == 1:
        return local.cpu()
    gathered = [torch.empty_like(local) for _ in range(world)]
    torch.distributed.all_gather(gathered, local, group=group)
    return torch.cat(gathered)[:total].cpu()
