"""Two-stage training: CE, then CE + beta * exact KL to a snapshot taken at the boundary."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from testutils import patient, run_distributed_test
from torch.distributed.tensor import DTensor

from olmolike.data import StagedDataLoader, TokenTensorDataLoader
from olmolike.distributed.parallel import DataParallelConfig, DataParallelType
from olmolike.distributed.utils import broadcast_object, get_world_size
from olmolike.exceptions import ConfigurationError
from olmolike.nn import TransformerConfig
from olmolike.optim import AdamWConfig, CosWithWarmup
from olmolike.testing import random_token_instances
from olmolike.train import Callback, Duration, Trainer, TrainerConfig
from olmolike.train.train_module import TransformerTrainModuleConfig
from olmolike.train.train_module.two_stage_kl import TwoStageKLTrainModuleConfig

SEQ, VOCAB, BATCH, STAGE1, STEPS = 16, 64, 8, 3, 7


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
    import sys

    script = Path(__file__).parents[1] / "examples" / "two_stage_kl" / "train.py"
    stages = ["--data_loader.stages.stage1.steps=3", "--data_loader.stages.stage2.steps=3",
              "--train_module.stage1_steps=3", "--trainer.max_duration.value=6"]  # fmt: skip
    out = subprocess.run(
        [sys.executable, str(script), *stages], capture_output=True, text=True, timeout=patient(280),
        env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True, cwd=tmp_path,
    )  # fmt: skip
    assert "beta=0: held-out stage-1 loss" in out.stdout
    assert "beta=1: held-out stage-1 loss" in out.stdout
