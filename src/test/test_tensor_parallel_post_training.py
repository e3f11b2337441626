"""SFT and DPO from experiment files under TP=2 x FSDP=2, with the layout given as dotted
overrides (``--train_module.tp_config.degree=2``): the losses equal one process's, and the
checkpoint unshards and exports to Hugging Face as one process's does. GRPO under TP=2 x FSDP=2
trains as FSDP=2 alone does (the same rollouts, losses and gradients)."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from test_train_kinds import experiment, metrics, preference_pairs
from testutils import assert_within_adam_reach, run_distributed_test, whole_tensors

from olmolike.cli import main
from olmolike.data import prepare_sft_data
from olmolike.data.prompts import PromptDataLoader, PromptRecord
from olmolike.data.sft_dataset import SFTDatasetConfig
from olmolike.data.tokenizer import ByteTokenizer
from olmolike.distributed.parallel import DataParallelConfig, DataParallelType
from olmolike.distributed.tensor_parallel import TensorParallelConfig
from olmolike.distributed.utils import broadcast_object, get_rank
from olmolike.experiment import load_experiment, train
from olmolike.nn import TransformerConfig
from olmolike.optim import AdamWConfig
from olmolike.train import Callback, Duration, TrainerConfig
from olmolike.train.train_module import TransformerTrainModuleConfig
from olmolike.train.train_module.dpo import DPOTrainModuleConfig
from olmolike.train.train_module.grpo import (
    GRPOLossConfig,
    GRPOTrainModuleConfig,
    RewardConfig,
    RewardRegistry,
    SamplingConfig,
)

SEQ = 64
GRPO_LR, GRPO_UPDATES = 1e-3, 4  # 2 steps of 2 minibatches
LAYOUT = ["--train_module.tp_config.degree=2", "--train_module.dp_config.name=fsdp"]


def _experiments(tmp_path: Path) -> dict[str, Path]:
    source = tmp_path / "sft.jsonl"
    lines = (
        json.dumps({"prompt": f"add {i}", "completion": f"{i}" * (1 + i % 3)}) for i in range(40)
    )
    source.write_text("\n".join(lines) + "\n")
    prepare_sft_data([source], tmp_path / "sft", sequence_length=SEQ)
    sft = TransformerTrainModuleConfig(rank_microbatch_size=SEQ, z_loss_multiplier=1e-3)
    (tmp_path / "sft_run").mkdir()
    dpo = DPOTrainModuleConfig(rank_microbatch_size=SEQ, precompute_reference_logps=True)
    (tmp_path / "dpo_run").mkdir()
    return {
        "sft": experiment(
            tmp_path / "sft_run", SFTDatasetConfig(str(tmp_path / "sft")), sft, 8 * SEQ
        ),
        "dpo": experiment(
            tmp_path / "dpo_run",
            _pairs_dataset(tmp_path),
            dpo,
            4 * 4 * SEQ,  # 4 pairs
        ),
    }


def _pairs_dataset(tmp_path: Path) -> object:
    from olmolike.data.post_training_data import PreferenceDatasetConfig

    return PreferenceDatasetConfig(str(preference_pairs(tmp_path)))


def _train_both(paths: dict[str, str], overrides: list[str], folder: str) -> None:
    for name, path in paths.items():
        save = [f"--trainer.save_folder={folder}/{name}"]  # where the metrics go
        if name == "sft":  # the checkpoint the test unshards and exports (DPO's: none read)
            save.append("--trainer.no_checkpoints=false")
        train(load_experiment(path, [*overrides, *save]))


def _unsharded_and_exported(checkpoint: Path, out: Path) -> tuple[dict, dict]:
    """The model of ``checkpoint`` by ``olmolike unshard`` and by ``olmolike export-hf``."""
    from safetensors.torch import load_file

    assert main(["unshard", str(checkpoint), str(out / "unsharded")]) == 0
    assert main(["export-hf", str(checkpoint), str(out / "hf")]) == 0
    model = torch.load(out / "unsharded" / "model.pt", weights_only=True)
    hf = {}
    for file in sorted((out / "hf").glob("*.safetensors")):
        hf.update(load_file(file))
    return model, hf


@pytest.mark.slow
def test_sft_and_dpo_train_under_tensor_parallel_with_fsdp(tmp_path: Path) -> None:
    paths = {name: str(path) for name, path in _experiments(tmp_path).items()}
    _train_both(paths, [], str(tmp_path / "one"))
    run_distributed_test(_train_both, 4, args=(paths, LAYOUT, str(tmp_path / "tp")), timeout=600)
    for name in paths:
        want, got = metrics(tmp_path / "one" / name), metrics(tmp_path / "tp" / name)
        assert [m["step"] for m in got] == [1, 2]
        for expected, actual in zip(want, got, strict=True):
            loss = "train/DPO loss" if name == "dpo" else "train/CE loss"
            want_loss, got_loss = (m["metrics"][loss] for m in (expected, actual))
            assert got_loss == pytest.approx(want_loss, abs=1e-5), (name, actual)
    # The TP x FSDP checkpoint unshards and exports to the one-process checkpoint's weights
    # (after 2 AdamW updates at the default lr, 1e-3: as close as Adam lets two layouts be).
    one = _unsharded_and_exported(tmp_path / "one" / "sft" / "step2", tmp_path / "one_out")
    tp = _unsharded_and_exported(tmp_path / "tp" / "sft" / "step2", tmp_path / "tp_out")
    for want_weights, got_weights in zip(one, tp, strict=True):
        assert want_weights
        assert_within_adam_reach(got_weights, want_weights, lr=1e-3, updates=2)


GRPO_MODEL = TransformerConfig(
    vocab_size=264, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, qk_norm=True,
    block_type="reordered_norm", max_sequence_length=24,
)  # fmt: skip
GRPO_RECORDS = [PromptRecord(f"{i}+{i % 3}=", {"answer": str(i + i % 3)}) for i in range(16)]


def _grpo(tp: int) -> dict[str, Any]:
    """Two GRPO steps on 2 data-parallel ranks (FSDP), each split over ``tp`` ranks: two
    updates per step, a KL reference, the batch reward std, a model vocabulary padded past the
    tokenizer's (264 = 258 + padding, so each TP rank holds half)."""
    registry = RewardRegistry()
    registry.register("digits", lambda completions, **_: [sum(c.isdigit() for c in s) / 4 for s in completions])  # fmt: skip
    module = GRPOTrainModuleConfig(
        rank_microbatch_size=48,
        optim=AdamWConfig(lr=GRPO_LR),
        max_grad_norm=1.0,
        loss=GRPOLossConfig(group_size=4, kl_coef=0.05, scale_rewards="batch"),  # type: ignore[arg-type]
        sampling=SamplingConfig(max_new_tokens=6, top_k=40),
        rewards=[RewardConfig("digits")],
        num_minibatches=2,
        seed=3,
        dp_config=DataParallelConfig(name=DataParallelType.fsdp),
        tp_config=TensorParallelConfig(degree=tp),
    ).build(GRPO_MODEL.build(seed=0), tokenizer=ByteTokenizer(), registry=registry)
    degrees = module.layout.degrees
    loader = PromptDataLoader(
        GRPO_RECORDS, prompts_per_rank=2, seed=1, dp_world_size=degrees.dp,
        dp_rank=degrees.dp_rank(get_rank()),
    )  # fmt: skip
    first_grads: dict[str, torch.Tensor] = {}

    def take_first_grads(*_: Any) -> None:
        # The first update's gradients (clipped): from the same weights and rollouts in both
        # layouts, so they agree up to summation order (later weights only within Adam's reach).
        if not first_grads:
            first_grads.update(whole_tensors(module.model, grads=True))

    module.optim.register_step_pre_hook(take_first_grads)
    watcher = MetricsWatcher()
    trainer = TrainerConfig(
        save_folder=broadcast_object(tempfile.mkdtemp()), metrics_collect_interval=1,
        device="cpu", no_checkpoints=True, max_duration=Duration.steps(2),
        callbacks={"log": watcher},
    ).build(module, loader)  # fmt: skip
    trainer.fit()
    return {
        "metrics": watcher.log,
        "weights": whole_tensors(module.model),
        "first_grads": first_grads,
    }


