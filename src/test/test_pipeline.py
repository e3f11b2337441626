"""Pipeline parallelism: stages, schedules, metrics, clipping, checkpoints across layouts.

Every pipelined run is compared with one process training the same model on the same data
(computed once per module here): losses, every metric, the gradients of every step and the
final weights. The distributed cases share two spawned groups: one of 2 ranks (PP=2 with each
schedule, stop/resume, loading a one-process checkpoint, evaluation) and one of 4 ranks
(PP=2 x FSDP=2, checkpoints moving between PPxFSDP and one process).
"""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy
import preloaded_python
import pytest
import torch
from testutils import assert_within_adam_reach, run_distributed_test

from olmolike.data import NumpyDatasetConfig, TokenTensorDataLoader
from olmolike.distributed.parallel import DataParallelConfig
from olmolike.distributed.pipeline import PipelineParallelConfig, split_layers
from olmolike.distributed.tensor_parallel import TensorParallelConfig
from olmolike.distributed.utils import broadcast_object, get_rank
from olmolike.exceptions import ConfigurationError
from olmolike.nn import TransformerConfig
from olmolike.nn.transformer_stage import TransformerParts, TransformerStage
from olmolike.optim import AdamWConfig
from olmolike.testing import random_token_instances
from olmolike.train import Callback, Duration, TrainerConfig
from olmolike.train.callbacks import CheckpointerCallback, LMEvaluatorCallbackConfig
from olmolike.train.train_module import (
    ActivationCheckpointingConfig,
    TransformerTrainModuleConfig,
)

SEQ_LEN = 16
VOCAB = 64
INSTANCES_PER_BATCH = 8
MICROBATCH_INSTANCES = 2
STEPS = 3
LR = 1e-2
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def model_config(**overrides: Any) -> TransformerConfig:
    return TransformerConfig(
        vocab_size=VOCAB, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2,
        max_sequence_length=SEQ_LEN, **overrides,
    )  # fmt: skip


class PackedLoader(TokenTensorDataLoader):
    """SFT-shaped batches: masked labels (unevenly, so a per-rank mean would differ) and two
    packed documents per sequence (every stage must see ``doc_ids``)."""

    def _iter_batches(self) -> Iterator[dict[str, Any]]:
        for batch in super()._iter_batches():
            ids = batch["input_ids"]
            labels = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
            labels = torch.where(ids % 3 == 0, torch.full_like(labels, -100), labels)
            doc_ids = (torch.arange(SEQ_LEN) >= SEQ_LEN // 2 + 1).long().expand_as(ids)
            yield {"input_ids": ids, "labels": labels, "doc_ids": doc_ids.contiguous()}


@dataclass
class Record(Callback):
    """Every logged metric, and every parameter's gradient before each optimizer step."""

    metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    grads: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)

    def pre_optim_step(self) -> None:
        model = self.trainer.train_module.model  # type: ignore[attr-defined]
        self.grads[self.trainer.global_step] = {
            name: _full(p.grad) for name, p in model.named_parameters() if p.grad is not None
        }

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.metrics[step] = dict(metrics)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return whole.detach().clone()


@dataclass
class Run:
    metrics: dict[int, dict[str, float]]
    grads: dict[int, dict[str, torch.Tensor]]
    params: dict[str, torch.Tensor]
    eval_loss: float | None = None
    eval_logits: torch.Tensor | None = None


