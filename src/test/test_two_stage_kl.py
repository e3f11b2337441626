"""Two-stage training: CE, then CE + beta * exact KL to a snapshot taken at the boundary."""

from __future__ import annotations

import itertools
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import preloaded_python
import pytest
import torch
from testutils import patient, run_distributed_test
from torch.distributed.tensor import DTensor

from olmolike.data import (
    ByteTokenizer,
    StagedDataLoader,
    StagedDataLoaderConfig,
    TokenTensorDataLoader,
    prepare_sft_data,
)
from olmolike.data.sft_dataset import SFTDatasetConfig
from olmolike.distributed.parallel import DataParallelConfig, DataParallelType
from olmolike.distributed.utils import broadcast_object, get_world_size
from olmolike.exceptions import ConfigurationError, DataError
from olmolike.nn import TransformerConfig
from olmolike.optim import AdamWConfig, CosWithWarmup
from olmolike.testing import random_token_instances
from olmolike.train import Callback, Duration, Trainer, TrainerConfig
from olmolike.train.train_module import TransformerTrainModuleConfig
from olmolike.train.train_module.two_stage_kl import TwoStageKLTrainModuleConfig

SEQ, VOCAB, BATCH, STAGE1, STEPS = 16, 64, 8, 3, 7
BYTES = ByteTokenizer()


@dataclass
class Log(Callback):
    metrics: dict[int, dict[str, float]] = field(default_factory=dict)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.metrics[step] = dict(metrics)


def staged_loader(stage2_steps: int | None = None) -> StagedDataLoader:
    """Stage 1 and stage 2 read different data (their own mixtures), each shuffled."""
    stages = [
        TokenTensorDataLoader(
            random_token_instances(count, SEQ, VOCAB, seed=seed),
            global_batch_size=BATCH * SEQ,
            seed=seed,
        )
        for count, seed in ((16, 1), (64, 2))
    ]
    return StagedDataLoader([(stages[0], STAGE1), (stages[1], stage2_steps)])


def build(
    folder: str | Path, *, beta: float = 1.0, plain: bool = False, dp: str | None = None,
    stage2_steps: int | None = None, **trainer_kwargs: Any,
) -> tuple[Trainer, Log]:  # fmt: skip
    common: dict[str, Any] = dict(
        rank_microbatch_size=BATCH // get_world_size() * SEQ,
        optim=AdamWConfig(lr=1e-2),
        scheduler=CosWithWarmup(warmup=2),
        max_grad_norm=1.0,
        dp_config=DataParallelConfig(name=DataParallelType(dp)) if dp else None,
    )
    config = (
        TransformerTrainModuleConfig(**common)
        if plain
        else TwoStageKLTrainModuleConfig(stage1_steps=STAGE1, beta=beta, **common)
    )
    model = TransformerConfig(
        vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2, max_sequence_length=SEQ
    ).build(seed=0)
    loader = staged_loader(stage2_steps)
    log = Log()
    trainer_kwargs.setdefault("max_duration", Duration.steps(STEPS))
    trainer = TrainerConfig(
        save_folder=str(folder), metrics_collect_interval=1, device="cpu",
        callbacks={"log": log}, **trainer_kwargs,
    ).build(config.build(model), loader)  # fmt: skip
    return trainer, log


def series(log: Log, name: str) -> list[float]:
    return [log.metrics[s].get(name, float("nan")) for s in sorted(log.metrics)]


def test_stage1_is_plain_ce_and_stage2_adds_the_kl(tmp_path: Path) -> None:
    plain, plain_log = build(tmp_path / "plain", plain=True, no_checkpoints=True)
    plain.fit()
    two, log = build(tmp_path / "two", no_checkpoints=True)
    two.fit()
    ce = series(log, "train/CE loss")
    assert ce[:STAGE1] == series(plain_log, "train/CE loss")[:STAGE1]
    # One LR schedule over both stages: the same as a single run's, no restart at the boundary.
    lr = series(log, "optim/LR (decay)")
    assert lr == series(plain_log, "optim/LR (decay)") and len(set(lr)) == STEPS
    kl = series(log, "train/KL to snapshot")
    # The first stage-2 step compares the policy with itself: KL exactly 0.
    assert kl[STAGE1] == pytest.approx(0.0, abs=1e-7)
    assert all(0.0 < k < 1.0 for k in kl[STAGE1 + 1 :])
    assert ce[STAGE1 + 1 :] != series(plain_log, "train/CE loss")[STAGE1 + 1 :]
    # beta pulls towards the snapshot: less KL than beta = 0 at the end.
    free, free_log = build(tmp_path / "free", beta=0.0, no_checkpoints=True)
    free.fit()
    assert kl[-1] < series(free_log, "train/KL to snapshot")[-1]


