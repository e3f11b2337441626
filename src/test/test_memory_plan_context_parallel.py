"""``olmolike plan`` under context parallelism: the activation formula by hand and against
what gloo ranks hold (torch's MemTracker), the longest sequence that fits, the layouts listed."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from test_memory_plan import AC_MODES, _ActivationPeak
from testutils import run_distributed_test
from torch.utils.checkpoint import checkpoint

from olmolike.exceptions import ConfigurationError
from olmolike.nn import TransformerConfig
from olmolike.nn.context_parallel import apply_context_parallel
from olmolike.nn.functional import cross_entropy_loss
from olmolike.plan.activations import activation_bytes
from olmolike.plan.memory import Layout
from olmolike.plan.report import (
    GIB,
    check_model_split,
    config_layout,
    fitting,
    longest_sequence,
    pipeline_memory,
)
from olmolike.train.train_module import TransformerTrainModuleConfig
from olmolike.train.train_module.grpo import GRPOTrainModuleConfig, RewardConfig

HAND = TransformerConfig(
    vocab_size=10, d_model=8, n_layers=2, n_heads=2, mlp_hidden_size=6, max_sequence_length=16
)
MEASURED = TransformerConfig(
    vocab_size=256, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, mlp_hidden_size=192,
    max_sequence_length=512,
)  # fmt: skip
SEQ = 512


def test_activation_formula_under_context_parallelism_by_hand() -> None:
    # Per token, a = 4: block 432 and outside 180 (test_memory_plan's hand count); keys and
    # values 2 * 4 * 8 = 64, the joined attention output 4 * 8 = 32, RoPE cos and sin at the
    # rank's positions 2 * 4 * 4 = 32. CP 2 over 16 tokens: 8 own tokens; each block keeps
    # its own 8 x 432, the other rank's 8 tokens' keys and values and the joined output.
    assert activation_bytes(HAND, 16, 4) == 16 * (2 * 432 + 180)
    per_block = 8 * 432 + 8 * 64 + 8 * 32
    assert activation_bytes(HAND, 16, 4, layout=Layout(cp=2)) == 2 * per_block + 8 * (180 + 32)
    # TP divides all of it (heads, and keys and values, split too).
    both = activation_bytes(HAND, 16, 4, layout=Layout(cp=2, tp=2))
    assert both == (2 * per_block + 8 * (180 + 32)) // 2


def _peak(group: dist.ProcessGroup | None, ac: str) -> int:
    model = MEASURED.build(seed=0)
    if ac == "full":  # as the train module checkpoints a block
        for block in model.blocks:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    ids = torch.randint(0, 256, (1, SEQ), generator=torch.Generator().manual_seed(0))
    labels = ids
    if group is not None:
        apply_context_parallel(model, group)
        assert model.context_parallel is not None
        labels = model.context_parallel.shard(ids, pad_value=-100)
    tracker = _ActivationPeak()
    tracker.track_external(model, ids, labels)
    with tracker:  # the training loop's order: the logits live until after backward
        logits = model(ids)
        loss, _ = cross_entropy_loss(logits, labels, reduction="sum")
        loss.backward()
    return tracker.peak


def _peaks_on_four_ranks() -> dict[tuple[int, str], int]:
    """CP 2 (ranks 0-1 and 2-3, a sequence each) and CP 4, without and with checkpointing."""
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    peaks = {}
    for ac in ("none", "full"):
        peaks[2, ac] = _peak(pairs[rank // 2], ac)
        peaks[4, ac] = _peak(dist.group.WORLD, ac)
    return peaks


@pytest.mark.slow
def test_activations_per_rank_fall_with_cp_as_planned() -> None:
    """One sequence of 512 tokens at cp = 1, 2, 4, without and with full activation
    checkpointing: every rank's peak of activations within 10% of the planner's figure."""
    measured = {(1, ac): [_peak(None, ac)] for ac in ("none", "full")}
    for rank_peaks in run_distributed_test(_peaks_on_four_ranks, 4, timeout=240):
        for key, peak in rank_peaks.items():
            measured.setdefault(key, []).append(peak)
    for (cp, ac), peaks in measured.items():
        planned = activation_bytes(MEASURED, SEQ, 4, AC_MODES[ac], layout=Layout(cp=cp))
        for peak in peaks:
            assert abs(peak - planned) <= 0.1 * planned, (cp, ac, peak, planned)
    none = {cp: max(measured[cp, "none"]) for cp in (1, 2, 4)}
    assert none[4] < none[2] < none[1]


PLANNED = TransformerConfig.olmo2_1B(100_352)


@pytest.mark.parametrize(
    "layout", [Layout(dp_shard=8), Layout(dp_shard=2, cp=4), Layout(cp=4, tp=2), Layout(pp=2, cp=4)]
)
def test_longest_sequence_fits_and_one_step_longer_does_not(layout: Layout) -> None:
    module = TransformerTrainModuleConfig(rank_microbatch_size=4096)
    limit, step = 78 * GIB, 2 * layout.cp * layout.tp
    longest = longest_sequence(PLANNED, module, layout, AC_MODES["full"], limit, n_microbatches=2)
    assert longest > 0 and longest % step == 0

    def total(seq: int) -> int:
        at = replace(module, rank_microbatch_size=seq)
        return max(m.total for m in pipeline_memory(PLANNED, at, layout, AC_MODES["full"], 2))

    assert total(longest) <= limit < total(longest + step)


def test_context_parallelism_lengthens_the_longest_sequence_and_is_listed() -> None:
    module = TransformerTrainModuleConfig(rank_microbatch_size=4096)
    fits, _ = fitting(PLANNED, module, gpus=8, limit=78 * GIB)
    by_layout = {(m.layout.cp, m.layout.dp_shard, m.layout.tp, m.layout.pp): m for m in fits}
    # FSDP over 8 ranks, then over 2 data x 4 context ranks, then over 8 context ranks.
    longest = [by_layout[cp, shard, 1, 1].longest for cp, shard in ((1, 8), (4, 2), (8, 1))]
    assert longest[0] < longest[1] < longest[2]
    assert by_layout[4, 2, 1, 1].layout.data_parallel == "fsdp"
    assert any(m.layout.cp > 1 and m.layout.data_parallel == "ddp" for m in fits)


def test_a_module_that_refuses_context_parallelism_is_refused_by_the_plan() -> None:
    grpo = GRPOTrainModuleConfig(rank_microbatch_size=64, rewards=[RewardConfig("exact")])
    layout = config_layout(grpo, gpus=8, gpus_per_node=8, tp=1, pp=1, cp=2)
    with pytest.raises(ConfigurationError, match="KV cache") as info:
        check_model_split(PLANNED, grpo, layout, 1)
    assert "\n" not in str(info.value)
    fits, _ = fitting(PLANNED, grpo, gpus=8, limit=78 * GIB)
    assert fits and all(m.layout.cp == 1 for m in fits)
