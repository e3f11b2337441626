"""TransformerTrainModule: loss normalisation, parity across ranks and splits, schedules, AC."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from testutils import assert_within_adam_reach, run_distributed_test, whole_tensors

from olmolike.config import DType
from olmolike.data import TokenTensorDataLoader
from olmolike.distributed.parallel import DataParallelConfig
from olmolike.distributed.utils import broadcast_object, get_world_size
from olmolike.exceptions import ConfigurationError
from olmolike.nn import TransformerConfig
from olmolike.optim import AdamWConfig, CosWithWarmup
from olmolike.testing import random_token_instances
from olmolike.train import Callback, Duration, Trainer, TrainerConfig
from olmolike.train.train_module import (
    ActivationCheckpointingConfig,
    TransformerTrainModuleConfig,
)

SEQ_LEN = 16
VOCAB = 64
INSTANCES_PER_BATCH = 8
STEPS = 6
LR = 1e-2


class MaskedLabelsLoader(TokenTensorDataLoader):
    """Adds labels in which some tokens are ignored, unevenly across instances and ranks.

    With uneven counts, a loss averaged per rank (instead of over the global batch) would
    differ between one and two ranks: these batches catch that.
    """

    def _iter_batches(self) -> Iterator[dict[str, Any]]:
        for batch in super()._iter_batches():
            ids = batch["input_ids"]
            labels = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
            labels = torch.where(ids % 3 == 0, torch.full_like(labels, -100), labels)
            yield {"input_ids": ids, "labels": labels}


@dataclass
class LossLog(Callback):
    losses: dict[int, float] = field(default_factory=dict)
    metrics: dict[int, dict[str, float]] = field(default_factory=dict)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.metrics[step] = dict(metrics)
        self.losses[step] = metrics["train/CE loss"]


def model_config() -> TransformerConfig:
    return TransformerConfig(
        vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_sequence_length=64
    )


def build_lm_trainer(
    save_folder: str | Path,
    *,
    microbatch_instances: int | None = None,
    init_device: str = "cpu",
    module: dict[str, Any] | None = None,
    **trainer_kwargs: Any,
) -> tuple[Trainer, LossLog]:
    world = get_world_size()
    rank_instances = INSTANCES_PER_BATCH // world
    module_config = TransformerTrainModuleConfig(
        rank_microbatch_size=(microbatch_instances or rank_instances) * SEQ_LEN,
        optim=AdamWConfig(lr=LR, weight_decay=0.1),
        max_grad_norm=1.0,
        **(module or {}),
    )
    model = model_config().build(init_device=init_device, seed=0)
    train_module = module_config.build(model)
    loader = MaskedLabelsLoader(
        random_token_instances(64, SEQ_LEN, VOCAB, seed=1),
        global_batch_size=INSTANCES_PER_BATCH * SEQ_LEN,
        seed=0,
    )
    log = LossLog()
    trainer_kwargs.setdefault("max_duration", Duration.steps(STEPS))
    config = TrainerConfig(
        save_folder=str(save_folder),
        metrics_collect_interval=1,
        device="cpu",
        callbacks={"loss_log": log},
        **trainer_kwargs,
    )
    return config.build(train_module, loader), log


def full_params(trainer: Trainer) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    model = trainer.train_module.model  # type: ignore[attr-defined]
    return [
        (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for p in model.parameters()
    ]


Report = tuple[list[float], list[torch.Tensor], list[torch.Tensor]]
"""A run's losses, final weights, and the gradients its first optimizer update applied."""


def _fit_and_report(microbatch_instances: int | None, module: dict[str, Any] | None) -> Report:
    save = broadcast_object(tempfile.mkdtemp())
    trainer, log = build_lm_trainer(
        save, microbatch_instances=microbatch_instances, module=module, no_checkpoints=True
    )
    first_grads: list[torch.Tensor] = []

    def take_first_grads(*_: Any) -> None:
        if not first_grads:
            model = trainer.train_module.model  # type: ignore[attr-defined]
            first_grads.extend(whole_tensors(model, grads=True).values())

    trainer.train_module.optim.register_step_pre_hook(take_first_grads)  # type: ignore[attr-defined]
    trainer.fit()
    return [log.losses[s] for s in sorted(log.losses)], full_params(trainer), first_grads