def train(
    save_folder: str,
    *,
    steps: int = STEPS,
    pp: dict[str, Any] | None = None,
    dp: dict[str, Any] | None = None,
    tp: int = 1,
    lr: float = LR,
    save_interval: int | None = None,
    load_path: str | None = None,
    evaluate: bool = False,
    eval_data: str | None = None,
    dp_group_for_trainer: bool = True,
    init_device: str = "meta",
    **module: Any,
) -> Run:
    """Train the model from the same seed on the same data, on however many ranks run it."""
    module_config = TransformerTrainModuleConfig(
        rank_microbatch_size=MICROBATCH_INSTANCES * SEQ_LEN,
        optim=AdamWConfig(lr=lr, weight_decay=0.1),
        max_grad_norm=1.0,
        z_loss_multiplier=1e-4,
        pp_config=PipelineParallelConfig.from_dict(pp) if pp else None,
        dp_config=DataParallelConfig.from_dict(dp) if dp else None,
        tp_config=TensorParallelConfig(degree=tp) if tp > 1 else None,
        **module,
    )
    model = model_config().build(init_device=init_device, seed=module_config.init_seed)
    train_module = module_config.build(model)
    group = getattr(train_module, "dp_process_group", None)
    loader = PackedLoader(
        random_token_instances(64, SEQ_LEN, VOCAB, seed=1),
        global_batch_size=INSTANCES_PER_BATCH * SEQ_LEN,
        seed=0,
        dp_world_size=train_module.dp_world_size,
        dp_rank=get_rank(group),
    )
    if not dp_group_for_trainer:
        loader = PackedLoader(
            random_token_instances(64, SEQ_LEN, VOCAB, seed=1),
            global_batch_size=INSTANCES_PER_BATCH * SEQ_LEN,
            seed=0,
        )
    record = Record()
    callbacks: dict[str, Callback] = {"record": record}
    if eval_data is not None:  # the last step's metrics then include eval/lm/CE loss
        callbacks["evaluator"] = LMEvaluatorCallbackConfig(
            eval_dataset=NumpyDatasetConfig(paths=[eval_data], sequence_length=SEQ_LEN),
            eval_batch_size=2,
            eval_interval=None,
            eval_on_finish=True,
        )
    if save_interval is not None:
        callbacks["checkpointer"] = CheckpointerCallback(
            save_interval=save_interval, pre_train_checkpoint=False
        )
    trainer = TrainerConfig(
        save_folder=save_folder,
        metrics_collect_interval=1,
        device="cpu",
        callbacks=callbacks,
        max_duration=Duration.steps(steps),
        no_checkpoints=save_interval is None,
        load_path=load_path,
    ).build(train_module, loader, dp_process_group=group if dp_group_for_trainer else None)
    trainer.fit()
    params = {n: _full(p) for n, p in train_module.model.state_dict().items()}
    run = Run(record.metrics, record.grads, params)
    if evaluate:  # one token short of the training shape (a new micro-batch shape)
        ids = random_token_instances(4, SEQ_LEN - 1, VOCAB, seed=7)
        labels = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
        run.eval_loss = float(train_module.eval_batch({"input_ids": ids}, labels))
        run.eval_logits = _full(train_module.eval_batch({"input_ids": ids}))
    return run


def _without_eval(run: Run) -> Run:
    """``run`` without its evaluator's metrics (for a run that had no evaluator)."""
    metrics = {
        s: {k: v for k, v in m.items() if not k.startswith("eval/")} for s, m in run.metrics.items()
    }
    return Run(metrics, run.grads, run.params, run.eval_loss, run.eval_logits)


def assert_same_run(got: Run, want: Run, steps: range | None = None, *, lr: float = LR) -> None:
    """Same metrics (names and values) and gradients, within 1e-5 in fp32; the weights after
    the run's AdamW updates at ``lr`` within what Adam can move them apart (an element whose
    gradient is near zero moves by up to ~lr per update, in a direction the layout's summation
    order decides: ``testutils.assert_within_adam_reach``)."""
    steps = steps or range(1, STEPS + 1)
    assert sorted(got.metrics) == list(steps)
    for step in steps:
        assert got.metrics[step].keys() == want.metrics[step].keys()
        for name, value in got.metrics[step].items():
            assert value == pytest.approx(want.metrics[step][name], rel=1e-5), (step, name)
        for name, grad in got.grads[step].items():
            torch.testing.assert_close(grad, want.grads[step][name], rtol=1e-5, atol=1e-6)
    want_params = {name: want.params[name] for name in got.params}  # a stage's share
    assert_within_adam_reach(got.params, want_params, lr=lr, updates=STEPS)


