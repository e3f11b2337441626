"""A :class:`~olmolike.nn.transformer.Transformer` cut into pipeline stages by layers.

A stage holds a contiguous run of blocks; the first stage also holds the token embedding, the
last the final norm and the output head. Every held module keeps the attribute path it has in
the whole model (``blocks`` is a ``ModuleDict`` keyed by the global layer index), so a stage's
parameter names are the unsplit model's: checkpoints do not depend on the pipeline layout.

The modules are the whole model's own (not copies), so building stages from a model on the
``meta`` device allocates nothing; :meth:`TransformerParts.materialize` then initialises each
stage with exactly the weights the unsplit model would get from the same seed.

Under tensor parallelism the model is split (:mod:`olmolike.nn.parallel_plan`) before it is cut
into stages, so each stage's modules are already tensor-parallel. Between blocks the hidden
states are DTensors sharded on the sequence (sequence parallelism); a pipeline sends plain
tensors of a fixed shape, so a stage hands on its rank's sequence shard as a plain
``(B, T / tp, d_model)`` tensor and the next stage wraps it again: each tensor-parallel rank
talks to the same rank of the next stage, nothing is gathered. The last stage's logits stay
sharded on the vocabulary for the vocabulary-parallel loss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.nn as nn
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from .context_parallel import ShardAttention
from .moe import aux_loss_weight
from .rope import RotaryEmbedding, document_attention
from .transformer import Transformer, init_parameters
from .transformer_config import TransformerConfig

__all__ = ["TransformerParts", "TransformerStage"]


class _Parts(nn.Module):
    """The named parts of a transformer one module holds (``None`` where it holds none)."""

    embeddings: nn.Embedding | None
    norm: nn.Module | None
    lm_head: nn.Linear | None

    def __init__(
        self,
        config: TransformerConfig,
        embeddings: nn.Embedding | None,
        blocks: dict[int, nn.Module],
        norm: nn.Module | None,
        lm_head: nn.Linear | None,
    ) -> None:
        super().__init__()
        self.config = config
        self.embeddings = embeddings
        self.blocks = nn.ModuleDict({str(i): block for i, block in sorted(blocks.items())})
        self.norm = norm
        self.lm_head = lm_head

    def layer_indices(self) -> list[int]:
        return [int(key) for key in self.blocks]

    def num_flops_per_token(self, seq_len: int) -> int:
        """The whole model's training FLOPs per token (throughput and MFU count the model's
        work, whichever ranks share it)."""
        return self.config.num_flops_per_token(seq_len)


class TransformerStage(_Parts):
    """Layers ``layers`` of ``model``, with the embedding if ``first``, the norm and head if
    ``last``: input ids (first) or hidden states in, hidden states or logits (last) out.

    ``doc_ids`` (packed documents) are given to every stage by the caller, not sent along the
    pipeline: each stage builds its own attention mask and positions from them.

    ``tp_mesh``: the tensor-parallel mesh ``model`` was split over, if any; hidden states then
    leave and enter the stage as the rank's plain sequence shard (see the module doc). Under
    context parallelism (``model.context_parallel``) the first stage takes whole sequences
    and keeps its rank's tokens; the hidden states passed on are those tokens'.
    """

    def __init__(
        self,
        model: Transformer,
        layers: range,
        *,
        first: bool,
        last: bool,
        tp_mesh: DeviceMesh | None = None,
    ) -> None:
        super().__init__(
            model.config,
            model.embeddings if first else None,
            {i: model.blocks[i] for i in layers},
            model.norm if last else None,
            model.lm_head if last else None,
        )
        config = model.config
        self.rope = RotaryEmbedding(
            config.head_dim, config.max_sequence_length, config.rope_theta, config.rope_scaling
        )
        self.rope.to(model.rope.cos.device)
        self.tp_mesh = tp_mesh
        self.context_parallel = model.context_parallel

    def shape_inference(self) -> contextlib.AbstractContextManager[None]:
        """Where the pipeline runs a forward only to learn the output shapes (on placeholder
        inputs): MoE blocks then attach no auxiliary loss and count no routing."""
        return aux_loss_weight(0.0)

    def forward(self, x: Tensor, doc_ids: Tensor | None = None) -> Tensor:
        cp = self.context_parallel
        mask: Tensor | ShardAttention | None = None
        if self.embeddings is not None:
            h = self.embeddings(x if cp is None else cp.shard(x))
        elif self.tp_mesh is not None:  # this rank's sequence shard, as the blocks expect it
            h = DTensor.from_local(x, self.tp_mesh, [Shard(1)], run_check=False)
        else:
            h = x
        if cp is not None:  # the hidden states are this rank's tokens already
            cos, sin, mask = cp.attention_inputs(self.rope, h.shape[1], doc_ids)
        elif doc_ids is not None:
            positions, mask = document_attention(doc_ids)
            cos, sin = self.rope.at(positions)
        else:
            cos, sin = self.rope(h.shape[1])
        for block in self.blocks.values():
            h = block(h, cos, sin, mask)
        if self.lm_head is None:
            return h.to_local() if isinstance(h, DTensor) else h
        assert self.norm is not None
        return self.lm_head(self.norm(h))


class TransformerParts(_Parts):
    """Everything one rank holds of a pipelined transformer (the union of its stages), under
    the unsplit model's parameter names: what its optimizer steps and its checkpoint saves.

    It shares its modules with the stages and has no forward of its own.
    """

    def __init__(self, stages: Sequence[TransformerStage]) -> None:
        blocks = {i: stage.blocks[str(i)] for stage in stages for i in stage.layer_indices()}
        super().__init__(
            stages[0].config,
            next((s.embeddings for s in stages if s.embeddings is not None), None),
            blocks,
            next((s.norm for s in stages if s.norm is not None), None),
            next((s.lm_head for s in stages if s.lm_head is not None), None),
        )
        self._stages = list(stages)  # a plain list: not submodules, no second set of names

    def materialize(self, device: torch.device | str, *, seed: int | None = None) -> None:
        """Allocate the held parameters on ``device`` with the unsplit model's initial values."""
        device = torch.device(device)
        self.to_empty(device=device)
        init_parameters(self, self.config, seed=seed, device=device)
        for stage in self._stages:
            stage.rope.reset_buffers(device)

    def forward(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(
            "a pipeline rank's parts have no forward of their own: run the pipeline schedule"
        )
