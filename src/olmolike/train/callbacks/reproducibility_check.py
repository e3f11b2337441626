"""Check that a saved checkpoint reproduces the live model, right after it is saved.

A checkpoint that loads without error can still be wrong: a parameter left out of a custom
``state_dict``, a dtype cast on the way to disk, a staging buffer reused too early by an
async save. Such bugs surface only at the resume, possibly weeks later. This callback loads
each (or every n-th) checkpoint into the model after setting its weights to NaN, runs a few
fixed batches through it and requires the logits and loss the live weights gave, then puts
the live weights back bit for bit.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule

from ... import io
from ...distributed.checkpoint import load_model_and_optim_state
from ...distributed.checkpoint_format import MODEL_AND_OPTIM
from ...distributed.utils import (
    backend_supports_cpu,
    destroy_group,
    get_rank,
    get_world_size,
    is_distributed,
    new_group,
    using_group,
)
from ...exceptions import CheckpointError, ConfigurationError
from .callback import Callback, model_of
from .checkpointer import CheckpointerCallback

__all__ = ["ReproducibilityCheckCallback"]

log = logging.getLogger(__name__)

_IGNORE_INDEX = -100


@dataclass
class _Reference:
    """The live model's outputs at the step a checkpoint was saved, awaiting that checkpoint."""

    path: str
    logits: list[torch.Tensor]
    losses: list[torch.Tensor]


