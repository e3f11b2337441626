"""The configs of tensor and context parallelism, the mesh dimensions inside a data-parallel rank.

The model-specific split (which projections are column- or row-wise, how attention sees a
split sequence) lives with the model, in :mod:`olmolike.nn.parallel_plan` and
:mod:`olmolike.nn.context_parallel`; these configs only say how many ranks each spans.
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
    """Context parallelism: every sequence split over ``degree`` ranks, which compute
    attention over all of it together (:mod:`olmolike.nn.context_parallel`).

    Each rank keeps the activations of ``1 / degree`` of the tokens (plus every layer's keys
    and values of the whole sequence), so a sequence too long for one device's activation
    memory trains on several. Each rank holds two chunks of ``seq_len / (2 degree)`` tokens,
    an early one and a late one, so causal attention costs every rank the same. Per layer it
    costs an all-gather of the sequence's keys and values (and a reduce-scatter of their
    gradients); parameters are not split: FSDP shards them over the data and context ranks
    together, and checkpoints do not depend on the degree. A sequence length that is not a
    multiple of ``2 x degree`` (``x tp`` under tensor parallelism) is padded with ignored
    tokens.
    """

    degree: int = 1
    """Ranks per context-parallel group (the mesh's ``cp`` dimension); they read the same
    batch."""

    def validate(self) -> None:
        if self.degree < 1:
            raise self._invalid("degree", f"must be >= 1, got {self.degree}")
