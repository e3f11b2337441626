"""``olmolike plan``: TP/PP byte counts against hand-computed numbers, the activation formula
against torch's MemTracker, the command's output and its one-line errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

from olmolike.cli import main
from olmolike.data.numpy_data_loader import NumpyDataLoaderConfig
from olmolike.data.numpy_dataset import NumpyDatasetConfig
from olmolike.distributed.mesh import ParallelDegrees
from olmolike.distributed.parallel import DataParallelConfig, DataParallelType
from olmolike.distributed.pipeline import PipelineScheduleType, split_layers
from olmolike.experiment import ExperimentConfig
from olmolike.nn import TransformerConfig
from olmolike.nn.functional import cross_entropy_loss
from olmolike.nn.transformer_stage import TransformerStage
from olmolike.optim import AdamWConfig
from olmolike.plan.activations import activation_bytes, pipeline_actions
from olmolike.plan.memory import Layout, gathered_bytes, state_bytes
from olmolike.plan.report import plan_report, rank_memory
from olmolike.train import Duration, TrainerConfig
from olmolike.train.train_module import (
    ActivationCheckpointingConfig,
    ActivationCheckpointingMode,
    TransformerTrainModuleConfig,
)
from olmolike.train.train_module.dpo import DPOTrainModuleConfig
from olmolike.train.train_module.layout import check_data_parallel

# 1,000 parameters: embedding 80, per block 2 norms 16 + q/k/v/out 4 x 64 + MLP 3 x 48 = 416,
# final norm 8, head 80. Buffers: RoPE cos and sin, 16 positions x head_dim 4, float32.
HAND = TransformerConfig(
    vocab_size=10, d_model=8, n_layers=2, n_heads=2, mlp_hidden_size=6, max_sequence_length=16
)
ROPE = 2 * 16 * 4 * 4
TENSORS = 21  # 1 + 9 per block + 2


def test_unsharded_counts_match_the_config() -> None:
    held = state_bytes(HAND, Layout(), AdamWConfig())
    assert HAND.num_params() == 1000
    assert (held.params, held.grads, held.buffers) == (4000, 4000, ROPE)
    assert held.optim == 2 * 4000 + 4 * TENSORS  # exp_avg, exp_avg_sq, a float32 step each


def test_tensor_parallel_splits_the_matrices_it_parallelises() -> None:
    # Per block: norms 16 whole, q/k/v/out 32 each, MLP 24 each; embedding and head 40 each.
    held = state_bytes(HAND, Layout(tp=2), AdamWConfig())
    assert held.params == 4 * (40 + 2 * (16 + 128 + 72) + 8 + 40)
    assert held.optim == 2 * held.params + 4 * TENSORS


def test_fsdp_chunks_the_tensor_parallel_shard_along_dim_0() -> None:
    layout = Layout(dp_shard=2, tp=2)
    # rank 0 (tp 0, dp_shard 0): embedding (5, 8) -> 3 rows; norms 4 + 4; q/k/v (4, 8) ->
    # 2 rows; w_out (8, 4) -> 4 rows; gate/up (3, 8) -> 2 rows; w_down (8, 3) -> 4 rows.
    first = 24 + 2 * (8 + 3 * 16 + 16 + 2 * 16 + 12) + 4 + 24
    # rank 3 (tp 1, dp_shard 1): the short halves, embedding and gate/up 2 and 1 rows.
    last = 16 + 2 * (8 + 3 * 16 + 16 + 2 * 8 + 12) + 4 + 16
    assert layout.coordinates(3) == {"pp": 0, "dp_replicate": 0, "dp_shard": 1, "cp": 0, "tp": 1}
    assert state_bytes(HAND, layout, AdamWConfig(), 0).params == 4 * first
    assert state_bytes(HAND, layout, AdamWConfig(), 3).params == 4 * last


@pytest.mark.parametrize("tie", [False, True])
def test_pipeline_stages_hold_their_blocks(tie: bool) -> None:
    model = TransformerConfig(
        vocab_size=10, d_model=8, n_layers=3, n_heads=2, mlp_hidden_size=6,
        max_sequence_length=16, tie_weights=tie,
    )  # fmt: skip
    layout = Layout(pp=2, dp_replicate=2)  # ranks 0, 1: stage 0; ranks 2, 3: stage 1
    # Stage 0: embedding and blocks 0-1; stage 1: block 2, final norm, head (tied: its copy).
    assert state_bytes(model, layout, AdamWConfig(), 1).params == 4 * (80 + 2 * 416)
    assert state_bytes(model, layout, AdamWConfig(), 2).params == 4 * (416 + 8 + 80)
    assert state_bytes(model, layout, AdamWConfig(), 2).buffers == ROPE
    assert state_bytes(model, Layout(), AdamWConfig()).params == 4 * (1000 + 416 - 80 * tie)


@pytest.mark.parametrize(
    "dp,gathered",
    [
        # FSDP: the root (embedding 80, norm 8, head 80) and two of the three blocks (416 each).
        (DataParallelConfig(name=DataParallelType.fsdp), 4 * (168 + 2 * 416)),
        (DataParallelConfig(name=DataParallelType.fsdp, param_dtype="bfloat16"), 2 * 1000),
        # Without resharding after forward, every block stays gathered until backward.
        (DataParallelConfig(name=DataParallelType.fsdp, reshard_after_forward=False), 4 * 1416),
    ],
)
def test_fsdp_gathers_the_root_and_two_blocks(dp: DataParallelConfig, gathered: int) -> None:
    model = TransformerConfig(
        vocab_size=10, d_model=8, n_layers=3, n_heads=2, mlp_hidden_size=6, max_sequence_length=16
    )
    layout = Layout(dp_shard=2)
    assert gathered_bytes(model, layout, dp) == gathered
    # DDP's buckets are a second copy of the gradients.
    ddp = state_bytes(model, Layout(dp_replicate=2), AdamWConfig())
    assert gathered_bytes(model, Layout(dp_replicate=2), None) == ddp.grads


def test_activation_formula_by_hand() -> None:
    # Per token, a = 4: block 2*12*8 + 4*(16 + 16 + 24) + 4*(2 + 2) = 432; outside
    # 12*8 + 4 + 8*10 = 180; a checkpointed block keeps 32.
    model = TransformerConfig(
        vocab_size=10, d_model=8, n_layers=3, n_heads=2, mlp_hidden_size=6, max_sequence_length=16
    )
    assert activation_bytes(model, 10, 4) == 10 * (3 * 432 + 180)
    # Full AC: three inputs kept; the recompute (432 - 32, plus the logits 40) beats 180.
    full = ActivationCheckpointingConfig(mode=ActivationCheckpointingMode.full)
    assert activation_bytes(model, 10, 4, full) == 10 * (3 * 32 + 432 - 32 + 40)
    # PP 2 with 1F1B: stage 0 keeps 2 micro-batches of its 2 blocks and its output (4 * 8);
    # TP 2 halves it.
    pp, first_stage = Layout(pp=2), 10 * 2 * (2 * 432 + 32)
    assert activation_bytes(model, 10, 4, layout=pp, microbatches=2) == first_stage
    tp_pp = Layout(pp=2, tp=2)
    assert activation_bytes(model, 10, 4, layout=tp_pp, microbatches=2) == first_stage // 2


class _ActivationPeak(MemTracker):
    """MemTracker reports the snapshot at the peak of the total; this keeps the peak of its
    activation category (overriding its private per-update hook)."""

    peak = 0

    def _update_peak_stats(self, peak_state):  # type: ignore[no-untyped-def]
        super()._update_peak_stats(peak_state)
        current = self._curr_mem_snap.get(torch.device("cpu"), {})
        self.peak = max(self.peak, current.get(_MemRefType.ACT, 0))


AC_MODES = {
    "none": None,
    "full": ActivationCheckpointingConfig(mode=ActivationCheckpointingMode.full),
    "every-2": ActivationCheckpointingConfig(
        mode=ActivationCheckpointingMode.selected_blocks, block_interval=2
    ),
}


@pytest.mark.parametrize("rows,seq_len", [(1, 32), (4, 128)])
@pytest.mark.parametrize("ac", list(AC_MODES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_estimate_within_10_percent_of_mem_tracker(
    rows: int, seq_len: int, ac: str, dtype: torch.dtype
) -> None:
    config = TransformerConfig(
        vocab_size=256, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, mlp_hidden_size=192,
        max_sequence_length=128,
    )  # fmt: skip
    module = TransformerTrainModuleConfig(
        rank_microbatch_size=rows * seq_len, ac_config=AC_MODES[ac]
    )
    train_module = module.build(config.build(seed=0).to(dtype), device=torch.device("cpu"))
    input_ids = torch.randint(0, 256, (rows, seq_len), generator=torch.Generator().manual_seed(0))
    tracker = _ActivationPeak()
    tracker.track_external(train_module.model, input_ids)
    with tracker:  # the training loop's order: the logits live until after backward
        logits = train_module.model(input_ids)
        loss, _ = cross_entropy_loss(logits, input_ids, reduction="sum")
        loss.backward()
    estimate = activation_bytes(config, rows * seq_len, dtype.itemsize, AC_MODES[ac])
    assert abs(estimate - tracker.peak) <= 0.1 * tracker.peak, (estimate, tracker.peak)


class _Call(torch.nn.Module):
    """A fresh root module per call: MemTracker refuses a root module called twice."""

    def __init__(self, stage: torch.nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stage(x)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b"])
def test_pipeline_activation_estimate_within_10_percent_of_mem_tracker(schedule: str) -> None:
    """Each pipeline rank's stages, run in one process in its schedule's order (the hidden
    states and gradients the neighbouring stages would send are given), against the
    planner's estimate for that rank."""
    config = TransformerConfig(
        vocab_size=256, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, mlp_hidden_size=192,
        max_sequence_length=128,
    )  # fmt: skip
    v = 2 if schedule == "interleaved_1f1b" else 1
    layout = Layout(pp=2, stages_per_rank=v, schedule=PipelineScheduleType(schedule))
    model, n, last = config.build(seed=0), 4, layout.num_stages - 1
    layers = split_layers(config.n_layers, layout.num_stages)
    generator = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 256, (2, 32), generator=generator) for _ in range(n)]
    for pp_rank in range(layout.pp):
        stages = {
            s: TransformerStage(model, layers[s], first=s == 0, last=s == last)
            for s in layout.stage_indices(pp_rank)
        }
        sent = {s: [torch.randn(2, 32, 64, generator=generator) for _ in ids] for s in stages}
        inputs = {
            s: ids if s == 0 else [h.clone().requires_grad_() for h in sent[s]] for s in stages
        }
        tracker = _ActivationPeak()
        tracker.track_external(*stages.values(), *ids, *(h for s in stages for h in sent[s]))
        outputs: dict[int, list[torch.Tensor]] = {s: [] for s in stages}
        backwards, calls = dict.fromkeys(stages, 0), []
        with tracker:
            for s, forward in pipeline_actions(layout, n, pp_rank):
                if forward:
                    m = len(outputs[s])
                    calls.append(_Call(stages[s]))  # alive until its backward's hooks ran
                    out = calls[-1](inputs[s][m])
                    outputs[s].append(cross_entropy_loss(out, ids[m])[0] if s == last else out)
                else:  # the last stage's loss, or the gradient the next stage sent back
                    m = backwards[s]
                    outputs[s][m].backward(None if s == last else sent[s][m])
                    outputs[s][m], backwards[s] = torch.empty(0), m + 1
        estimate = activation_bytes(config, 64, 4, layout=layout, microbatches=n, pp_rank=pp_rank)
        assert abs(estimate - tracker.peak) <= 0.1 * tracker.peak, (pp_rank, estimate, tracker.peak)