@dataclass
class ReproducibilityCheckCallback(Callback, name="reproducibility_check"):
    """After a checkpoint save, reload its model state and compare outputs with the live model.

    The live model's logits and loss on ``num_batches`` fixed batches are taken at the step
    the checkpoint is saved (its weights are exactly what was saved then). The check itself
    runs once the checkpoint is complete:

    * synchronous saves: in the same step, right after the checkpointer;
    * async saves: when the next save starts or training ends, the points at which every rank
      knows the earlier save has finished (a per-step look at the folder could see the marker
      on one rank and not on another, and the load's collectives would then not match).

    The checkpoint is loaded into the live model itself, not into a copy: its state is set
    aside (each rank clones its own part), filled with NaN so that anything the load misses
    cannot match by accident, loaded through the callback's own process group, run, and then
    restored bit for bit. A copy would have to be sharded exactly like the live model, and
    that cannot be had in general: FSDP2 refuses ``copy.deepcopy`` ("FSDP does not support
    deepcopy"), and rebuilding one needs the unsharded model (a train module may be handed a
    model that is already sharded) and every unit's ``fully_shard`` arguments (mesh,
    ``mp_policy``, ...), which only FSDP's private state holds; a copy gathered in another
    ``param_dtype`` would give other logits. Borrowing the live model keeps its sharding,
    mixed precision, compiled blocks and hooks as they are, so every layout works the same
    way: one process, DDP (each rank checks its replica), FSDP2 and HSDP (DTensor shards;
    every rank runs the same batches, so FSDP's gathers match). FSDP modules are resharded
    after every forward here, so no gathered copy of checkpoint weights outlives the check.
    Nothing else reads the weights meanwhile: the checkpointer runs first, and an async save
    has copied the state to CPU memory by the time ``save_async`` returns.

    A mismatch raises :class:`~olmolike.exceptions.CheckpointError` naming the checkpoint and
    the largest difference, which stops the run. The verdict is agreed across ranks first:
    if any rank sees a difference every rank raises, as one rank stopping while the others
    go on into training's collectives would hang them. Each check costs one extra copy of
    this rank's model state in memory (a shard under FSDP) and ``2 x num_batches`` forward
    passes; ``every_n_saves`` spreads it out.
    """

    num_batches: int = 2
    """Fixed batches to compare on (the data loader's mock batch and permutations of it)."""
    every_n_saves: int = 1
    """Check the first save and then every n-th one (``1``: every save)."""
    atol: float = 0.0
    """Allowed absolute difference; ``0`` with ``rtol=0`` means bit-exact (right on CPU)."""
    rtol: float = 0.0
    """Allowed difference relative to the live model's value."""
    seed: int = 0
    """Seeds the permutations that turn the mock batch into ``num_batches`` batches."""
    enabled: bool = True
    """``False`` turns the callback off while keeping it in the config (an override can turn it back
    on)."""

    _saves_seen: int = field(default=0, init=False, repr=False)
    _pending: list[_Reference] = field(default_factory=list, init=False, repr=False)
    _checkpointer: CheckpointerCallback | None = field(default=None, init=False, repr=False)
    _last_counted: str | None = field(default=None, init=False, repr=False)
    _group: dist.ProcessGroup | None = field(default=None, init=False, repr=False)
    _failed: bool = field(default=False, init=False, repr=False)

    priority = -5  # after the checkpointer (1), which must have saved the step first

    def validate(self) -> None:
        if self.num_batches < 1:
            raise ConfigurationError(f"must be >= 1, got {self.num_batches}", path="num_batches")
        if self.every_n_saves < 1:
            raise ConfigurationError(
                f"must be >= 1, got {self.every_n_saves}", path="every_n_saves"
            )
        for name in ("atol", "rtol"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigurationError(f"must be a finite number >= 0, got {value}", path=name)

    def post_attach(self) -> None:
        if not self.enabled:
            return
        found = [
            cb for cb in self.trainer.callbacks.values() if isinstance(cb, CheckpointerCallback)
        ]
        if not found:
            raise ConfigurationError(
                "needs a CheckpointerCallback to check the checkpoints it saves; add one, or "
                "set enabled=False",
                path="reproducibility_check",
            )
        self._checkpointer = found[0]
        self._model()  # no model to check is a build error, not one at the first save
        # Its own group: an async save may still run collectives on the checkpointer's group
        # in the background while this check loads on the training thread.
        self._group = new_group("reproducibility check")

    def state_dict(self) -> dict[str, Any]:
        # Called while the checkpointer saves this step, before post_step counts that save: the
        # count stored in a checkpoint includes the checkpoint itself, so a resume keeps the
        # every_n_saves rhythm.
        saving_now = (
            self._checkpointer is not None and self._checkpoint_path() != self._last_counted
        )
        return {"saves_seen": self._saves_seen + int(saving_now)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._saves_seen = int(state_dict.get("saves_seen", 0))

    def pre_train(self) -> None:
        self._after_possible_save()

    def post_step(self) -> None:
        self._after_possible_save()

    def post_train(self) -> None:
        # The checkpointer has saved the final checkpoint and waited for every pending save.
        self._after_possible_save()
        self._verify_pending()

    def on_error(self, exc: BaseException) -> None:
        self._failed = True

    def close(self) -> None:
        # Its group goes with the trainer; after an error a peer may be gone: no barrier then.
        destroy_group(self._group, barrier=not self._failed)

    def _after_possible_save(self) -> None:
        checkpointer = self._checkpointer
        if checkpointer is None or not checkpointer.active:
            return
        step = self.trainer.global_step
        path = self._checkpoint_path()
        # post_train follows the last post_step: the same save must not be counted twice.
        if checkpointer.last_saved_step != step or path == self._last_counted:
            return
        self._saves_seen += 1
        self._last_counted = path
        if (self._saves_seen - 1) % self.every_n_saves == 0:
            self._pending.append(self._reference(path))
        if not checkpointer.save_async:
            self._verify_pending()
            return
        # Starting this save waited for the previous one: every older one is complete.
        older = [ref for ref in self._pending if ref.path != path]
        self._pending = [ref for ref in self._pending if ref.path == path]
        for reference in older:
            self._verify(reference)

    def _checkpoint_path(self) -> str:
        return io.join_path(self.trainer.save_folder, f"step{self.trainer.global_step}")

    def _verify_pending(self) -> None:
        pending, self._pending = self._pending, []
        for reference in pending:
            self._verify(reference)

    def _model(self) -> nn.Module:
        return model_of(
            self.trainer.train_module,
            needed_for="to check",
            fix="use a train module that holds its model as .model, or set enabled=False",
            path="reproducibility_check",
        )

    def _batches(self) -> list[torch.Tensor]:
        """``num_batches`` fixed batches: the mock batch, then seeded shuffles of its tokens."""
        ids = self.trainer.data_loader.get_mock_batch()["input_ids"].long()
        generator = torch.Generator().manual_seed(self.seed)
        batches = [ids]
        for _ in range(self.num_batches - 1):
            order = torch.randperm(ids.numel(), generator=generator)
            batches.append(ids.reshape(-1)[order].reshape(ids.shape))
        return [b.to(self.trainer.device) for b in batches]

    @torch.no_grad()
    def _outputs(self, model: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        was_training = model.training
        model.eval()
        logits, losses = [], []
        try:
            for ids in self._batches():
                out = model(ids).float()
                labels = F.pad(ids[:, 1:], (0, 1), value=_IGNORE_INDEX)
                loss = F.cross_entropy(
                    out.reshape(-1, out.shape[-1]), labels.reshape(-1), ignore_index=_IGNORE_INDEX
                )
                logits.append(out)
                losses.append(loss)
        finally:
            model.train(was_training)
            # FSDP keeps the root's gathered weights after a forward until a backward, which
            # never comes here, and a later forward reuses them without gathering. Free them:
            # they are a full copy of the root's weights, and the check is about to change or
            # restore the shards under them. (FSDP's state_dict hooks would reshard as well;
            # the check does not depend on that.)
            _reshard(model)
        return logits, losses

    def _reference(self, path: str) -> _Reference:
        logits, losses = self._outputs(self._model())
        return _Reference(path, logits, losses)

    def _verify(self, reference: _Reference) -> None:
        model = self._model()
        weights = io.join_path(reference.path, MODEL_AND_OPTIM)
        with using_group(self._group, "reproducibility check"):
            with _live_state_set_aside(model):
                load_model_and_optim_state(weights, model, process_group=self._group)
                logits, losses = self._outputs(model)
            self._compare(reference, logits, losses)
        log.info("Checkpoint %s reproduces the live model's outputs", reference.path)

    def _ranks_that_differ(self, differs: bool) -> list[int]:
        """Every rank's verdict, on every rank (a collective: all ranks call it in turn)."""
        if not is_distributed():
            return [0] if differs else []
        group = self._group  # the group the load just used
        # It is a gloo group whenever the backend has gloo; an NCCL-only one needs the device.
        device = "cpu" if backend_supports_cpu(group) else self.trainer.device
        flags = torch.zeros(get_world_size(group), dtype=torch.int32, device=device)
        flags[get_rank(group)] = int(differs)
        dist.all_reduce(flags, group=group)
        return [int(rank) for rank in flags.nonzero().flatten().tolist()]

    def _compare(
        self, reference: _Reference, logits: list[torch.Tensor], losses: list[torch.Tensor]
    ) -> None:
        pairs = list(zip(reference.logits, logits)) + list(zip(reference.losses, losses))
        same = all(
            torch.allclose(got, want, atol=self.atol, rtol=self.rtol, equal_nan=False)
            for want, got in pairs
        )
        differing = self._ranks_that_differ(not same)
        if not differing:
            return
        if same:
            raise CheckpointError(
                f"checkpoint {reference.path} does not reproduce the model it was saved from "
                f"on rank(s) {differing}, whose errors give the difference (this rank's "
                "outputs matched). Resuming from it would not continue this run: check the "
                "train module's state_dict_to_save and the model's persistent buffers"
            )
        max_diff = max(float((got - want).abs().max()) for want, got in pairs)
        loss_text = ", ".join(
            f"{float(want):.6g} vs {float(got):.6g}" for want, got in zip(reference.losses, losses)
        )
        raise CheckpointError(
            f"checkpoint {reference.path} does not reproduce the model it was saved from: the "
            f"largest difference in logits or loss is {max_diff:.6g} (atol={self.atol}, "
            f"rtol={self.rtol}; loss live vs reloaded: {loss_text}). Resuming from it would "
            "not continue this run: check the train module's state_dict_to_save and the "
            "model's persistent buffers, or raise atol/rtol on a nondeterministic device"
        )


def _reshard(model: nn.Module) -> None:
    """Free the weights FSDP gathered for a forward (a no-op for unsharded models)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()  # not recursive: every FSDP unit is visited


@contextlib.contextmanager
def _live_state_set_aside(model: nn.Module) -> Iterator[None]:
    """Fill ``model``'s saved state with NaN for the block, then restore it bit for bit.

    The backup is this rank's own part of the state: its shards for DTensor (FSDP/HSDP)
    parameters, whose ``clone`` and ``copy_`` stay local. Tensors are changed in place, so
    the optimizer's references to the parameters stay valid.
    """
    _reshard(model)  # state_dict must hold the sharded parameters, not gathered ones
    with torch.no_grad():
        backup: dict[str, torch.Tensor] = {}
        clones: dict[int, torch.Tensor] = {}  # tied weights: one clone, one NaN fill
        for name, tensor in model.state_dict(keep_vars=True).items():
            if id(tensor) not in clones:
                clones[id(tensor)] = tensor.detach().clone()
                if tensor.is_floating_point():
                    # Anything the checkpoint fails to restore stays NaN: it cannot match.
                    tensor.fill_(float("nan"))
            backup[name] = clones[id(tensor)]
    try:
        yield
    finally:
        _reshard(model)
        with torch.no_grad():
            # Looked up again by name: a load that replaced a tensor still gets the live value.
            current = model.state_dict(keep_vars=True)
            for name, saved in backup.items():
                current[name].copy_(saved)