def assert_same_evaluation(got: Run, want: Run) -> None:
    """``eval_batch``'s loss and logits, within 1e-5."""
    assert got.eval_loss == pytest.approx(want.eval_loss, rel=1e-5)
    torch.testing.assert_close(got.eval_logits, want.eval_logits, rtol=1e-5, atol=1e-5)


def one_process_reference(lr: float = LR) -> dict[str, Any]:
    """One process: the reference run, and a checkpoint of it at step 2 to load elsewhere."""
    folder = tempfile.mkdtemp()
    eval_data = f"{tempfile.mkdtemp()}/eval.npy"
    # 7 instances: the evaluator's last batch is short (a new micro-batch shape).
    tokens = random_token_instances(7, SEQ_LEN, VOCAB, seed=5).numpy().astype(numpy.uint16)
    numpy.save(eval_data, tokens.reshape(-1))
    reference = train(folder, lr=lr, save_interval=2, evaluate=True, eval_data=eval_data)
    return {"run": reference, "checkpoint": f"{folder}/step2", "eval_data": eval_data}


@pytest.fixture(scope="module")
def single() -> dict[str, Any]:
    return one_process_reference()


# -- one process ------------------------------------------------------------------------------


def test_layers_are_balanced_over_stages() -> None:
    assert split_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert split_layers(5, 3) == [range(0, 2), range(2, 4), range(4, 5)]
    with pytest.raises(ConfigurationError, match="4 layers but the pipeline has 8 stages"):
        split_layers(4, 8)


def test_config_names_each_mistake() -> None:
    with pytest.raises(ConfigurationError, match="degree: must be >= 1"):
        PipelineParallelConfig(degree=0)
    with pytest.raises(ConfigurationError, match="use schedule=interleaved_1f1b"):
        PipelineParallelConfig(degree=2, schedule="1f1b", stages_per_rank=2)
    interleaved = PipelineParallelConfig(degree=2, schedule="interleaved_1f1b")
    assert interleaved.stage_indices(1) == [1, 3] and interleaved.num_stages == 4
    with pytest.raises(ConfigurationError, match="multiple of 2"):
        interleaved.check_microbatches(3)
    with pytest.raises(ConfigurationError, match="at least 4 micro-batches"):
        PipelineParallelConfig(degree=4).check_microbatches(3)


def test_stages_hold_the_model_under_its_own_names_and_initial_weights() -> None:
    """Stages built from a meta model and materialised one rank's worth at a time hold,
    together, exactly the unsplit model's state dict."""
    whole = model_config().build(init_device="cpu", seed=3)
    layers = split_layers(4, 3)
    merged: dict[str, torch.Tensor] = {}
    for index, span in enumerate(layers):
        meta = model_config().build(init_device="meta")
        stage = TransformerStage(meta, span, first=index == 0, last=index == len(layers) - 1)
        parts = TransformerParts([stage])
        parts.materialize("cpu", seed=3)
        assert not merged.keys() & parts.state_dict().keys()
        merged.update(parts.state_dict())
    want = whole.state_dict()
    assert parts.num_flops_per_token(SEQ_LEN) == whole.num_flops_per_token(SEQ_LEN)
    assert merged.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(merged[name], tensor), name


def test_tied_weights_are_refused_with_the_fix() -> None:
    config = TransformerTrainModuleConfig(
        rank_microbatch_size=SEQ_LEN, pp_config=PipelineParallelConfig(degree=2)
    )
    with pytest.raises(ConfigurationError, match=r"set model\.tie_weights=false"):
        config.build(model_config(tie_weights=True).build(init_device="meta"))