@dataclass
class MetricsWatcher(Callback):
    log: dict[int, dict[str, float]] = field(default_factory=dict)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.log[step] = dict(metrics)


@pytest.mark.slow
def test_grpo_trains_under_tensor_parallel_with_fsdp() -> None:
    """The TP groups sample their data-parallel rank's completions (the same on both TP ranks,
    the same as FSDP alone samples), and losses, entropy, KL and the first update's gradients
    follow FSDP alone's (which equals one process's: test_uneven_ranks), the final weights as
    far as AdamW lets two layouts agree. Without the data-parallel seed the TP
    ranks draw different tokens (other rewards); without the vocab-parallel log-probs the
    sharded logits cannot be sliced and gathered."""
    split = run_distributed_test(_grpo, 4, args=(2,), timeout=300)[0]
    alone = run_distributed_test(_grpo, 2, args=(1,), timeout=300)[0]
    assert sorted(split["metrics"]) == sorted(alone["metrics"]) == [1, 2]
    for step, want in alone["metrics"].items():
        got = split["metrics"][step]
        for name in ("train/reward/mean", "train/completion length/mean"):
            assert got[name] == want[name], (step, name)  # the same completions
        for name in ("train/GRPO loss", "train/entropy", "train/KL", "optim/total grad norm"):
            assert got[name] == pytest.approx(want[name], abs=1e-5), (step, name)
    assert split["first_grads"].keys() == alone["first_grads"].keys() == alone["weights"].keys()
    for name, value in alone["first_grads"].items():
        torch.testing.assert_close(split["first_grads"][name], value, rtol=0, atol=1e-5, msg=name)
    assert_within_adam_reach(split["weights"], alone["weights"], lr=GRPO_LR, updates=GRPO_UPDATES)