def test_dpo_runs_both_sides_and_is_told_its_reference_is_not_counted() -> None:
    layout = Layout(dp_replicate=2)
    plain = TransformerTrainModuleConfig(rank_microbatch_size=64)
    dpo = DPOTrainModuleConfig(rank_microbatch_size=64)
    assert rank_memory(HAND, dpo, layout, None).activations == activation_bytes(HAND, 128, 4)
    assert rank_memory(HAND, plain, layout, None).activations == activation_bytes(HAND, 64, 4)
    assert "note: this counts the trained model only" in plan_report(HAND, dpo, layout, 80, 2)
    assert "note:" not in plan_report(HAND, plain, layout, 80, 2)


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    config = ExperimentConfig(
        run_name="plan",
        model=TransformerConfig.olmo2_1B(100_352),
        dataset=NumpyDatasetConfig(paths=[str(tmp_path / "tokens.npy")], sequence_length=4096),
        data_loader=NumpyDataLoaderConfig(global_batch_size=1024 * 4096, seed=0),
        train_module=TransformerTrainModuleConfig(
            rank_microbatch_size=2 * 4096,
            dp_config=DataParallelConfig(name=DataParallelType.fsdp, param_dtype="bfloat16"),
        ),
        trainer=TrainerConfig(save_folder=str(tmp_path / "run"), max_duration=Duration.steps(1)),
    )
    path = tmp_path / "run.yaml"
    path.write_text(config.to_yaml())
    return path


