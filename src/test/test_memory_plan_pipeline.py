"""The memory planner under pipeline parallelism, alone and with tensor parallelism: the bytes
each pipeline rank holds, the schedules' micro-batches in flight, and the tensor-parallel split
read from :mod:`olmolike.nn.parallel_plan` (hand-computed numbers; the held bytes of real
ranks are checked in ``test_memory_plan_held.py``)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from olmolike.distributed.pipeline import PipelineScheduleType
from olmolike.exceptions import ConfigurationError
from olmolike.nn import TransformerConfig
from olmolike.optim import AdamWConfig
from olmolike.plan.activations import activation_bytes, microbatches_in_flight
from olmolike.plan.memory import Layout, state_bytes, tensor_parallel_dims
from olmolike.plan.report import check_model_split, fitting, plan_report
from olmolike.train.train_module import (
    ActivationCheckpointingConfig,
    ActivationCheckpointingMode,
    TransformerTrainModuleConfig,
)

# Per block 416 parameters (norms 16, q/k/v/out 4 x 64, MLP 3 x 48); embedding and head 80,
# final norm 8. Per token of activations (float32): a block 432, the outside 180, a stage's
# output 32.
HAND = TransformerConfig(
    vocab_size=10, d_model=8, n_layers=2, n_heads=2, mlp_hidden_size=6, max_sequence_length=16
)
ROPE = 2 * 16 * 4 * 4
BLOCK, OUTSIDE, OUTPUT = 432, 180, 32
INTERLEAVED = PipelineScheduleType.interleaved_1f1b


def test_tensor_parallel_split_is_read_from_the_plan() -> None:
    dims = tensor_parallel_dims(replace(HAND, qk_norm=True))
    block = {
        "attention.w_q.weight": 0, "attention.w_k.weight": 0, "attention.w_v.weight": 0,
        "attention.w_out.weight": 1, "attention.q_norm.weight": 0, "attention.k_norm.weight": 0,
        "feed_forward.w_gate.weight": 0, "feed_forward.w_up.weight": 0,
        "feed_forward.w_down.weight": 1,
    }  # fmt: skip
    expected = {"embeddings.weight": 0, "lm_head.weight": 0}
    expected |= {f"blocks.{i}.{name}": dim for i in range(2) for name, dim in block.items()}
    assert dims == expected  # the norms without QK-norm's feature split stay whole


def test_tensor_and_pipeline_parallel_split_each_stage() -> None:
    # TP 2 halves embedding and head (40 each), q/k/v/out (32 each) and the MLP (24 each);
    # the block's two norms (16) stay whole: a block holds 16 + 128 + 72 = 216 per TP rank.
    layout = Layout(pp=2, tp=2)  # ranks 0, 1: stage 0 (TP 0, 1); ranks 2, 3: stage 1
    first, last = 40 + 216, 216 + 8 + 40
    for rank, (numel, tensors) in enumerate([(first, 10), (first, 10), (last, 11), (last, 11)]):
        held = state_bytes(HAND, layout, AdamWConfig(), rank)
        assert (held.params, held.buffers) == (4 * numel, ROPE), rank
        assert held.optim == 2 * 4 * numel + 4 * tensors, rank
    # With FSDP 2 inside each stage, rank 0 (stage 0, dp_shard 0, tp 0) holds the first
    # chunk of each TP shard: embedding 3 of 5 rows, norms 4 + 4, q/k/v 2 of 4 rows, w_out
    # 4 of 8 rows, gate/up 2 of 3 rows, w_down 4 of 8 rows (of 3 columns).
    fsdp = Layout(pp=2, dp_shard=2, tp=2)
    block_first = 8 + 3 * 16 + 16 + 2 * 16 + 12
    assert state_bytes(HAND, fsdp, AdamWConfig(), 0).params == 4 * (24 + block_first)
    # rank 7 (stage 1, dp_shard 1, tp 1): the short chunks, and the final norm and head.
    block_last = 8 + 3 * 16 + 16 + 2 * 8 + 12
    assert state_bytes(HAND, fsdp, AdamWConfig(), 7).params == 4 * (block_last + 4 + 16)


def test_interleaved_stages_sit_on_ranks_in_a_loop() -> None:
    # 4 stages of one block on 2 pipeline ranks: rank 0 holds stages 0 and 2 (the embedding
    # and blocks 0, 2), rank 1 stages 1 and 3 (blocks 1, 3, norm, head), a RoPE table each.
    model = replace(HAND, n_layers=4)
    layout = Layout(pp=2, stages_per_rank=2, schedule=INTERLEAVED)
    assert state_bytes(model, layout, AdamWConfig(), 0).params == 4 * (80 + 2 * 416)
    assert state_bytes(model, layout, AdamWConfig(), 1).params == 4 * (2 * 416 + 8 + 80)
    assert state_bytes(model, layout, AdamWConfig(), 1).buffers == 2 * ROPE


@pytest.mark.parametrize(
    "schedule,first,last",
    [
        # GPipe runs all 4 forwards first: every micro-batch alive on both ranks.
        (PipelineScheduleType.gpipe, 4 * (2 * BLOCK + OUTPUT), 4 * (2 * BLOCK + OUTSIDE)),
        # 1F1B: the first rank waits for 2 backwards, the last runs one at a time.
        (PipelineScheduleType.one_f_one_b, 2 * (2 * BLOCK + OUTPUT), 2 * BLOCK + OUTSIDE),
        # Interleaved, 2 stages of one block per rank: torch's order keeps 5 stage-micro-
        # batches alive on rank 0 (4 warm-up forwards, then one forward before each
        # backward); on rank 1 two of stage 1 and one of the last stage (with the outside).
        (INTERLEAVED, 5 * (BLOCK + OUTPUT), 2 * (BLOCK + OUTPUT) + BLOCK + OUTSIDE),
    ],
)
def test_schedules_hold_their_micro_batches_in_flight(
    schedule: PipelineScheduleType, first: int, last: int
) -> None:
    model = replace(HAND, n_layers=4)
    v = 2 if schedule == INTERLEAVED else 1
    layout = Layout(pp=2, stages_per_rank=v, schedule=schedule)
    per_rank = [
        activation_bytes(model, 10, 4, layout=layout, microbatches=4, pp_rank=r) for r in (0, 1)
    ]
    assert per_rank == [10 * first, 10 * last]
    assert activation_bytes(model, 10, 4, layout=layout, microbatches=4) == 10 * max(first, last)


def test_in_flight_counts_follow_the_schedule_formulas() -> None:
    for pp, n in [(2, 8), (4, 8), (4, 2), (8, 16)]:
        gpipe = Layout(pp=pp, schedule=PipelineScheduleType.gpipe)
        one_f_one_b = Layout(pp=pp)
        interleaved = Layout(pp=pp, stages_per_rank=2, schedule=INTERLEAVED)
        for r in range(pp):
            assert microbatches_in_flight(gpipe, n, r) == n
            assert microbatches_in_flight(one_f_one_b, n, r) == min(n, pp - r)
            per_round = n // max(1, n // pp)
            expected = min(2 * n, per_round + 2 * (pp - 1 - r) + 1)
            assert microbatches_in_flight(interleaved, n, r) == expected, (pp, n, r)


def test_activation_checkpointing_counts_global_block_indices() -> None:
    # Every second block of 6, on 2 stages: stage 1 holds blocks 3, 4, 5 and checkpoints
    # block 4 only (as the train module does: before the model is cut into stages).
    model = replace(HAND, n_layers=6)
    every_2 = ActivationCheckpointingConfig(
        mode=ActivationCheckpointingMode.selected_blocks, block_interval=2
    )
    layout = Layout(pp=2)
    kept = 2 * BLOCK + 32 + OUTSIDE  # 2 whole blocks, one checkpointed input, the outside
    recompute = BLOCK - 32 + 40  # one block again, with the logits (40) alive
    got = activation_bytes(model, 10, 4, every_2, layout=layout, microbatches=2, pp_rank=1)
    assert got == 10 * (kept - OUTSIDE + max(OUTSIDE, recompute))


def test_pipelines_training_refuses_are_refused_and_left_out() -> None:
    module = TransformerTrainModuleConfig(rank_microbatch_size=64)
    with pytest.raises(ConfigurationError, match="cannot tie the embedding"):
        check_model_split(replace(HAND, tie_weights=True), module, Layout(pp=2), 2)
    with pytest.raises(ConfigurationError, match="1F1B over 2 pipeline ranks needs at least 2"):
        check_model_split(HAND, module, Layout(pp=2), 1)
    with pytest.raises(ConfigurationError, match="more pipeline stages"):
        check_model_split(HAND, module, Layout(pp=2, stages_per_rank=2, schedule=INTERLEAVED), 2)
    fits, _ = fitting(replace(HAND, tie_weights=True), module, 4, 2**30, 64 * 16)
    assert fits and all(m.layout.pp == 1 for m in fits)


def test_plan_lists_pipeline_and_tp_x_pp_layouts_with_each_pipeline_rank() -> None:
    model = replace(HAND, n_layers=4)
    module = TransformerTrainModuleConfig(rank_microbatch_size=64)
    fits, _ = fitting(model, module, 8, 2**30, 64 * 16)
    shapes = {(m.layout.pp, m.layout.tp) for m in fits}
    assert {(2, 1), (4, 1), (2, 2), (4, 2)} <= shapes  # 2 heads: tp 1 or 2
    report = plan_report(model, module, Layout(pp=2, tp=2, dp_shard=2), 80, 2, 64 * 16)
    assert "pipeline: 1f1b, 1 stage(s) per rank, 8 micro-batches per step" in report
    assert "pp 0: " in report and "2 in flight" in report and "1 in flight" in report


def test_a_layout_takes_a_schedule_by_name_and_refuses_a_wrong_one() -> None:
    assert Layout(pp=2, schedule="gpipe").schedule is PipelineScheduleType.gpipe
    with pytest.raises(ConfigurationError, match="schedule"):
        Layout(pp=2, schedule="1f1f")