@pytest.fixture(scope="module")
def reference() -> Report:
    """One process, the whole rank batch in one micro-batch."""
    return _fit_and_report(None, None)


def assert_same_run(got: Report, want: Report) -> None:
    """The same losses at every step and the same gradients at the first update (an
    accumulation error, a missing 1/n or a lost micro-batch, changes both); the weights as
    close as AdamW lets runs that add up in another order be: a parameter whose gradient is
    near zero moves by up to ~lr per update in a direction rounding decides (a few of 8,192
    did, by 2.4e-5 to 2.8e-5, on one CPU model and not on another)."""
    got_losses, got_params, got_grads = got
    want_losses, want_params, want_grads = want
    assert len(got_losses) == len(want_losses) == STEPS
    torch.testing.assert_close(
        torch.tensor(got_losses), torch.tensor(want_losses), rtol=1e-5, atol=1e-6
    )
    assert len(got_grads) == len(want_grads) == len(want_params)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    assert_within_adam_reach(got_params, want_params, lr=LR, updates=STEPS)


def test_loss_falls_and_is_a_token_mean(reference: Report) -> None:
    losses, _, _ = reference
    assert losses[0] == pytest.approx(torch.log(torch.tensor(float(VOCAB))).item(), rel=0.1)
    assert losses[-1] < losses[0]


def test_four_micro_batches_match_one(reference: Report) -> None:
    assert_same_run(_fit_and_report(INSTANCES_PER_BATCH // 4, None), reference)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "dp",
    [
        {"name": "ddp"},
        {"name": "fsdp"},
        {"name": "hsdp", "num_replicas": 2},
    ],
    ids=["ddp", "fsdp", "hsdp"],
)
def test_two_ranks_match_one(dp: dict[str, Any], reference: Report) -> None:
    # Two micro-batches per rank as well: gradient sync only on the last one must still add up.
    results = run_distributed_test(
        _fit_and_report, 2, args=(2, {"dp_config": DataParallelConfig.from_dict(dp)})
    )
    for result in results:
        assert_same_run(result, reference)


def test_activation_checkpointing_changes_nothing(
    reference: Report,
) -> None:
    ac = ActivationCheckpointingConfig(mode="selected_blocks", block_interval=2)
    losses, params, _ = _fit_and_report(None, {"ac_config": ac})
    assert losses == reference[0]
    assert all(torch.equal(a, b) for a, b in zip(params, reference[1]))


def test_ac_keeps_parameter_names(tmp_path: Path) -> None:
    trainer, _ = build_lm_trainer(tmp_path, module={"ac_config": ActivationCheckpointingConfig()})
    names = set(trainer.train_module.state_dict()["model"])  # type: ignore[attr-defined]
    assert names == set(model_config().build().state_dict())


def test_a_config_file_naming_the_ac_config_by_its_old_module_still_loads() -> None:
    # Files written while ActivationCheckpointingConfig lived in train_module/transformer.py
    # name it so; the config of a train module resolves that name through the registry.
    section = {
        "_CLASS_": "olmolike.train.train_module.transformer.ActivationCheckpointingConfig",
        "mode": "selected_blocks",
        "block_interval": 2,
    }
    config = TransformerTrainModuleConfig.from_dict(
        {"rank_microbatch_size": 32, "ac_config": section}
    )
    assert config.ac_config == ActivationCheckpointingConfig(
        mode="selected_blocks", block_interval=2
    )


def test_meta_model_is_materialised_like_a_direct_build(tmp_path: Path) -> None:
    direct, _ = build_lm_trainer(tmp_path / "a")
    meta, _ = build_lm_trainer(tmp_path / "b", init_device="meta")
    for a, b in zip(full_params(direct), full_params(meta)):
        assert torch.equal(a, b)


def test_scheduler_drives_the_lr(tmp_path: Path) -> None:
    scheduler = CosWithWarmup(warmup=2, alpha_f=0.1)
    trainer, log = build_lm_trainer(tmp_path, module={"scheduler": scheduler}, no_checkpoints=True)
    trainer.fit()
    lrs = [log.metrics[s]["optim/LR (decay)"] for s in sorted(log.metrics)]
    want = [scheduler.get_lr(1e-2, step, STEPS) for step in range(1, STEPS + 1)]
    assert lrs == pytest.approx(want, rel=1e-6)
    assert lrs[0] < lrs[1] and lrs[-1] < lrs[2]


def test_scheduler_needing_the_run_length_fails_at_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A loader that cannot say how long an epoch is (like a stream): one epoch has no known
    # step count, and a cosine schedule needs one.
    monkeypatch.setattr(MaskedLabelsLoader, "total_batches", property(lambda self: None))
    with pytest.raises(ConfigurationError, match="max_duration"):
        build_lm_trainer(
            tmp_path,
            module={"scheduler": CosWithWarmup(warmup=2)},
            max_duration=Duration.epochs(1),
        )


def test_z_loss_is_recorded_and_trained(tmp_path: Path) -> None:
    def final_mean_squared_log_partition(multiplier: float) -> float:
        trainer, log = build_lm_trainer(
            tmp_path / str(multiplier),
            module={"z_loss_multiplier": multiplier},
            no_checkpoints=True,
        )
        trainer.fit()
        z = [log.metrics[s]["train/Z loss"] for s in sorted(log.metrics)]
        assert all(v > 0 for v in z)
        return z[-1] / multiplier

    # The z-loss is part of the gradient: weighting it heavily shrinks the log-partition.
    assert final_mean_squared_log_partition(1.0) < 0.75 * final_mean_squared_log_partition(1e-4)


def test_label_smoothing_is_the_reported_loss(tmp_path: Path) -> None:
    trainer, log = build_lm_trainer(
        tmp_path, module={"label_smoothing": 0.1}, max_duration=Duration.steps(1)
    )
    trainer.data_loader.reshuffle(1)
    batch = next(iter(trainer.data_loader))
    trainer.data_loader.reset()
    with torch.no_grad():
        logits = trainer.train_module.model(batch["input_ids"])  # type: ignore[attr-defined]
    want = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100, label_smoothing=0.1
    )
    trainer.fit()
    assert log.losses[1] == pytest.approx(want.item(), rel=1e-5)