@pytest.mark.parametrize("stop_at", [2, 5])
def test_resume_is_exact_before_and_after_the_boundary(tmp_path: Path, stop_at: int) -> None:
    full, full_log = build(tmp_path / "full")
    full.fit()
    first, _ = build(tmp_path / "resumed", hard_stop=Duration.steps(stop_at))
    first.fit()
    second, log = build(tmp_path / "resumed")
    second.fit()
    for name in ("train/CE loss", "train/KL to snapshot"):
        got, want = series(log, name), series(full_log, name)[stop_at:]
        assert [str(x) for x in got] == [str(x) for x in want]  # nan-safe equality
    for module in ("model", "reference"):
        a = full.train_module if module == "model" else full.train_module.reference
        b = second.train_module if module == "model" else second.train_module.reference
        for p, q in zip(a.model.parameters(), b.model.parameters()):
            assert torch.equal(p, q)


def test_snapshot_comes_back_from_the_checkpoint(tmp_path: Path) -> None:
    first, _ = build(tmp_path, hard_stop=Duration.steps(5))
    first.fit()
    snapshot = [p.clone() for p in first.train_module.reference.model.parameters()]
    second, _ = build(tmp_path, max_duration=Duration.steps(5))
    second.fit()  # loads step 5 and stops: no step runs, nothing is re-taken
    assert bool(second.train_module.snapshot_taken)
    for p, q in zip(snapshot, second.train_module.reference.model.parameters()):
        assert torch.equal(p, q)
    policy = list(second.train_module.model.parameters())
    assert not all(torch.equal(p, q) for p, q in zip(policy, snapshot))


def test_the_data_stages_must_match_the_training_stages(tmp_path: Path) -> None:
    build(tmp_path / "ok", stage2_steps=STEPS - STAGE1, no_checkpoints=True)
    with pytest.raises(
        ConfigurationError, match=r"3 \+ 5 steps but max_duration is 7 steps; set max_duration to 8"
    ):
        build(tmp_path / "a", stage2_steps=STEPS - STAGE1 + 1, no_checkpoints=True)
    config = TwoStageKLTrainModuleConfig(rank_microbatch_size=BATCH * SEQ, stage1_steps=STAGE1 + 1)
    model = TransformerConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2).build(seed=0)
    with pytest.raises(ConfigurationError, match=r"switches to stage 2's data after 3 steps"):
        TrainerConfig(
            save_folder=str(tmp_path / "b"), max_duration=Duration.steps(STEPS), device="cpu"
        ).build(config.build(model), staged_loader())


def _two_rank_resume(dp: str, stop_at: int) -> tuple[list[str], list[str], bool, list[float]]:
    """CE and KL series of a full run and of one stopped at ``stop_at`` and resumed (as text,
    nan-safe), whether policy and snapshot end equal, and the full run's CE then stage-2 KL."""
    root = Path(broadcast_object(tempfile.mkdtemp()))
    full, full_log = build(root / "full", dp=dp)
    full.fit()
    build(root / "resumed", dp=dp, hard_stop=Duration.steps(stop_at))[0].fit()
    second, log = build(root / "resumed", dp=dp)
    second.fit()
    names = ("train/CE loss", "train/KL to snapshot")
    want = [str(x) for name in names for x in series(full_log, name)[stop_at:]]
    got = [str(x) for name in names for x in series(log, name)]

    def weights(trainer: Trainer) -> list[torch.Tensor]:
        module = trainer.train_module
        params = [*module.model.parameters(), *module.reference.model.parameters()]
        return [p.full_tensor() if isinstance(p, DTensor) else p for p in params]

    same = all(torch.equal(a, b) for a, b in zip(weights(full), weights(second), strict=True))
    return want, got, same, figures(full_log)


def figures(log: Log) -> list[float]:
    return series(log, "train/CE loss") + series(log, "train/KL to snapshot")[STAGE1:]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("dp", "stop_at"), [("ddp", 2), ("fsdp", 5)])
def test_two_ranks_match_one_and_resume_exactly_on_either_side_of_the_boundary(
    tmp_path: Path, dp: str, stop_at: int
) -> None:
    one, one_log = build(tmp_path, no_checkpoints=True)
    one.fit()
    for want, got, same_weights, full in run_distributed_test(
        _two_rank_resume, 2, args=(dp, stop_at), timeout=280
    ):
        assert got == want and len(got) == 2 * (STEPS - stop_at)
        assert same_weights
        torch.testing.assert_close(
            torch.tensor(full), torch.tensor(figures(one_log)), rtol=1e-4, atol=1e-6
        )


