"""The GRPO train module: one trainer step is one generation round and several updates.

Trainer step ``s``:

1. The reference (only with ``kl_coef > 0``) is made current: at step 1 it becomes a snapshot
   of the policy (unless a reference model was given), and with ``sync_interval = k`` the
   policy's weights are copied into it at the start of steps ``k + 1, 2k + 1, ...``.
2. Each data-parallel rank samples ``group_size`` completions for each of its own prompts (the
   batch of a :class:`~olmolike.data.prompts.PromptDataLoader`), seeded from ``(seed,
   data-parallel rank, s)``, scores them and computes the group advantages
   (:func:`.rollout.rollout`). The ranks of a tensor-parallel group share the seed and the
   prompts, and each sampled token is drawn from logits gathered for that one position, so
   they draw the same completions and feed the same tokens to the split model.
3. Without gradients: the sampling policy's log-probs (when there is more than one update, the
   ratio's denominator) and the reference's (for the KL term).
4. ``num_iterations`` passes over the generated batch, each split into ``num_minibatches``
   minibatches: one optimizer update per minibatch. The last update is taken in
   :meth:`GRPOTrainModule.optim_step`, where the trainer expects it (so ``pre_optim_step``
   callbacks see its gradients).

The LR schedule counts **optimizer updates**: update ``u`` (0-based) of step ``s`` is at
position ``(s - 1) * U + u + 1`` of ``max_steps * U``, with ``U = num_iterations *
num_minibatches``; warm-up lengths in a schedule are updates. A schedule in tokens is refused
(the prompt loader's "tokens" are prompts).

The loss of an update is normalised as ``loss.aggregation`` says (TRL's ``loss_type``): the
denominators of all of a step's updates are agreed over the ranks by one all-reduce at its
start, so the split into micro-batches (``rank_microbatch_size`` tokens per forward) never
changes the loss, and for every aggregation but ``bnpo`` neither does the number of ranks.

Under FSDP2 the policy is gathered once for the whole generation round (its blocks do not
reshard after each of the hundreds of one-token forward calls) and resharded right after.
Under tensor parallelism (with FSDP over the data ranks) the policy and the reference are split
the same way, the KV cache holds each rank's attention heads, and the completion log-probs
and entropies come from the vocabulary-sharded logits without gathering a row
(:func:`.rollout.completion_logps`). Pipeline and context parallelism are refused (see
:attr:`GRPOTrainModuleConfig.pipeline_refusal` and ``context_parallel_refusal``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from ....data.prompts import PromptDataLoader, PromptRecord
from ....data.tokenizer import Tokenizer
from ....distributed.utils import agree_counts, get_rank
from ....exceptions import ConfigurationError
from ....nn.moe import aux_loss_weight
from ....optim import SchedulerUnits
from ....utils import get_default_device
from ...common import ReduceType
from ..reference import ReferenceModel, check_same_architecture
from ..train_module import is_padding, padding_loss
from ..transformer import TransformerTrainModule, TransformerTrainModuleConfig
from .loss import (
    GRPOLossConfig,
    RewardScaling,
    group_advantages,
    grpo_loss,
    update_denominators,
)
from .microbatches import StepPlan, select
from .rewards import RewardConfig, RewardFunctionError, RewardRegistry
from .rollout import Rollout, SamplingConfig, check_prompt_lengths, completion_logps, rollout
from .step_stats import StepStats, rollout_metrics

__all__ = ["GRPOTrainModule", "GRPOTrainModuleConfig"]

log = logging.getLogger(__name__)


@dataclass
class GRPOTrainModuleConfig(TransformerTrainModuleConfig):
    """A :class:`TransformerTrainModuleConfig` plus sampling, rewards and the GRPO loss.

    ``rank_microbatch_size`` bounds the tokens of one forward pass: a micro-batch holds
    ``rank_microbatch_size // width`` completions (at least one), ``width`` being the longest
    prompt plus completion of the generated batch.
    """

    pipeline_refusal: ClassVar[str | None] = (
        "generating rollouts needs every layer on each rank (KV-cache decoding runs one forward "
        "call per sampled token through the whole model, which a pipeline would pass stage by "
        "stage, one token at a time), and rollouts through a pipeline are not supported; "
        "tensor parallelism splits the policy and generates"
    )
    context_parallel_refusal: ClassVar[str | None] = (
        "its rollouts decode one token per forward with a KV cache, and context parallelism "
        "splits whole training sequences over ranks, not decoding steps; tensor parallelism "
        "splits the policy and generates"
    )

    rank_microbatch_size: int = 4096
    """Tokens per forward and backward pass on each rank (prompt and completion rows, padded): the
    memory knob; a step runs as many micro-batches as its rows need."""
    loss: GRPOLossConfig = field(default_factory=GRPOLossConfig)
    """Group size, advantage scaling, clipping, KL coefficient, aggregation."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """How completions are sampled (length, temperature, top-k / top-p)."""
    rewards: list[RewardConfig] = field(default_factory=list)
    """The reward functions by the names the training script registered, with weights."""
    num_iterations: int = 1
    """Passes over each generated batch (TRL's ``num_iterations``, PPO's epochs). More reuse
    each (expensive) generation round; the clip keeps the later passes near the sampling
    policy."""
    num_minibatches: int = 1
    """Optimizer updates per pass: the rank's ``prompts x group_size`` completions are split
    into this many equal minibatches. Must divide the completions per rank."""
    sync_interval: int | None = None
    """Copy the policy into the reference every this many steps (AstrAI's ``sync_interval``):
    the KL then keeps each stretch of training near where it started instead of near the
    initial policy. ``None`` keeps the reference frozen for the whole run."""
    seed: int = 0
    """Seed of the completions' sampling; step ``s`` on data-parallel rank ``r`` samples with a
    generator seeded from ``(seed, r, s)``, so a resumed run draws the same completions (and
    the ranks of a tensor-parallel group draw the same ones)."""

    def validate(self) -> None:
        super().validate()
        if self.scheduler is not None and self.scheduler.units == SchedulerUnits.tokens:
            raise self._invalid(
                "scheduler.units",
                "a GRPO schedule counts optimizer updates (the prompt loader's tokens are "
                "prompts); set scheduler.units=steps",
            )
        if self.num_iterations < 1:
            raise self._invalid("num_iterations", f"must be >= 1, got {self.num_iterations}")
        if self.num_minibatches < 1:
            raise self._invalid("num_minibatches", f"must be >= 1, got {self.num_minibatches}")
        if self.sync_interval is not None and self.sync_interval < 1:
            raise self._invalid("sync_interval", f"must be >= 1 or null, got {self.sync_interval}")
        if self.sync_interval is not None and self.loss.kl_coef == 0:
            raise self._invalid(
                "sync_interval",
                "refreshes the reference, which loss.kl_coef=0 does not use; set kl_coef > 0 "
                "or sync_interval=null",
            )
        if self.z_loss_multiplier is not None or self.label_smoothing:
            raise self._invalid(
                "z_loss_multiplier",
                "GRPO supports neither z-loss nor label smoothing; unset them",
            )
        if not self.rewards:
            raise self._invalid("rewards", "name at least one reward function")

    def build(  # type: ignore[override]
        self,
        model: nn.Module,
        device: torch.device | None = None,
        dp_process_group: dist.ProcessGroup | None = None,
        *,
        tokenizer: Tokenizer,
        registry: RewardRegistry,
        reference: nn.Module | None = None,
    ) -> GRPOTrainModule:
        """``registry`` holds the reward functions the config names (checked now).
        ``reference`` is an unsharded model with the reference weights; ``None`` snapshots
        the policy at step 1 (after ``init_weights`` loaded). Only used with ``kl_coef > 0``."""
        self.validate()
        registry.check(self.rewards)
        return GRPOTrainModule(
            self,
            model,
            device or get_default_device(),
            dp_process_group,
            tokenizer=tokenizer,
            registry=registry,
            reference=reference,
        )


class GRPOTrainModule(TransformerTrainModule):
    """Each step samples completions for a batch of prompts, scores them with the reward
    functions and optimises the GRPO loss on them; build it with
    :meth:`GRPOTrainModuleConfig.build`."""

    config: GRPOTrainModuleConfig
    loss_metric = "train/GRPO loss"

    def __init__(
        self,
        config: GRPOTrainModuleConfig,
        model: nn.Module,
        device: torch.device,
        dp_process_group: dist.ProcessGroup | None = None,
        *,
        tokenizer: Tokenizer,
        registry: RewardRegistry,
        reference: nn.Module | None = None,
    ) -> None:
        if reference is not None:
            check_same_architecture(model, reference)
        super().__init__(config, model, device, dp_process_group)
        self.tokenizer, self.registry = tokenizer, registry
        self.updates_per_step = config.num_iterations * config.num_minibatches
        self.reference: ReferenceModel | None = None
        self.reference_step = torch.full((), -1, dtype=torch.int64)
        """The step after which the policy's weights were copied into the reference; -1 while
        the step-1 snapshot is pending. Saved in checkpoints with the reference's weights."""
        if config.loss.kl_coef > 0:
            if reference is None:
                # Allocated now, sharded like the policy; it gets its weights at step 1.
                self.reference = ReferenceModel.snapshot_of(
                    self.model, source="policy@step 0", device=device, layout=self.layout
                )
            else:
                self.reference = ReferenceModel(
                    reference, source="given reference", device=device, layout=self.layout
                )
                self.reference_step.fill_(0)
        self._pending: dict[str, Any] = {}
        self._norms: list[Tensor] = []
        # The policy pi of the objective is the distribution sampled from: the model's logits
        # over the tokenizer's ids, divided by the temperature (top-k / top-p are not modelled).
        self._sampled: dict[str, Any] = {
            "temperature": config.sampling.temperature,
            "vocab_size": tokenizer.vocab_size,
        }

    # -- checkpoint: the reference's weights are part of the run -------------------------------

    def _with_reference(self, state: dict[str, Any]) -> dict[str, Any]:
        if self.reference is not None:
            state["reference"] = {
                "model": self.reference.model.state_dict(),
                "step": self.reference_step,
            }
        return state

    def state_dict(self) -> dict[str, Any]:
        return self._with_reference(super().state_dict())

    def state_dict_to_load(self, optim: bool = True) -> dict[str, Any]:
        return self._with_reference(super().state_dict_to_load(optim))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.pop("reference", None)
        if saved is not None and self.reference is not None:
            # DCP loaded the tensors in place; a torch.save-style dict is applied here.
            self.reference.model.load_state_dict(saved["model"])
            self.reference_step.copy_(torch.as_tensor(saved["step"]))
            self.reference.source = f"policy@step {int(self.reference_step)}"
        super().load_state_dict(state_dict)

    # -- attaching ----------------------------------------------------------------------------

    def _check_batches(self) -> None:
        loader = self.trainer.data_loader
        if not isinstance(loader, PromptDataLoader):
            raise ConfigurationError(
                f"GRPO samples completions of prompts; got a {type(loader).__name__}, use a "
                "PromptDataLoader",
                path="data_loader",
            )
        completions = loader.prompts_per_rank * self.config.loss.group_size
        if completions % self.config.num_minibatches:
            raise ConfigurationError(
                f"must divide the completions per rank (prompts_per_rank x group_size = "
                f"{completions}), got {self.config.num_minibatches}",
                path="train_module.num_minibatches",
            )
        ids = [self.tokenizer.encode(r.prompt) for r in loader.records]
        check_prompt_lengths(self.model, loader.records, ids, self.config.sampling.max_new_tokens)

    def _schedule_position(self) -> tuple[int, int | None]:
        """The last update of the current step, of ``max_steps x updates per step``."""
        steps = self.trainer.max_steps
        t_max = None if steps is None else steps * self.updates_per_step
        return self.trainer.global_step * self.updates_per_step, t_max

    def num_flops_per_token(self, seq_len: int) -> int | None:
        return None  # a step's work is generation plus updates, not tokens of the batch

    # -- the step -----------------------------------------------------------------------------

    def train_batch(self, batch: dict[str, Any], dry_run: bool = False) -> None:
        started = time.perf_counter()
        step = self.trainer.global_step
        self._refresh_reference(step)
        with self._gathered():
            out, plan = self._rollout(batch["records"], step)
            old = self._logps(self.model, out, plan) if self.updates_per_step > 1 else None
        ref = self._logps(self.reference.model, out, plan) if self.reference is not None else None
        if not self.model.training:
            self.model.train()
        size = out.input_ids.shape[0] // self.config.num_minibatches
        minibatches = [slice(i * size, (i + 1) * size) for i in range(self.config.num_minibatches)]
        denominators = update_denominators(
            [out.completion_mask[rows] for rows in minibatches],
            self.config.loss,
            max_completion_length=self.config.sampling.max_new_tokens,
            process_group=self.dp_process_group,
        )
        stats = StepStats(out.input_ids.device)
        for update in range(self.updates_per_step):
            if update > 0:
                self._update(update - 1)
                self.zero_grads()
            i = update % self.config.num_minibatches
            self._backward(out, minibatches[i], plan, old, ref, denominators[i], stats)
        self._record_moe(dry_run, passes=self.updates_per_step)
        self._pending = {"started": started, "rollout": out, "stats": stats, "dry_run": dry_run}

    def _rollout(self, records: list[PromptRecord], step: int) -> tuple[Rollout, StepPlan]:
        """This rank's rollout and the step's agreed micro-batch counts (:class:`StepPlan`). A
        reward function failing on any rank fails every rank here, so that none is left
        waiting in a later collective; the same collective agrees on the counts."""
        error: RewardFunctionError | None = None
        out: Rollout | None = None
        try:
            out = rollout(
                self.model,
                self.tokenizer,
                records,
                sampling=self.config.sampling,
                loss=self.config.loss,
                registry=self.registry,
                rewards=self.config.rewards,
                generator=self._generator(step),
            )
        except RewardFunctionError as e:
            error = e
        config = self.config
        plan = StepPlan(1, 0, 0)
        if out is not None:
            plan = StepPlan.local(out, config.rank_microbatch_size, config.num_minibatches)
        failed = 0 if error is None else get_rank() + 1
        agreed = agree_counts([failed, plan.full, plan.minibatch], self.dp_process_group).max
        if error is not None:
            raise error
        if agreed[0]:
            raise RewardFunctionError(
                f"a reward function failed on rank {agreed[0] - 1} at step {step} (its "
                "error is logged there); fix the function and resume"
            )
        assert out is not None
        loss = config.loss
        if loss.scale_rewards == RewardScaling.batch and self.dp_world_size > 1:
            # The std of every rank's rewards, now that every rank is known to have them.
            advantages, _ = group_advantages(
                out.rewards, loss.group_size, scale=loss.scale_rewards, eps=loss.advantage_eps,
                process_group=self.dp_process_group,
            )  # fmt: skip
            out = dataclasses.replace(out, advantages=advantages)
        return out, dataclasses.replace(plan, full=agreed[1], minibatch=agreed[2])

    def optim_step(self) -> None:
        self._update(self.updates_per_step - 1)
        pending, self._pending = self._pending, {}
        if pending and not pending["dry_run"]:
            self._record(pending["rollout"], pending["stats"], pending["started"])
        self._norms = []

    def _refresh_reference(self, step: int) -> None:
        if self.reference is None:
            return
        interval = self.config.sync_interval
        due = interval is not None and step > 1 and (step - 1) % interval == 0
        if int(self.reference_step) >= 0 and not due:
            return
        for model in (self.reference.model, self.model):
            for unit in model.modules():
                if isinstance(unit, FSDPModule):  # the roots keep their gathered parameters
                    unit.reshard()
        with torch.no_grad():
            for ref, pol in zip(self.reference.model.parameters(), self.model.parameters()):
                ref.copy_(pol)
        self.reference_step.fill_(step - 1)
        self.reference.source = f"policy@step {step - 1}"
        log.info("the reference is now the policy after step %d", step - 1)

    def _generator(self, step: int) -> torch.Generator:
        """The sampling generator of ``step`` on this rank: seeded by the data-parallel rank,
        which the ranks of a tensor-parallel group share (they must draw the same tokens)."""
        dp_rank = self.layout.degrees.dp_rank(get_rank())
        key = f"{self.config.seed}/{dp_rank}/{step}".encode()
        seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1
        return torch.Generator(device=self.device).manual_seed(seed)

    @contextlib.contextmanager
    def _gathered(self) -> Iterator[None]:
        """Keep an FSDP2 policy's parameters gathered from the first forward until the end."""
        units = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        for unit in units:
            unit.set_reshard_after_forward(False, recurse=False)
        try:
            yield
        finally:
            dp = self.config.dp_config
            for unit in units:
                unit.reshard()
                # As apply_fsdp set them: the root never reshards after forward.
                again = unit is not self.model and (dp is None or dp.reshard_after_forward)
                unit.set_reshard_after_forward(again, recurse=False)

    @torch.no_grad()
    def _logps(self, model: nn.Module, out: Rollout, plan: StepPlan) -> Tensor:
        parts = []
        for rows in plan.slices(slice(0, out.input_ids.shape[0]), plan.full):
            with self._autocast:
                if is_padding(rows):
                    padding_loss(model, self.device)
                    continue
                logps, _ = completion_logps(model, select(out, rows), **self._sampled)
                parts.append(logps.float())
        return torch.cat(parts)

    def _backward(
        self,
        out: Rollout,
        rows: slice,
        plan: StepPlan,
        old: Tensor | None,
        ref: Tensor | None,
        denominator: Tensor,
        stats: StepStats,
    ) -> None:
        """Forward and backward over one minibatch (one update's share of this rank), whose
        loss is divided by ``denominator`` (:func:`update_denominators`); its loss and
        statistics are added to ``stats``."""
        slices = plan.slices(rows, plan.minibatch)
        for i, span in enumerate(slices):
            with self._grad_sync(last=i == len(slices) - 1):
                if is_padding(span):
                    self._padding_step()
                    continue
                part = select(out, span)
                # An MoE policy's auxiliary losses: the mean over the update's completions
                # (as many on every rank), as the loss.
                share = (span.stop - span.start) / (rows.stop - rows.start)
                with self._autocast, aux_loss_weight(share):
                    logps, entropy = completion_logps(
                        self._forward_module, part, with_entropy=True, **self._sampled
                    )
            logps = logps.float()
            loss, loss_stats = grpo_loss(
                logps,
                logps.detach() if old is None else old[span],
                part.advantages,
                part.completion_mask,
                self.config.loss,
                ref_logps=None if ref is None else ref[span],
                denominator=denominator,
            )
            # DDP / FSDP average gradients over ranks: times the world size, the sum over ranks.
            loss = loss * self.dp_world_size
            loss.backward()
            assert entropy is not None
            stats.add(loss, loss_stats, entropy, part.completion_mask)

    def _update(self, update: int) -> None:
        """Optimizer update ``update`` (0-based) of this step, with its LR and clipping."""
        if self.scheduler is not None:
            last, t_max = self._schedule_position()
            position = last - self.updates_per_step + update + 1
            self.scheduler.set_lr(self.optim, position, t_max)
        if self.config.max_grad_norm is not None:
            norm = nn.utils.clip_grad_norm_(self._params, self.config.max_grad_norm)
            if isinstance(norm, DTensor):
                norm = norm.full_tensor()
            self._norms.append(norm)
        self.optim.step()

    def _record(self, out: Rollout, stats: StepStats, started: float) -> None:
        def record(name: str, value: float | Tensor, reduce: ReduceType = ReduceType.mean) -> None:
            self.record_metric(name, value, reduce, namespace="train")

        degrees = self.layout.degrees
        for name, value, reduce in rollout_metrics(out, degrees.world_size // degrees.dp):
            record(name, value, reduce)
        self.record_loss(stats.loss(self.updates_per_step), ReduceType.mean)
        for name, value, reduce in stats.metrics(with_kl=self.reference is not None):
            record(name, value, reduce)
        seconds = time.perf_counter() - started
        record("generation share", float(out.metrics["generation seconds"]) / max(seconds, 1e-9))
        if self.reference is not None:
            record("reference step", float(self.reference_step), ReduceType.max)
        for i, group in enumerate(self.optim.param_groups):
            name = group.get("name", f"group {i}")
            self.record_metric(f"LR ({name})", float(group["lr"]), namespace="optim")
        if self._norms:  # the mean over this step's updates
            self.record_metric(
                "total grad norm", torch.stack(self._norms).mean(), namespace="optim"
            )
