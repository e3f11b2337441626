"""Pipeline parallelism: how a model's layers are cut into stages, which ranks run which
stage, and the schedule that moves micro-batches through them (``torch.distributed.pipelining``).

A pipeline of ``degree`` ranks runs ``degree x stages_per_rank`` stages; stage ``s`` lives on
pipeline rank ``s % degree`` (the "loop" placement interleaved 1F1B expects: with two stages
per rank, rank 0 holds stages 0 and ``degree``). Layers are balanced over the stages: when they
do not divide evenly, the first stages get one layer more.

The schedule sees exactly the micro-batches a non-pipelined step would run (the rank batch cut
into ``rank_microbatch_size`` pieces), computes the loss on the last stage, and leaves the
gradients unscaled: the loss function is already normalised by the whole batch's token count.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..config import Config, StrEnum
from ..exceptions import ConfigurationError
from .expert_parallel import clip_grads_with_norm, grad_norm

if TYPE_CHECKING:  # imported when a schedule is built (see build_schedule)
    import torch.distributed.pipelining.schedules

__all__ = [
    "PipelineParallelConfig",
    "PipelineScheduleType",
    "build_schedule",
    "clip_grad_norm_across_stages",
    "split_layers",
]


class PipelineScheduleType(StrEnum):
    """The order in which a pipeline runs its micro-batches' forwards and backwards."""

    gpipe = "gpipe"
    """All forwards, then all backwards: simplest; keeps every micro-batch's activations."""
    one_f_one_b = "1f1b"
    """One forward, one backward in the steady state: the same bubble as GPipe, but at most
    ``degree`` micro-batches' activations alive per rank."""
    interleaved_1f1b = "interleaved_1f1b"
    """1F1B over several smaller stages per rank (``stages_per_rank``): the bubble shrinks by
    that factor, for ``stages_per_rank`` times more point-to-point sends."""


@dataclass
class PipelineParallelConfig(Config):
    """Pipeline parallelism: ``degree`` ranks each run part of the layers.

    The micro-batches are the train module's: the rank batch is cut into
    ``rank_microbatch_size`` pieces, and those pieces flow through the pipeline. More
    micro-batches than stages keep the pipeline's bubble (idle time) small: it is about
    ``(stages - 1) / (micro-batches + stages - 1)`` of a step.
    """

    degree: int = 1
    """Pipeline ranks (the mesh's ``pp`` dimension)."""
    schedule: PipelineScheduleType = PipelineScheduleType.one_f_one_b
    """The order of the micro-batches' forwards and backwards (:class:`PipelineScheduleType`):
    ``gpipe``, ``1f1b`` or ``interleaved_1f1b``."""
    stages_per_rank: int | None = None
    """Stages on each rank; ``None`` means 2 for ``interleaved_1f1b`` and 1 otherwise. Only
    the interleaved schedule runs more than one."""

    def validate(self) -> None:
        if self.degree < 1:
            raise self._invalid("degree", f"must be >= 1, got {self.degree}")
        if self.stages_per_rank is not None and self.stages_per_rank < 1:
            raise self._invalid("stages_per_rank", f"must be >= 1, got {self.stages_per_rank}")
        interleaved = self.schedule == PipelineScheduleType.interleaved_1f1b
        if not interleaved and self.local_stages > 1:
            raise self._invalid(
                "stages_per_rank",
                f"{self.schedule} runs one stage per rank; use schedule=interleaved_1f1b for "
                f"{self.local_stages} stages per rank",
            )

    @property
    def local_stages(self) -> int:
        """Stages on each pipeline rank."""
        if self.stages_per_rank is not None:
            return self.stages_per_rank
        return 2 if self.schedule == PipelineScheduleType.interleaved_1f1b else 1

    @property
    def num_stages(self) -> int:
        return self.degree * self.local_stages

    def stage_indices(self, pp_rank: int) -> list[int]:
        """The stages pipeline rank ``pp_rank`` runs, in pipeline order (loop placement)."""
        return [pp_rank + k * self.degree for k in range(self.local_stages)]

    def check_microbatches(self, count: int) -> None:
        """Refuse a micro-batch count the schedule cannot run: 1F1B needs at least one per
        pipeline rank, interleaved 1F1B whole rounds of ``degree``."""
        fix = "change the batch size or train_module.rank_microbatch_size"
        if self.schedule == PipelineScheduleType.one_f_one_b and count < self.degree:
            raise ConfigurationError(
                f"1F1B over {self.degree} pipeline ranks needs at least {self.degree} "
                f"micro-batches per rank batch, but it has {count}; {fix} (more micro-batches "
                "also shrink the pipeline's idle time)",
                path="train_module.pp_config.schedule",
            )
        if self.schedule != PipelineScheduleType.interleaved_1f1b or count <= self.degree:
            return
        if count % self.degree:
            raise ConfigurationError(
                f"interleaved 1F1B with {self.degree} pipeline ranks needs a number of "
                f"micro-batches that is a multiple of {self.degree} (or at most {self.degree}), "
                f"but each rank batch has {count}; {fix}",
                path="train_module.pp_config.schedule",
            )


