"""Post-training under context parallelism: SFT (masked labels, packed documents, its
evaluator), DPO and two-stage KL on CP2 equal one process; GRPO, generation and a model
without olmolike's attention refuse it, saying why.

Each run uses SGD, so the weights after a few steps compare at 1e-5 as well as every metric.
The distributed runs share one spawned group of two ranks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_tensor_parallel_post_training import _experiments, _train_both
from test_train_kinds import metrics as saved_metrics
from testutils import run_distributed_test
from torch.distributed.tensor import DTensor

from olmolike.data import (
    ByteTokenizer,
    NumpyDataLoaderConfig,
    StagedDataLoader,
    TokenTensorDataLoader,
    prepare_sft_data,
)
from olmolike.data.preference import PreferenceDataLoader, PreferencePair, encode_preference_pairs
from olmolike.data.sft_dataset import SFTDatasetConfig
from olmolike.distributed.tensor_parallel import ContextParallelConfig
from olmolike.distributed.utils import get_rank
from olmolike.exceptions import ConfigurationError
from olmolike.nn import TransformerConfig
from olmolike.nn.context_parallel import apply_context_parallel
from olmolike.nn.generation import sample
from olmolike.optim import SGDConfig
from olmolike.testing import TinyCausalLM, random_token_instances
from olmolike.train import Callback, Duration, TrainerConfig
from olmolike.train.callbacks import SFTEvaluatorCallbackConfig
from olmolike.train.train_module import TransformerTrainModuleConfig
from olmolike.train.train_module.dpo import DPOTrainModuleConfig
from olmolike.train.train_module.grpo import GRPOTrainModuleConfig
from olmolike.train.train_module.two_stage_kl import TwoStageKLTrainModuleConfig

SEQ, SFT_SEQ, STEPS = 30, 126, 3
TOK = ByteTokenizer()


@dataclass
class Log(Callback):
    metrics: dict[int, dict[str, float]] = field(default_factory=dict)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.metrics[step] = dict(metrics)


def model_config() -> TransformerConfig:
    return TransformerConfig(
        vocab_size=TOK.vocab_size, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
        max_sequence_length=128,
    )  # fmt: skip


def sft_data(root: Path) -> Path:
    """Packed SFT data (several documents per 126-token row) with a validation split."""
    lines = []
    for i in range(80):
        completion = "".join(chr(97 + (i * 7 + j) % 26) for j in range(3 + (i * 11) % 13))
        lines.append(json.dumps({"prompt": f"q{i}", "completion": completion}))
    (root / "sft.jsonl").write_text("\n".join(lines) + "\n")
    prepare_sft_data([root / "sft.jsonl"], root / "sft", sequence_length=SFT_SEQ, val_fraction=0.2)
    return root / "sft"


def pairs() -> list[PreferencePair]:
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma"]
    return [
        PreferencePair(
            prompt=f"Q{i}: ", chosen=words[i % 6] * 2, rejected=words[(i + 1) % 6], where=f"x:{i}"
        )
        for i in range(32)
    ]


def run(kind: str, save: Path, data: Path, cp: int) -> dict[str, Any]:
    """Train ``kind`` (sft, dpo, kl) for a few steps; its metrics and final weights."""
    seq = SFT_SEQ if kind == "sft" else SEQ
    common: dict[str, Any] = dict(
        rank_microbatch_size=2 * seq,
        optim=SGDConfig(lr=0.05, momentum=0.9),
        max_grad_norm=1.0,
        cp_config=ContextParallelConfig(degree=cp) if cp > 1 else None,
    )
    callbacks: dict[str, Callback] = {}
    config = {
        "sft": TransformerTrainModuleConfig(**common),
        "dpo": DPOTrainModuleConfig(beta=0.5, **common),
        "kl": TwoStageKLTrainModuleConfig(stage1_steps=1, beta=1.0, **common),
    }[kind]
    module = config.build(model_config().build(seed=0))
    degrees = module.layout.degrees  # the ranks of a context-parallel group read one batch
    ranks = dict(dp_rank=degrees.dp_rank(get_rank()), dp_world_size=degrees.dp)
    if kind == "sft":
        loader: Any = NumpyDataLoaderConfig(global_batch_size=8 * SFT_SEQ, seed=0).build(
            SFTDatasetConfig(str(data)).build(), **ranks
        )
        evaluator = SFTEvaluatorCallbackConfig(
            eval_dataset=SFTDatasetConfig(str(data), split="val"), eval_interval=STEPS,
            eval_batch_size=3,
        )  # fmt: skip
        callbacks["sft_evaluator"] = evaluator  # type: ignore[assignment]
    elif kind == "dpo":
        pair_rows = encode_preference_pairs(pairs(), TOK, SEQ)
        loader = PreferenceDataLoader(pair_rows, global_batch_size=4 * 4 * SEQ, seed=0, **ranks)
    else:
        stages = [
            TokenTensorDataLoader(
                random_token_instances(16, SEQ, 200, seed=s), global_batch_size=4 * SEQ, **ranks
            )
            for s in (1, 2)
        ]
        loader = StagedDataLoader([(stages[0], 1), (stages[1], None)])
    log = Log()
    TrainerConfig(
        save_folder=str(save), max_duration=Duration.steps(STEPS), metrics_collect_interval=1,
        device="cpu", no_checkpoints=True, callbacks={"log": log, **callbacks},
    ).build(module, loader).fit()  # fmt: skip
    params = {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in module.model.named_parameters()
    }
    return {"metrics": log.metrics, "params": params}


CP_LAYOUT = ["--train_module.cp_config.degree=2", "--train_module.dp_config.name=fsdp"]


def _context_parallel_runs(root: str, experiments: dict[str, str]) -> dict[str, Any]:
    data = Path(root) / "sft"
    runs: dict[str, Any] = {
        k: run(k, Path(root) / f"cp-{k}", data, cp=2) for k in ("sft", "dpo", "kl")
    }
    _train_both(experiments, CP_LAYOUT, f"{root}/files-cp")
    cp = ContextParallelConfig(degree=2)
    try:  # a model without olmolike's attention cannot be split
        TransformerTrainModuleConfig(rank_microbatch_size=SEQ, cp_config=cp).build(
            TinyCausalLM(vocab_size=64, d_model=16, n_layers=1, n_heads=2)
        )
    except ConfigurationError as e:
        runs["refused"] = str(e)
    return runs


@pytest.mark.slow
def test_post_training_under_context_parallelism_equals_one_process(tmp_path: Path) -> None:
    """SFT (with its evaluator's loss at the end), DPO (sequence log-probs summed over the
    ranks' shares) and two-stage KL: every metric and the weights equal one process's; SFT and
    DPO experiment files under CP2 x FSDP (dotted overrides) give one process's losses."""
    sft_data(tmp_path)
    want = {k: run(k, tmp_path / f"one-{k}", tmp_path / "sft", cp=1) for k in ("sft", "dpo", "kl")}
    assert "eval/sft/CE loss" in want["sft"]["metrics"][STEPS]
    assert "train/KL to snapshot" in want["kl"]["metrics"][STEPS]
    (tmp_path / "files").mkdir()
    experiments = {name: str(path) for name, path in _experiments(tmp_path / "files").items()}
    _train_both(experiments, [], str(tmp_path / "files-one"))
    args = (str(tmp_path), experiments)
    got = run_distributed_test(_context_parallel_runs, 2, args=args, timeout=400)
    # Experiment files with the layout as dotted overrides (the loader split by `olmolike
    # train` over the data-parallel ranks; DPO with precomputed reference log-probs).
    for name in experiments:
        loss = "train/DPO loss" if name == "dpo" else "train/CE loss"
        one, split = (saved_metrics(tmp_path / r / name) for r in ("files-one", "files-cp"))
        assert [m["step"] for m in split] == [1, 2]
        for expected, actual in zip(one, split, strict=True):
            assert actual["metrics"][loss] == pytest.approx(expected["metrics"][loss], abs=1e-5)
    for rank_runs in got:
        refusal = rank_runs["refused"]
        assert "set cp_config.degree=1" in refusal and "TinyCausalLM" in refusal, refusal
    for kind, expected in want.items():
        for rank_runs in got:
            result = rank_runs[kind]
            assert result["metrics"].keys() == expected["metrics"].keys()
            for step, metrics in expected["metrics"].items():
                assert result["metrics"][step].keys() == metrics.keys(), (kind, step)
                for name, value in metrics.items():
                    got_value = result["metrics"][step][name]
                    # relative too: a perplexity of ~176 is exp(loss), 1e-5 in it is 6e-8 in nats
                    assert got_value == pytest.approx(value, rel=1e-6, abs=1e-5), (kind, step, name)
            for name, param in expected["params"].items():
                torch.testing.assert_close(
                    result["params"][name], param, rtol=0, atol=1e-5, msg=(kind, name)
                )


def test_grpo_refuses_context_parallelism_naming_why() -> None:
    with pytest.raises(ConfigurationError) as info:
        GRPOTrainModuleConfig(rank_microbatch_size=64, cp_config=ContextParallelConfig(degree=2))
    message = str(info.value)
    assert "cp_config" in message and "KV cache" in message and "\n" not in message


def _sample_under_context_parallelism() -> str:
    model = model_config().build(seed=0)
    apply_context_parallel(model, dist.group.WORLD)
    try:
        sample(model, [[1, 2, 3]], max_new_tokens=2)
    except ValueError as e:
        return str(e)
    return "sampled"


@pytest.mark.slow
def test_generation_refuses_a_model_under_context_parallelism() -> None:
    for message in run_distributed_test(_sample_under_context_parallelism, 2):
        assert "context parallelism" in message and "\n" not in message