def test_plan_prints_the_layout_and_what_fits(
    config_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", str(config_file), "--gpus", "8", "--gpu-memory", "80"]) == 0
    out = capsys.readouterr().out
    assert "pp 1 x dp_replicate 1 x dp_shard 8 x cp 1 x tp 1 (fsdp on 8 GPUs)" in out
    for line in ("parameters", "gradients", "optimizer state", "activations", "block 2(8+a)d"):
        assert line in out
    table = out.split("longest seq\n")[1]
    rows = [line.split() for line in table.splitlines() if not line.lstrip().startswith("...")]
    # pp, tp, cp, act-ckpt, dp_shard
    order = [(int(r[0]), int(r[4]), int(r[3]), r[6] != "none", int(r[2])) for r in rows]
    assert rows[0][:7] == ["1", "8", "1", "1", "1", "ddp", "none"]  # cheapest: plain DDP
    assert order == sorted(order)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--gpus", "8", "--gpu-memory", "80", "--tp", "3"], "--tp 3 does not divide --gpus 8"),
        (["--gpus", "7", "--gpu-memory", "80", "--tp", "7"], "pick --tp among 1, 2, 4, 8, 16"),
        (["--gpus", "2", "--gpu-memory", "4"], "no layout of 2 GPUs fits in 4 GiB"),
        (["--gpu-memory", "80"], "needs --gpus N and --gpu-memory"),
    ],
)
def test_bad_plans_fail_with_one_line_naming_the_fix(
    config_file: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert main(["plan", str(config_file), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_plan_help_explains_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = capsys.readouterr().out
    for words in ("--gpus", "--gpu-memory", "cheapest", "activation checkpointing", "GiB"):
        assert words in out


def test_plan_takes_the_layout_from_the_config_unless_a_flag_says_otherwise(
    config_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = ["plan", str(config_file), "--gpus", "8", "--gpu-memory", "80"]
    assert main([*plan, "--train_module.tp_config.degree=2"]) == 0
    assert "pp 1 x dp_replicate 1 x dp_shard 4 x cp 1 x tp 2 (fsdp" in capsys.readouterr().out
    assert main([*plan, "--train_module.pp_config.degree=2"]) == 0
    assert "pp 2 x dp_replicate 1 x dp_shard 4 x cp 1 x tp 1 (fsdp" in capsys.readouterr().out
    assert main([*plan, "--tp", "1", "--train_module.tp_config.degree=2"]) == 0
    assert "pp 1 x dp_replicate 1 x dp_shard 8 x cp 1 x tp 1 (fsdp" in capsys.readouterr().out
    assert main([*plan, "--train_module.cp_config.degree=4"]) == 0
    assert "pp 1 x dp_replicate 1 x dp_shard 2 x cp 4 x tp 1 (fsdp" in capsys.readouterr().out
    assert main([*plan, "--cp", "2", "--train_module.cp_config.degree=4"]) == 0
    assert "pp 1 x dp_replicate 1 x dp_shard 4 x cp 2 x tp 1 (fsdp" in capsys.readouterr().out


def test_a_layout_training_refuses_is_refused_with_trainings_fix_which_plans(
    config_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """TP over DDP: training refuses it, so the planner does too, with the same line; the
    fix it names, given as an override, plans."""
    plan = ["plan", str(config_file), "--gpus", "8", "--gpu-memory", "80", "--tp", "2"]
    assert main([*plan, "--train_module.dp_config=null"]) == 2
    err = capsys.readouterr().err
    assert (
        "tensor parallelism composes with FSDP or HSDP over the data (and context-parallel) "
        "ranks, not with DDP" in err
    )
    fix = re.search(r"set (train_module\.dp_config\.name=\w+)", err)
    assert fix is not None
    assert main([*plan, "--train_module.dp_config=null", f"--{fix[1]}"]) == 0
    assert "pp 1 x dp_replicate 1 x dp_shard 4 x cp 1 x tp 2 (fsdp" in capsys.readouterr().out


def test_every_listed_layout_trains_as_labelled(
    config_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each row's data-par is a dp_config that training accepts with the row's degrees, and
    that gives exactly those degrees (HSDP's num_replicas being dp_replicate); replication
    with TP or a pipeline is HSDP with one-rank shards, counted with FSDP's buffers."""
    assert main(["plan", str(config_file), "--gpus", "8", "--gpu-memory", "80"]) == 0
    table = capsys.readouterr().out.split("longest seq\n")[1]
    rows = [line.split() for line in table.splitlines() if line.split()[:1] != ["..."]]
    assert any(row[5] == "hsdp" and row[2] == "1" and row[4] != "1" for row in rows)
    for pp, replicate, shard, cp, tp, name, *_ in rows:
        degrees = ParallelDegrees(
            pp=int(pp), dp_replicate=int(replicate), dp_shard=int(shard), cp=int(cp), tp=int(tp)
        )
        if name == "none":
            assert degrees.dp * degrees.cp == 1
            continue
        num_replicas = int(replicate) if name == "hsdp" else None
        dp = DataParallelConfig(name=DataParallelType(name), num_replicas=num_replicas)
        check_data_parallel(degrees, dp)  # training's own check
        assert dp.degrees(8, pp=int(pp), cp=int(cp), tp=int(tp)) == degrees, (name, degrees)
    model = TransformerConfig.olmo2_1B(100_352)
    module = TransformerTrainModuleConfig(rank_microbatch_size=4096)
    replicated_tp = rank_memory(model, module, Layout(dp_replicate=4, tp=2), None)
    assert replicated_tp.layout.data_parallel == "hsdp"
    assert replicated_tp.gathered < replicated_tp.state.params  # no DDP bucket copy


# -- mixtures of experts -------------------------------------------------------------------------


def test_a_mixture_of_experts_is_counted_whole_and_its_summary_says_active() -> None:
    olmoe = TransformerConfig.olmoe_1B_7B(50304)
    held = state_bytes(olmoe, Layout(dp_shard=8), AdamWConfig())
    unsharded = state_bytes(olmoe, Layout(), AdamWConfig())
    assert unsharded.params == 4 * olmoe.num_params()
    # FSDP chunks every tensor along dim 0, the 64 experts 8 per rank.
    assert held.params == pytest.approx(unsharded.params / 8, rel=1e-4)


@pytest.mark.parametrize("ac", ["none", "full"])
def test_moe_activation_estimate_within_15_percent_of_mem_tracker(ac: str) -> None:
    from olmolike.nn import MoEConfig

    config = TransformerConfig(
        vocab_size=256, d_model=64, n_layers=3, n_heads=4, mlp_hidden_size=192, qk_norm=True,
        max_sequence_length=128, moe=MoEConfig(num_experts=8, top_k=2, hidden_size=96, layers=[1, 2]),
    )  # fmt: skip
    module = TransformerTrainModuleConfig(rank_microbatch_size=4 * 128, ac_config=AC_MODES[ac])
    train_module = module.build(config.build(seed=0), device=torch.device("cpu"))
    input_ids = torch.randint(0, 256, (4, 128), generator=torch.Generator().manual_seed(0))
    tracker = _ActivationPeak()
    tracker.track_external(train_module.model, input_ids)
    with tracker:
        logits = train_module.model(input_ids)
        loss, _ = cross_entropy_loss(logits, input_ids, reduction="sum")
        loss.backward()
    estimate = activation_bytes(config, 4 * 128, 4, AC_MODES[ac])
    assert abs(estimate - tracker.peak) <= 0.15 * tracker.peak, (estimate, tracker.peak)


# -- expert parallelism ----------------------------------------------------------------------------


def test_expert_parallelism_splits_the_experts_then_fsdp_shards_them() -> None:
    olmoe = TransformerConfig.olmoe_1B_7B(50304)
    meta = olmoe.build(init_device="meta")
    experts = sum(p.numel() for n, p in meta.named_parameters() if ".experts." in n)
    rest = olmoe.num_params() - experts
    # 16 FSDP ranks, EP 8: 8 experts per EP rank, FSDP over the 2 ranks holding them; every
    # other tensor over all 16 (OLMoE's dims divide evenly, so every rank holds the same).
    for rank in (0, 7, 15):
        held = state_bytes(olmoe, Layout(dp_shard=16, ep=8), AdamWConfig(), rank)
        assert held.params == pytest.approx(4 * (experts / 16 + rest / 16), rel=1e-6)
    # EP 16 over FSDP 16: each rank 4 whole experts, the same bytes as plain FSDP 16...
    assert state_bytes(olmoe, Layout(dp_shard=16, ep=16), AdamWConfig()).params == (
        state_bytes(olmoe, Layout(dp_shard=16), AdamWConfig()).params
    )
    # ... but FSDP gathers only the rank's own experts, not all 64.
    fsdp = DataParallelConfig(name=DataParallelType.fsdp)
    plain = gathered_bytes(olmoe, Layout(dp_shard=16), fsdp)
    split = gathered_bytes(olmoe, Layout(dp_shard=16, ep=16), fsdp)
    per_block_experts = experts // olmoe.n_layers
    assert plain - split == 2 * 4 * (per_block_experts - per_block_experts // 16)


def test_expert_parallelism_counts_the_all_to_all_and_is_refused_where_training_refuses_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from olmolike.plan.memory import all_to_all_bytes

    olmoe = TransformerConfig.olmoe_1B_7B(50304)
    # Sent and received copies, the results back and received: 4 x tokens x top_k x d.
    assert all_to_all_bytes(olmoe, Layout(dp_shard=8, ep=8), 4096, 2) == 4 * 4096 * 8 * 2048 * 2
    assert all_to_all_bytes(olmoe, Layout(dp_shard=8), 4096, 2) == 0
    config = ExperimentConfig(
        run_name="plan",
        model=olmoe,
        dataset=NumpyDatasetConfig(paths=[str(tmp_path / "tokens.npy")], sequence_length=4096),
        data_loader=NumpyDataLoaderConfig(global_batch_size=64 * 4096, seed=0),
        train_module=TransformerTrainModuleConfig(
            rank_microbatch_size=4096,
            dp_config=DataParallelConfig(name=DataParallelType.fsdp, param_dtype="bfloat16"),
        ),
        trainer=TrainerConfig(save_folder=str(tmp_path / "run"), max_duration=Duration.steps(1)),
    )
    path = tmp_path / "run.yaml"
    path.write_text(config.to_yaml())
    plan = ["plan", str(path), "--gpus", "16", "--gpu-memory", "80"]
    assert main([*plan, "--train_module.ep_config.degree=8"]) == 0
    out = capsys.readouterr().out
    assert "dp_shard 16 x cp 1 x tp 1 (ep 8) (fsdp on 16 GPUs)" in out
    assert "all-to-all of one MoE layer" in out and "experts split over ep 8 ranks" in out
    # With TP the experts are whole on every tensor-parallel rank of their EP rank.
    assert main([*plan, "--ep", "4", "--tp", "2"]) == 0
    assert "dp_shard 8 x cp 1 x tp 2 (ep 4) (fsdp on 16 GPUs)" in capsys.readouterr().out
    for args, message in [
        (["--ep", "3"], "expert-parallel degree (3) must be a multiple of cp (1)"),
        (["--ep", "32"], "expert-parallel degree (32)"),
        (
            [
                "--ep",
                "2",
                "--train_module.dp_config.name=ddp",
                "--train_module.dp_config.param_dtype=null",
            ],
            "dp_config.name=fsdp",
        ),
    ]:
        assert main([*plan, *args]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
