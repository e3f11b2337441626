"""How a GRPO step splits its rollout into micro-batches that every rank runs in step."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..train_module import count_microbatches, padded_microbatches
from .rollout import Rollout

__all__ = ["StepPlan", "select"]


@dataclass(frozen=True)
class StepPlan:
    """How many micro-batches a step runs, the same on every rank: ``full`` for the
    no-gradient passes over the whole rollout (old and reference log-probs), ``minibatch`` for
    each minibatch's forward and backward. Ranks' rollouts differ in width (prompt plus
    completion) and so in the completions a micro-batch holds (``rows``); a rank that needs
    fewer micro-batches than another runs padding ones, so that FSDP's collectives match."""

    rows: int
    """Completions per micro-batch: ``rank_microbatch_size`` tokens over the width of the longest
    row (at least one)."""
    full: int
    """Micro-batches of the no-gradient passes over the whole rollout (old and reference
    log-probabilities)."""
    minibatch: int
    """Micro-batches of each minibatch's forward and backward."""

    @classmethod
    def local(cls, out: Rollout, rank_microbatch_size: int, num_minibatches: int) -> StepPlan:
        """The counts this rank's rollout needs by itself: micro-batches of at most
        ``rank_microbatch_size`` tokens, the rollout split into ``num_minibatches``."""
        rows = max(1, rank_microbatch_size // out.input_ids.shape[1])
        completions = out.input_ids.shape[0]
        return cls(
            rows,
            count_microbatches(completions, rows),
            count_microbatches(completions // num_minibatches, rows),
        )

    def slices(self, rows: slice, count: int) -> list[slice]:
        return padded_microbatches(rows, self.rows, count)


def select(out: Rollout, rows: slice) -> Rollout:
    """The completions ``rows`` of a rollout (texts and metrics are not carried)."""
    return dataclasses.replace(
        out,
        input_ids=out.input_ids[rows],
        completion_start=out.completion_start[rows],
        completion_ids=out.completion_ids[rows],
        completion_mask=out.completion_mask[rows],
        rewards=out.rewards[rows],
        advantages=out.advantages[rows],
        completions=out.completions[rows],
        metrics={},
    )