def test_too_few_layers_is_refused_with_the_fix() -> None:
    config = TransformerTrainModuleConfig(
        rank_microbatch_size=SEQ_LEN,
        pp_config=PipelineParallelConfig(degree=2, schedule="interleaved_1f1b", stages_per_rank=4),
    )
    with pytest.raises(
        ConfigurationError,
        match=r"lower train_module\.pp_config\.degree or train_module\.pp_config\.stages",
    ):
        config.build(model_config().build(init_device="meta"))


def test_post_training_that_cannot_pipeline_says_why() -> None:
    from olmolike.train.train_module.dpo import DPOTrainModuleConfig
    from olmolike.train.train_module.grpo import GRPOTrainModuleConfig
    from olmolike.train.train_module.two_stage_kl import TwoStageKLTrainModuleConfig

    pp = PipelineParallelConfig(degree=2)
    with pytest.raises(ConfigurationError, match="rollouts through a pipeline are not supp"):
        GRPOTrainModuleConfig(rank_microbatch_size=SEQ_LEN, pp_config=pp)
    with pytest.raises(ConfigurationError, match="reference model's log-probabilities"):
        DPOTrainModuleConfig(rank_microbatch_size=SEQ_LEN, pp_config=pp)
    with pytest.raises(ConfigurationError, match="frozen snapshot's logits"):
        TwoStageKLTrainModuleConfig(rank_microbatch_size=SEQ_LEN, pp_config=pp)


# -- two ranks: PP=2 ----------------------------------------------------------------------------