def test_bf16_autocast_trains(tmp_path: Path) -> None:
    trainer, log = build_lm_trainer(
        tmp_path, module={"autocast_precision": DType.bfloat16}, no_checkpoints=True
    )
    trainer.fit()
    losses = [log.losses[s] for s in sorted(log.losses)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]


def test_grad_norm_is_recorded(reference: Report, tmp_path: Path) -> None:
    trainer, log = build_lm_trainer(tmp_path, no_checkpoints=True)
    trainer.fit()
    assert all(log.metrics[s]["optim/total grad norm"] > 0 for s in log.metrics)


def test_microbatch_must_divide_the_rank_batch(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="rank_microbatch_size"):
        build_lm_trainer(tmp_path, microbatch_instances=3)


def test_resume_is_exact(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    scheduler = CosWithWarmup(warmup=2)
    full, full_log = build_lm_trainer(tmp_path / "full", module={"scheduler": scheduler})
    full.fit()
    first, _ = build_lm_trainer(
        tmp_path / "resumed", module={"scheduler": scheduler}, hard_stop=Duration.steps(3)
    )
    first.fit()
    second, second_log = build_lm_trainer(tmp_path / "resumed", module={"scheduler": scheduler})
    second.fit()
    assert [second_log.losses[s] for s in range(4, STEPS + 1)] == [
        full_log.losses[s] for s in range(4, STEPS + 1)
    ]
    assert all(torch.equal(a, b) for a, b in zip(full_params(full), full_params(second)))

    assert not any("learning rate rises" in r.getMessage() for r in caplog.records)


def test_extending_a_decayed_run_warns_that_the_lr_rises(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    scheduler = {"scheduler": CosWithWarmup(warmup=2)}
    build_lm_trainer(tmp_path, module=scheduler)[0].fit()
    extended, log = build_lm_trainer(tmp_path, module=scheduler, max_duration=Duration.steps(12))
    extended.fit()
    warnings = [r.getMessage() for r in caplog.records if "learning rate rises" in r.getMessage()]
    assert len(warnings) == 1
    assert "from 0.001 " in warnings[0] and "step 7" in warnings[0] and "WSD" in warnings[0]
    assert next(v for k, v in log.metrics[7].items() if k.startswith("optim/LR")) > 5e-3


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_compiled_blocks_match_eager(reference: Report) -> None:
    losses, _, _ = _fit_and_report(None, {"compile_model": True, "compile_backend": "aot_eager"})
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(reference[0]), rtol=1e-5, atol=1e-6
    )