@pytest.mark.timeout(300)
def test_two_stage_example_runs_and_reports_both_betas(tmp_path: Path) -> None:
    """One process (test_example_post_training.py runs it under torchrun)."""
    import os
    import subprocess

    script = Path(__file__).parents[1] / "examples" / "two_stage_kl" / "train.py"
    stages = ["--data_loader.stages.stage1.steps=3", "--data_loader.stages.stage2.steps=3",
              "--train_module.stage1_steps=3", "--trainer.max_duration.value=6"]  # fmt: skip
    out = subprocess.run(
        [*preloaded_python.command(), str(script), *stages], capture_output=True, text=True, timeout=patient(280),
        env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True, cwd=tmp_path,
    )  # fmt: skip
    assert "beta=0: held-out stage-1 loss" in out.stdout
    assert "beta=1: held-out stage-1 loss" in out.stdout


# -- a stage of SFT data -----------------------------------------------------------------------

SFT_SEQ = 128  # an example is about 45 byte tokens with the chat template


def _sft_stages(root: Path) -> StagedDataLoaderConfig:
    """Stage 1 pretraining tokens, stage 2 a packed ``prepare-data --sft`` folder, as a config
    file names them."""
    lines = [json.dumps({"prompt": f"q{i}", "completion": "ab" * (1 + i % 4)}) for i in range(40)]
    (root / "sft.jsonl").write_text("\n".join(lines) + "\n")
    prepare_sft_data([root / "sft.jsonl"], root / "sft", sequence_length=SFT_SEQ)
    tokens = np.random.default_rng(0).integers(0, 256, 4096).astype(np.uint16)
    np.save(root / "tokens.npy", tokens)
    batch = {"global_batch_size": 4 * SFT_SEQ}
    return StagedDataLoaderConfig.from_dict({"stages": {
        "pretrain": {"dataset": {"paths": [str(root / "tokens.npy")], "sequence_length": SFT_SEQ,
                                 "vocab_size": BYTES.vocab_size},
                     "data_loader": {**batch, "seed": 1}, "steps": 2},
        "sft": {"dataset": {"_CLASS_": "sft", "path": str(root / "sft")},
                "data_loader": {**batch, "seed": 2}},
    }})  # fmt: skip


def test_a_stage_takes_sft_data_by_name(tmp_path: Path) -> None:
    config = _sft_stages(tmp_path)
    assert isinstance(config.stages["sft"].dataset, SFTDatasetConfig)
    loader = config.build()
    loader.reshuffle(1)
    batches = list(itertools.islice(iter(loader), 3))
    assert "labels" not in batches[0]  # pretraining tokens: every next token is trained
    labels, docs = batches[2]["labels"], batches[2]["doc_ids"]
    assert (labels == -100).any() and (labels != -100).any()  # the prompts are masked
    assert (docs.amax(-1) > docs.amin(-1)).any()  # packed: several examples per row
    # A folder that is not prepared yet is checked when the loader is built, not before.
    missing = StagedDataLoaderConfig.from_dict(
        {"stages": {"sft": {"dataset": {"_CLASS_": "sft", "path": str(tmp_path / "none")},
                            "data_loader": {"global_batch_size": SFT_SEQ}}}}
    )  # fmt: skip
    with pytest.raises(DataError, match=r"holds no metadata\.json; make it with olmolike prepare"):
        missing.build()


def test_an_sft_stage_trains_as_sft_does(tmp_path: Path) -> None:
    """At the first step of stage 2, the CE on SFT data is exactly what the SFT train module
    computes on the same batch from the same weights (response tokens only, attention within
    each example), and the KL to the snapshot, just taken from those weights, is 0: the
    reference keeps the examples apart too."""
    config = _sft_stages(tmp_path)
    common: dict[str, Any] = dict(rank_microbatch_size=2 * SFT_SEQ, optim=AdamWConfig(lr=1e-3))
    losses, kls = [], []
    for module in (
        TwoStageKLTrainModuleConfig(stage1_steps=2, beta=1.0, **common),
        TransformerTrainModuleConfig(**common),
    ):
        model = TransformerConfig(
            vocab_size=BYTES.vocab_size, d_model=32, n_layers=1, n_heads=2,
            max_sequence_length=SFT_SEQ,
        ).build(seed=0)  # fmt: skip
        log = Log()
        TrainerConfig(
            save_folder=str(tmp_path / type(module).__name__), metrics_collect_interval=1,
            device="cpu", callbacks={"log": log}, max_duration=Duration.steps(4),
            no_checkpoints=True,
        ).build(module.build(model), config.build()).fit()  # fmt: skip
        losses.append(series(log, "train/CE loss"))
        kls.append(series(log, "train/KL to snapshot"))
    # Attention across the packed examples changes the CE by about 1e-5 relative here.
    assert losses[0][:3] == pytest.approx(losses[1][:3], rel=1e-7)
    assert kls[0][2] == pytest.approx(0.0, abs=1e-6)
