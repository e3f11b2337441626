"""Tensor x pipeline parallelism: TP=2 x PP=2 on 4 gloo ranks, and TP=2 x PP=2 x FSDP=2 on 8,
train as one process.

The set-up is the pipeline tests' (:mod:`test_pipeline`: packed SFT-shaped batches, z-loss,
clipping, an evaluator), with a learning rate of 1e-3: tensor parallelism sums in another
order, and Adam turns the float noise of a gradient near its ``eps`` into up to ~1% of a
step, which this learning rate keeps under the 1e-5 the weights are compared at (the
gradients of every step are compared too). One group of 4 ranks runs 1F1B against one
process, an exact stop/resume, and checkpoints moving between TPxPP, one process (into GPipe
with activation checkpointing), PPxFSDP and TPxFSDP; one group of 8 runs interleaved 1F1B
with FSDP over the data ranks, on a model built on the CPU.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from test_pipeline import (
    STEPS,
    Run,
    _without_eval,
    assert_same_evaluation,
    assert_same_run,
    model_config,
    one_process_reference,
    train,
)
from test_train_command import config_file  # noqa: F401 (a fixture)
from testutils import assert_within_adam_reach, run_distributed_test

from olmolike.data.tokenizer import TokenizerConfig
from olmolike.distributed.utils import broadcast_object
from olmolike.experiment import load_experiment
from olmolike.train.train_module import ActivationCheckpointingConfig

LR = 1e-3
TPxPP = {"tp": 2, "lr": LR}
FULL_AC = ActivationCheckpointingConfig()


@pytest.fixture(scope="module")
def single() -> dict[str, Any]:
    return one_process_reference(LR)


def test_command_line_overrides_reach_tp_x_pp(config_file: Path) -> None:  # noqa: F811
    """``olmolike train CONFIG.yaml`` with both degrees as overrides: one mesh, pipeline
    outermost, tensor innermost, FSDP over what is left."""
    overrides = ["--train_module.tp_config.degree=2", "--train_module.pp_config.degree=2"]
    module = load_experiment(str(config_file), overrides).train_module
    assert module.parallel_degrees(4).as_dict() == dict(
        pp=2, dp_replicate=1, dp_shard=1, cp=1, tp=2
    )
    fsdp = load_experiment(str(config_file), [*overrides, "--train_module.dp_config.name=fsdp"])
    degrees = fsdp.train_module.parallel_degrees(8)
    assert degrees.as_dict() == dict(pp=2, dp_replicate=1, dp_shard=2, cp=1, tp=2)
    assert [degrees.dp_rank(rank) for rank in range(8)] == [0, 0, 1, 1] * 2


def _four_rank_cases(single_checkpoint: str, eval_data: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    one_f_one_b = {"degree": 2, "schedule": "1f1b"}
    folder = broadcast_object(tempfile.mkdtemp())
    out["1f1b"] = train(
        folder, pp=one_f_one_b, save_interval=2, evaluate=True, eval_data=eval_data, **TPxPP
    )
    out["checkpoint"] = checkpoint = f"{folder}/step2"

    def fresh() -> str:
        return str(broadcast_object(tempfile.mkdtemp()))

    # Stop at step 2, resume from its checkpoint (trainer state included) in a new trainer.
    out["resumed"] = train(fresh(), pp=one_f_one_b, load_path=checkpoint, **TPxPP)
    gpipe = {"degree": 2, "schedule": "gpipe"}
    out["from_single"] = train(
        fresh(), pp=gpipe, load_path=single_checkpoint, ac_config=FULL_AC, **TPxPP
    )
    fsdp = {"name": "fsdp"}
    out["pp_fsdp"] = train(fresh(), pp=one_f_one_b, dp=fsdp, lr=LR, load_path=checkpoint)
    out["tp_fsdp"] = train(fresh(), tp=2, dp=fsdp, lr=LR, load_path=checkpoint)
    return out


@pytest.fixture(scope="module")
def four_ranks(single: dict[str, Any]) -> list[dict[str, Any]]:
    args = (single["checkpoint"], single["eval_data"])
    return run_distributed_test(_four_rank_cases, 4, args=args, timeout=400)


def _assert_trains_and_evaluates_as(got: Run, want: Run) -> None:
    """Every step's metrics (loss, z-loss, grad norm, tokens; the evaluator's loss if both
    ran one), every gradient, the final weights, and ``eval_batch``'s loss and logits (of
    sequences one token short of a multiple of the TP degree)."""
    assert_same_run(got, want, lr=LR)
    assert_same_evaluation(got, want)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tp_x_pp_trains_and_evaluates_as_one_process(
    four_ranks: list[dict[str, Any]], single: dict[str, Any]
) -> None:
    for rank in four_ranks:
        _assert_trains_and_evaluates_as(rank["1f1b"], single["run"])


def _tp_pp_fsdp() -> Run:
    interleaved = {"degree": 2, "schedule": "interleaved_1f1b"}
    folder = broadcast_object(tempfile.mkdtemp())
    fsdp = {"name": "fsdp"}
    # A model built on the CPU (split and sharded as it is) instead of the meta device.
    return train(folder, pp=interleaved, dp=fsdp, evaluate=True, init_device="cpu", **TPxPP)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tp_x_pp_x_fsdp_trains_and_evaluates_as_one_process(single: dict[str, Any]) -> None:
    """8 ranks: ``pp (2) x dp_shard (2) x tp (2)``, two stages per pipeline rank."""
    for run in run_distributed_test(_tp_pp_fsdp, 8, timeout=400):
        _assert_trains_and_evaluates_as(run, _without_eval(single["run"]))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_stop_and_resume_under_tp_x_pp_is_exact(four_ranks: list[dict[str, Any]]) -> None:
    for rank in four_ranks:
        got, want = rank["resumed"], _without_eval(rank["1f1b"])
        assert list(got.metrics) == [STEPS] and got.metrics[STEPS] == want.metrics[STEPS]
        for name, grad in got.grads[STEPS].items():
            assert torch.equal(grad, want.grads[STEPS][name]), name
        assert got.params.keys() == want.params.keys()
        for name, param in got.params.items():
            assert torch.equal(param, want.params[name]), name


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_checkpoints_move_between_tp_x_pp_and_other_layouts(
    four_ranks: list[dict[str, Any]], single: dict[str, Any]
) -> None:
    """Model and optimizer state: one process -> TPxPP, and TPxPP -> PPxFSDP, TPxFSDP and
    one process, each continuing exactly as the uninterrupted run."""
    after = range(STEPS, STEPS + 1)
    want = _without_eval(single["run"])
    for rank in four_ranks:
        for name in ("from_single", "pp_fsdp", "tp_fsdp"):
            assert_same_run(rank[name], want, after, lr=LR)
    continued = train(tempfile.mkdtemp(), lr=LR, load_path=four_ranks[0]["checkpoint"])
    assert_same_run(continued, want, after, lr=LR)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_unshard_and_export_hf_read_a_tp_x_pp_checkpoint(
    four_ranks: list[dict[str, Any]], single: dict[str, Any], tmp_path: Path
) -> None:
    """``olmolike unshard`` and ``olmolike export-hf`` give the one-process checkpoint's
    weights from the TPxPP one."""
    from safetensors.torch import load_file

    from olmolike.cli import main

    def read(checkpoint: str, out: Path) -> tuple[dict[str, torch.Tensor], ...]:
        config = {"model": model_config().as_config_dict()}
        config["tokenizer"] = TokenizerConfig().as_config_dict()
        (Path(checkpoint).parent / "config.json").write_text(json.dumps(config))
        assert main(["unshard", checkpoint, str(out / "unsharded")]) == 0
        assert main(["export-hf", checkpoint, str(out / "hf")]) == 0
        model = torch.load(out / "unsharded" / "model.pt", weights_only=True)
        (weights,) = (out / "hf").glob("*.safetensors")
        return model, load_file(str(weights))

    got = read(four_ranks[0]["checkpoint"], tmp_path / "tpxpp")
    want = read(single["checkpoint"], tmp_path / "single")
    # Both checkpoints hold the weights after 2 AdamW updates under different layouts.
    for got_weights, want_weights in zip(got, want, strict=True):
        assert got_weights.keys() == want_weights.keys() and want_weights
        assert_within_adam_reach(got_weights, want_weights, lr=LR, updates=2)
