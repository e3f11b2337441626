"""The configs of tensor and context parallelism, the mesh dimensions inside a data-parallel rank.

The model-specific split (which projections are column- or row-wise) lives with the model, in
:mod:`olmolike.nn.parallel_plan`; these configs only say how many ranks each spans.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import Config

__all__ = ["ContextParallelConfig", "TensorParallelConfig"]


@dataclass
class TensorParallelConfig(Config):
    """Tensor parallelism: every layer's matrices split over ``degree`` adjacent ranks.

    The ranks of one tensor-parallel group see the same batch and each computes a slice of
    every layer (Megatron-LM's split, with sequence parallelism for the norms and a
    vocabulary-parallel loss; see :mod:`olmolike.nn.parallel_plan`). It costs collectives in
    every layer, forward and backward, so keep ``degree`` within one node (fast links); it
    pays once a model's layers no longer fit FSDP's per-rank gathers, or to cut the data-parallel
    degree (and so the global batch) at a large rank count.
    """

    degree: int = 1
    """Ranks per tensor-parallel group: must divide the world size, the number of heads and
    key/value heads, the MLP hidden size and the vocabulary size."""

    def validate(self) -> None:
        if self.degree < 1:
            raise self._invalid("degree", f"must be >= 1, got {self.degree}")


@dataclass
class ContextParallelConfig(Config):
    """Context parallelism (the sequence split across ranks for attention): not available yet.

    The mesh keeps a ``cp`` dimension of size 1 so it can slot in. It is refused rather than
    shipped untested: torch 2.13's ``context_parallel`` has no CPU path (no sharding strategy
    for the CPU flash-attention op, and the math backend fails on mixed Tensor/DTensor
    inputs), so no test on this project's machines could check it.
    """

    degree: int = 1
    """Ranks per context-parallel group; only 1 is accepted."""

    def validate(self) -> None:
        if self.degree < 1:
            raise self._invalid("degree", f"must be >= 1, got {self.degree}")
        if self.degree > 1:
            raise self._invalid(
                "degree",
                f"is {self.degree}, but olmolike has no context parallelism: torch 2.13's "
                "context_parallel has no CPU path (no sharding strategy for the CPU "
                "flash-attention op; the math backend fails on mixed Tensor/DTensor), so it "
                "could not be tested; set cp_config.degree=1 and use tp_config for long "
                "sequences' activation memory",
            )