def split_layers(n_layers: int, num_stages: int) -> list[range]:
    """The layers of each stage: contiguous, as even as possible, earlier stages larger."""
    if n_layers < num_stages:
        raise ConfigurationError(
            f"the model has {n_layers} layers but the pipeline has {num_stages} stages "
            "(degree x stages_per_rank), and every stage needs at least one layer; lower "
            "train_module.pp_config.degree or train_module.pp_config.stages_per_rank, or use "
            "a deeper model (model.n_layers)",
            path="train_module.pp_config",
        )
    base, extra = divmod(n_layers, num_stages)
    bounds = [0]
    for stage in range(num_stages):
        bounds.append(bounds[-1] + base + (1 if stage < extra else 0))
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


def build_schedule(
    config: PipelineParallelConfig,
    stage_modules: list[nn.Module],
    stage_indices: list[int],
    *,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
    group: dist.ProcessGroup,
    device: torch.device,
) -> torch.distributed.pipelining.schedules._PipelineSchedule:
    """The schedule over this rank's stages; gradients are left unscaled (see the module doc).
    Without ``loss_fn`` it runs forwards only (evaluation)."""
    # Imported here: torch.distributed.pipelining imports torch._dynamo (~1 CPU s), which a
    # process without a pipeline (every CLI command, most runs) would pay at start-up.
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleLoopedBFS,
    )

    stage_class = _stage_class()
    stages = [
        stage_class(module, index, config.num_stages, device, group=group)
        for module, index in zip(stage_modules, stage_indices)
    ]
    if loss_fn is None:  # forwards only: the order of the backwards does not matter
        if len(stages) == 1:
            return ScheduleGPipe(stages[0], n_microbatches)
        return ScheduleLoopedBFS(stages, n_microbatches)
    if config.schedule == PipelineScheduleType.interleaved_1f1b:
        return ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn, scale_grads=False)
    single = ScheduleGPipe if config.schedule == PipelineScheduleType.gpipe else Schedule1F1B
    return single(stages[0], n_microbatches, loss_fn, scale_grads=False)


@cache
def _stage_class() -> type:
    """torch's ``PipelineStage``, told when a forward only infers shapes (defined when the
    first schedule is built, see :func:`build_schedule`).

    A schedule's first step runs each stage once on placeholder inputs (the first stage on
    the first micro-batch) to learn its output shapes, before the real micro-batches. A
    module with a ``shape_inference()`` context manager runs that forward inside it: a
    mixture of experts then adds no auxiliary loss and counts no routing for it."""
    from torch.distributed.pipelining import PipelineStage

    class _Stage(PipelineStage):
        def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
            probe = getattr(self.submod, "shape_inference", None)
            with probe() if callable(probe) else contextlib.nullcontext():
                return super()._prepare_forward_infra(*args, **kwargs)

    return _Stage


@torch.no_grad()
def clip_grad_norm_across_stages(
    params: Iterable[nn.Parameter], max_norm: float | None, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """The L2 norm of all gradients of the whole model, every stage's included, and (with
    ``max_norm``) every gradient scaled so that norm is at most ``max_norm``.

    Each rank takes the norm of its own (possibly FSDP-sharded) gradients, then the squares
    are summed over the pipeline ``group``: one all-reduce, on every rank, every step.
    """
    with_grads = [p for p in params if p.grad is not None]
    local = grad_norm([p.grad for p in with_grads if p.grad is not None])
    square = local.float().pow(2)
    if group is not None:
        dist.all_reduce(square, group=group)
    total = square.sqrt()
    if max_norm is not None and math.isfinite(max_norm):
        clip_grads_with_norm(with_grads, max_norm, total)
    return total