def _two_rank_cases(single_checkpoint: str, eval_data: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # Variations that change nothing: activation checkpointing, a model built on a device.
    variations: dict[str, dict[str, Any]] = {
        "gpipe": {"ac_config": ActivationCheckpointingConfig()},
        "interleaved_1f1b": {"init_device": "cpu"},
    }
    for schedule in SCHEDULES:
        pp = {"degree": 2, "schedule": schedule}
        folder = broadcast_object(tempfile.mkdtemp())
        varied = variations.get(schedule, {})
        out[schedule] = train(folder, pp=pp, evaluate=True, eval_data=eval_data, **varied)
    pp = {"degree": 2, "schedule": "1f1b"}
    # Stop after step 2 (a checkpoint), then resume in a new trainer to the end.
    folder = broadcast_object(tempfile.mkdtemp())
    train(folder, steps=2, pp=pp, save_interval=2)
    out["resumed"] = train(folder, pp=pp)  # resumes from the folder; saves nothing more
    out["pp_checkpoint"] = f"{folder}/step2"
    try:  # a trainer over all ranks would give the two stages different batches
        train(broadcast_object(tempfile.mkdtemp()), pp=pp, dp_group_for_trainer=False)
    except ConfigurationError as e:
        out["no_dp_group"] = str(e)
    # A one-process checkpoint continued under PP.
    out["from_single"] = train(
        broadcast_object(tempfile.mkdtemp()), pp=pp, load_path=single_checkpoint
    )
    return out


@pytest.fixture(scope="module")
def two_ranks(single: dict[str, Any]) -> list[dict[str, Any]]:
    args = (single["checkpoint"], single["eval_data"])
    return run_distributed_test(_two_rank_cases, 2, args=args, timeout=300)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_each_schedule_trains_as_one_process(
    schedule: str, two_ranks: list[dict[str, Any]], single: dict[str, Any]
) -> None:
    for rank in two_ranks:
        assert_same_run(rank[schedule], single["run"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_evaluation_runs_through_the_pipeline(
    two_ranks: list[dict[str, Any]], single: dict[str, Any]
) -> None:
    want = single["run"]
    for rank in two_ranks:
        for schedule in SCHEDULES:
            assert_same_evaluation(rank[schedule], want)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_stop_and_resume_under_pp_is_exact(
    two_ranks: list[dict[str, Any]], single: dict[str, Any]
) -> None:
    for rank in two_ranks:
        assert_same_run(rank["resumed"], _without_eval(single["run"]), range(3, STEPS + 1))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_checkpoints_move_between_pp_and_one_process(
    two_ranks: list[dict[str, Any]], single: dict[str, Any]
) -> None:
    """Model and optimizer state: a one-process checkpoint continues under PP, and a PP
    checkpoint in one process, both exactly as the uninterrupted run."""
    for rank in two_ranks:
        assert_same_run(rank["from_single"], _without_eval(single["run"]), range(3, STEPS + 1))
    folder = tempfile.mkdtemp()
    continued = train(folder, load_path=two_ranks[0]["pp_checkpoint"])
    assert_same_run(continued, _without_eval(single["run"]), range(3, STEPS + 1))


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("group", "key"), [("two_ranks", "pp_checkpoint"), ("four_ranks", "pp_fsdp_checkpoint")]
)
def test_unshard_reads_a_pp_checkpoint(
    group: str, key: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    checkpoint = request.getfixturevalue(group)[0][key]
    subprocess.run(
        [
            *preloaded_python.command(),
            "-m",
            "olmolike",
            "unshard",
            checkpoint,
            str(tmp_path),
            "--safetensors",
        ],
        check=True,
    )
    (weights,) = tmp_path.glob("*.safetensors")
    unsharded = load_file(str(weights))
    assert set(unsharded) == set(model_config().build(init_device="meta").state_dict())


# -- four ranks: PP=2 x FSDP=2 -------------------------------------------------------------------


def _four_rank_cases(single_checkpoint: str, eval_data: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    fsdp = {"name": "fsdp"}
    folder = broadcast_object(tempfile.mkdtemp())
    pp = {"degree": 2, "schedule": "1f1b"}
    out["1f1b"] = train(folder, pp=pp, dp=fsdp, save_interval=2, eval_data=eval_data)
    out["pp_fsdp_checkpoint"] = f"{folder}/step2"
    # No dp_config: the data-parallel ranks replicate the stages (DDP's place under PP).
    pp = {"degree": 2, "schedule": "interleaved_1f1b"}
    out["interleaved"] = train(broadcast_object(tempfile.mkdtemp()), pp=pp)
    pp = {"degree": 2, "schedule": "gpipe"}
    folder = broadcast_object(tempfile.mkdtemp())
    out["from_single"] = train(folder, pp=pp, dp=fsdp, load_path=single_checkpoint)
    return out


@pytest.fixture(scope="module")
def four_ranks(single: dict[str, Any]) -> list[dict[str, Any]]:
    args = (single["checkpoint"], single["eval_data"])
    return run_distributed_test(_four_rank_cases, 4, args=args, timeout=400)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pp_with_fsdp_trains_as_one_process(
    four_ranks: list[dict[str, Any]], single: dict[str, Any]
) -> None:
    for rank in four_ranks:
        assert_same_run(rank["1f1b"], single["run"])
        assert_same_run(rank["interleaved"], _without_eval(single["run"]))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_checkpoints_move_between_pp_fsdp_and_one_process(
    four_ranks: list[dict[str, Any]], single: dict[str, Any]
) -> None:
    for rank in four_ranks:
        assert_same_run(rank["from_single"], _without_eval(single["run"]), range(3, STEPS + 1))
    continued = train(tempfile.mkdtemp(), load_path=four_ranks[0]["pp_fsdp_checkpoint"])
    assert_same_run(continued, _without_eval(single["run"]), range(3, STEPS + 1))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_trainer_over_all_ranks_is_refused(two_ranks: list[dict[str, Any]]) -> None:
    # The trainer takes the train module's data-parallel group by default, so the loader built
    # for every rank is what is refused, with the fix.
    for rank in two_ranks:
        assert "build the loader with dp_" in rank["no_dp_group"]
