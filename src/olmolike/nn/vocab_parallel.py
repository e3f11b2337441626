"""Losses over vocabulary-sharded logits: no rank ever holds a full-vocabulary row.

Under tensor parallelism the output head is split column-wise, so its logits are a
:class:`~torch.distributed.tensor.DTensor` sharded on the last (vocabulary) dimension. The
cross-entropy needs only three numbers per token: the maximum logit, the sum of exponentials
(together the log-partition) and the label's logit. Each rank computes them over its own slice
of the vocabulary and one all-reduce per number combines them (Megatron-LM's
vocab-parallel cross-entropy). The all-reduces are DTensor redistributions (``Partial`` to
``Replicate``), so autograd differentiates through them and backward works outside any
context manager (unlike torch's ``loss_parallel()``, which must also wrap ``backward()`` and
has no label smoothing).

Sampling-time views of such logits stay sharded too: :func:`gather_positions` picks the
positions that predict a completion, :func:`limit_vocab` hides the ids a tokenizer cannot
decode (a padded vocabulary's tail) by masking, not slicing, and
:meth:`VocabParallelLogits.entropy` gives each token's entropy from the same three numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial, Shard

__all__ = ["VocabParallelLogits", "gather_positions", "is_vocab_parallel", "limit_vocab"]


def is_vocab_parallel(logits: Tensor) -> bool:
    """Whether ``logits`` are vocabulary-sharded (the output of a tensor-parallel head)."""
    return isinstance(logits, DTensor)


@dataclass
class VocabParallelLogits:
    """Flattened (N, V) logits sharded on the vocabulary, with the per-token log-partition.

    Built once per loss; :meth:`label_logits`, :meth:`mean_logit` and :meth:`sum_over_vocab`
    each add one all-reduce of N numbers.
    """

    local: Tensor
    """This rank's (N, V / tp) slice of the logits, in float32, differentiable."""
    logsumexp: Tensor
    """(N,) ``log(sum(exp(logits)))`` over the whole vocabulary, on every rank."""
    dtensor: DTensor
    """The logits as given (their mesh and layout)."""
    vocab_size: int
    """The whole vocabulary's size (the logits' last dimension)."""

    @staticmethod
    def check(logits: Tensor) -> DTensor:
        """``logits`` as a DTensor sharded on its last dimension over a 1-D mesh, or raise."""
        if not isinstance(logits, DTensor) or logits.placements != (Shard(logits.dim() - 1),):
            raise ValueError(
                "vocab-parallel losses need logits sharded on their last dimension over a "
                f"1-D tensor-parallel mesh, got {getattr(logits, 'placements', 'a plain tensor')}"
            )
        return logits

    @classmethod
    def of(cls, logits: Tensor) -> VocabParallelLogits:
        logits = cls.check(logits)
        vocab = logits.shape[-1]
        local = logits.to_local().reshape(-1, logits.to_local().shape[-1]).float()
        with torch.no_grad():  # the shift cancels in the gradient: keep it out of the graph
            top = _combine(logits, local.amax(-1), "max")
        sum_exp = _combine(logits, (local - top[:, None]).exp().sum(-1))
        return cls(local=local, logsumexp=sum_exp.log() + top, dtensor=logits, vocab_size=vocab)

    def label_logits(self, labels: Tensor) -> Tensor:
        """(N,) the logit of each flattened label (0 where the label is outside [0, V))."""
        width = self.local.shape[-1]
        index = labels.reshape(-1) - self.dtensor.device_mesh.get_local_rank() * width
        here = (index >= 0) & (index < width)
        picked = self.local.gather(-1, index.clamp(0, width - 1)[:, None]).squeeze(-1)
        return _combine(self.dtensor, picked * here)

    def mean_logit(self) -> Tensor:
        """(N,) the mean logit over the whole vocabulary (label smoothing's uniform term)."""
        return _combine(self.dtensor, self.local.sum(-1)) / self.vocab_size

    def sum_over_vocab(self, per_entry: Tensor) -> Tensor:
        """(N,) the sum over the vocabulary of ``per_entry``, an (N, V / tp) local slice."""
        return _combine(self.dtensor, per_entry.sum(-1))

    def entropy(self) -> Tensor:
        """(N,) the entropy (nats) of each token's distribution: ``logsumexp - sum(p * logit)``.
        A masked id (:func:`limit_vocab`) has ``p = 0`` and a finite logit, so adds nothing."""
        probs = (self.local - self.logsumexp[:, None]).exp()
        return self.logsumexp - self.sum_over_vocab(probs * self.local)


def limit_vocab(logits: Tensor, vocab_size: int) -> Tensor:
    """``logits`` (..., V) restricted to the ids below ``vocab_size``: sliced for a plain
    tensor; for vocabulary-sharded logits the ids at and above it get the dtype's lowest value
    on the ranks that hold them (slicing would cut across the shards), so they get probability
    exactly 0 in every softmax, log-partition and entropy."""
    if not isinstance(logits, DTensor):
        return logits[..., :vocab_size]
    if vocab_size >= logits.shape[-1]:
        return logits
    VocabParallelLogits.check(logits)
    local = logits.to_local()
    width = local.shape[-1]
    first = logits.device_mesh.get_local_rank() * width
    beyond = torch.arange(first, first + width, device=local.device) >= vocab_size
    local = local.masked_fill(beyond, torch.finfo(local.dtype).min)
    return DTensor.from_local(local, logits.device_mesh, logits.placements, run_check=False)


def gather_positions(logits: Tensor, positions: Tensor) -> Tensor:
    """The rows of ``logits`` (B, T, V) at ``positions`` (B, C): (B, C, V), differentiably.
    Vocabulary-sharded logits stay sharded: each rank picks from its own slice."""
    if not isinstance(logits, DTensor):
        return logits.gather(1, positions[..., None].expand(-1, -1, logits.shape[-1]))
    VocabParallelLogits.check(logits)
    local = logits.to_local()
    picked = local.gather(1, positions[..., None].expand(-1, -1, local.shape[-1]))
    return DTensor.from_local(picked, logits.device_mesh, logits.placements, run_check=False)


def _combine(like: DTensor, local: Tensor, reduce_op: str = "sum") -> Tensor:
    """All-reduce one value per token over the tensor-parallel ranks, differentiably."""
    partial = DTensor.from_local(local, like.device_mesh, [Partial(reduce_op)], run_check=False)
    return partial.full_tensor()
