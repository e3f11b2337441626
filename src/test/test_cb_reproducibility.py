"""ReproducibilityCheckCallback: a saved checkpoint must give the live model's outputs."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from testutils import SEQ_LEN, VOCAB, build_trainer, full_params, run_distributed

import olmolike.train.callbacks.reproducibility_check as check_module
import olmolike.train.checkpoint.checkpointer as train_checkpoint
from olmolike.data import TokenTensorDataLoader
from olmolike.distributed.parallel import DataParallelConfig
from olmolike.distributed.utils import get_rank
from olmolike.exceptions import CheckpointError, ConfigurationError
from olmolike.nn import TransformerConfig
from olmolike.optim import AdamWConfig
from olmolike.testing import random_token_instances
from olmolike.train import Duration, Trainer, TrainerConfig
from olmolike.train.callbacks.checkpointer import CheckpointerCallback
from olmolike.train.callbacks.reproducibility_check import ReproducibilityCheckCallback
from olmolike.train.train_module import TransformerTrainModuleConfig

CHECK_LOG = "reproduces the live model"


def fit(folder: Path, check: ReproducibilityCheckCallback, *, steps: int = 4, **cp: Any) -> Any:
    trainer = build_trainer(
        folder,
        num_instances=32,
        max_duration=Duration.steps(steps),
        callbacks={
            "checkpointer": CheckpointerCallback(**{"save_interval": 2, **cp}),
            "reproducibility_check": check,
        },
    )
    trainer.fit()
    return trainer


def checked_step(message: str) -> str | None:
    """``"step2"`` for the check's "Checkpoint .../step2 reproduces ..." message, else None."""
    return message.split()[1].rsplit("/", 1)[-1] if CHECK_LOG in message else None


def checked_steps(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [step for r in caplog.records if (step := checked_step(r.getMessage()))]


def perturb_first_weight(state: dict[str, Any]) -> dict[str, Any]:
    """A copy of a train module's saved state with one model weight nudged by 1e-3."""
    model = dict(state["model"])
    name = next(iter(model))
    model[name] = model[name].detach().clone() + 1e-3
    return {**state, "model": model}


@pytest.fixture
def check_logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="olmolike.train.callbacks.reproducibility_check")
    return caplog


def test_every_save_of_a_normal_run_is_checked(
    tmp_path: Path, check_logs: pytest.LogCaptureFixture
) -> None:
    fit(tmp_path, ReproducibilityCheckCallback())
    # The pre-train save, the interval save and the final save in post_train.
    assert checked_steps(check_logs) == ["step0", "step2", "step4"]


def test_every_n_saves_checks_the_first_and_every_nth(
    tmp_path: Path, check_logs: pytest.LogCaptureFixture
) -> None:
    check = ReproducibilityCheckCallback(every_n_saves=2)
    trainer = fit(tmp_path, check, steps=3, save_interval=1)
    assert checked_steps(check_logs) == ["step0", "step2"]
    assert trainer.callbacks["reproducibility_check"].state_dict() == {"saves_seen": 4}


def test_a_tampered_checkpoint_stops_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_save = train_checkpoint.save_local

    def tampering_save(dir: Any, state: dict[str, Any], **kwargs: Any) -> None:
        tampered = perturb_first_weight(state) if "step2" in str(dir) else state
        real_save(dir, tampered, **kwargs)

    monkeypatch.setattr(train_checkpoint, "save_local", tampering_save)
    with pytest.raises(CheckpointError, match=r"step2 does not reproduce.*largest difference"):
        fit(tmp_path, ReproducibilityCheckCallback())
    assert not (tmp_path / "step4").exists()  # the run stopped at the bad checkpoint


def test_tolerances_accept_a_small_difference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, check_logs: pytest.LogCaptureFixture
) -> None:
    real_save = train_checkpoint.save_local

    def tampering_save(dir: Any, state: dict[str, Any], **kwargs: Any) -> None:
        real_save(dir, perturb_first_weight(state), **kwargs)

    monkeypatch.setattr(train_checkpoint, "save_local", tampering_save)
    fit(tmp_path, ReproducibilityCheckCallback(atol=1.0, rtol=0.1), steps=2)
    assert checked_steps(check_logs) == ["step0", "step2"]


def test_async_saves_are_checked_once_complete(
    tmp_path: Path, check_logs: pytest.LogCaptureFixture
) -> None:
    fit(tmp_path, ReproducibilityCheckCallback(), save_async=True)
    assert checked_steps(check_logs) == ["step0", "step2", "step4"]


def test_a_tampered_async_checkpoint_fails_by_the_next_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_save = train_checkpoint.save_local

    def tampering_save(dir: Any, state: dict[str, Any], **kwargs: Any) -> Any:
        tampered = perturb_first_weight(state) if "step2" in str(dir) else state
        return real_save(dir, tampered, **kwargs)

    monkeypatch.setattr(train_checkpoint, "save_local", tampering_save)
    with pytest.raises(CheckpointError, match=r"step2 does not reproduce"):
        fit(tmp_path, ReproducibilityCheckCallback(), save_async=True, steps=6)
    assert not (tmp_path / "step6").exists()


def test_an_async_checkpoint_is_checked_at_the_next_save_even_an_unchecked_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_save = train_checkpoint.save_local

    def tampering_save(dir: Any, state: dict[str, Any], **kwargs: Any) -> Any:
        tampered = perturb_first_weight(state) if "step0" in str(dir) else state
        return real_save(dir, tampered, **kwargs)

    monkeypatch.setattr(train_checkpoint, "save_local", tampering_save)
    check = ReproducibilityCheckCallback(every_n_saves=2)  # step0 is checked, step2 is not
    with pytest.raises(CheckpointError, match=r"step0 does not reproduce"):
        fit(tmp_path, check, save_async=True, steps=6)
    assert check.state_dict() == {"saves_seen": 2}  # found when step2's save began, not later


def test_a_weight_missing_from_the_load_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def load_nothing(dir: Any, model: torch.nn.Module, **kwargs: Any) -> None:
        # Loads nothing: the copy keeps the NaN it was filled with.
        del dir, model, kwargs

    monkeypatch.setattr(check_module, "load_model_and_optim_state", load_nothing)
    with pytest.raises(CheckpointError, match=r"step0 does not reproduce.*nan"):
        fit(tmp_path, ReproducibilityCheckCallback())


def test_live_model_is_left_as_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The check loads the checkpoint into the live model; a checkpoint that differs (within
    # the tolerance) shows that the live weights are put back, not the checkpoint's kept.
    reference = fit(tmp_path / "ref", ReproducibilityCheckCallback(enabled=False), steps=4)
    real_save = train_checkpoint.save_local

    def tampering_save(dir: Any, state: dict[str, Any], **kwargs: Any) -> None:
        tampered = perturb_first_weight(state) if "step2" in str(dir) else state
        real_save(dir, tampered, **kwargs)

    monkeypatch.setattr(train_checkpoint, "save_local", tampering_save)
    checked = fit(tmp_path / "checked", ReproducibilityCheckCallback(atol=1.0, rtol=0.1), steps=4)
    pairs = zip(reference.train_module.model.parameters(), checked.train_module.model.parameters())
    assert all(torch.equal(a, b) for a, b in pairs)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_batches": 0}, "num_batches"),
        ({"every_n_saves": 0}, "every_n_saves"),
        ({"atol": -1.0}, "atol"),
        ({"rtol": float("nan")}, "rtol"),
    ],
)
def test_invalid_settings_are_rejected(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigurationError, match=field):
        ReproducibilityCheckCallback(**kwargs)


def test_no_checkpoints_means_no_checks(
    tmp_path: Path, check_logs: pytest.LogCaptureFixture
) -> None:
    trainer = build_trainer(
        tmp_path,
        max_duration=Duration.steps(2),
        no_checkpoints=True,
        callbacks={"reproducibility_check": ReproducibilityCheckCallback()},
    )
    trainer.fit()
    assert checked_steps(check_logs) == []


def test_saves_seen_survives_a_resume(tmp_path: Path, check_logs: pytest.LogCaptureFixture) -> None:
    fit(tmp_path, ReproducibilityCheckCallback(every_n_saves=2), steps=1, save_interval=1)
    # Saves so far: step0 (checked), step1. After the resume: step2 (checked), step3.
    fit(tmp_path, ReproducibilityCheckCallback(every_n_saves=2), steps=3, save_interval=1)
    assert checked_steps(check_logs) == ["step0", "step2"]


def test_without_a_checkpointer_it_is_a_build_error(tmp_path: Path) -> None:
    trainer = build_trainer(tmp_path, max_duration=Duration.steps(1))
    del trainer.callbacks["checkpointer"]
    with pytest.raises(ConfigurationError, match="needs a CheckpointerCallback"):
        trainer.add_callback("reproducibility_check", ReproducibilityCheckCallback())


# -- several ranks ---------------------------------------------------------------------------
#
# Real gloo ranks, spawned by testutils.run_distributed: it kills ranks still running after its
# timeout (a hang fails the test instead of blocking it) and joins every process.

RANK_TIMEOUT = 150.0


@pytest.fixture
def one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Spawned ranks inherit this environment: one OpenMP thread each on the shared cores."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def run_two_ranks(fn: Any, *args: Any) -> list[Any]:
    """``fn(*args)`` on two ranks; every rank must return (not raise); their results."""
    outcomes = run_distributed(fn, 2, args=args, timeout=RANK_TIMEOUT)
    failures = [o for o in outcomes if o.error is not None or o.exitcode != 0]
    assert not failures, "\n".join(
        f"rank {o.rank} (exit {o.exitcode}): {o.error}" for o in failures
    )
    return [o.result for o in outcomes]


def record_checks() -> list[str]:
    """In a spawned rank: the steps whose checkpoints the check passes, as it logs them."""
    checked: list[str] = []

    class Recorder(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if step := checked_step(record.getMessage()):
                checked.append(step)

    logger = logging.getLogger(check_module.__name__)
    logger.setLevel(logging.INFO)
    logger.addHandler(Recorder())
    return checked


def tamper_with_saves_of(step: str) -> None:
    """In a spawned rank: from now on, the model state saved at ``step`` is off by 1e-3."""
    real_save = train_checkpoint.save_local

    def tampering_save(dir: Any, state: dict[str, Any], **kwargs: Any) -> None:
        real_save(dir, perturb_first_weight(state) if step in str(dir) else state, **kwargs)

    train_checkpoint.save_local = tampering_save  # type: ignore[assignment]


def fit_until_error(trainer: Trainer) -> str:
    try:
        trainer.fit()
    except CheckpointError as e:
        return str(e)
    return ""


def checked_trainer(
    folder: str, check: ReproducibilityCheckCallback, *, fsdp: bool = False, steps: int = 2
) -> Trainer:
    return build_trainer(
        folder,
        num_instances=32,
        fsdp=fsdp,
        max_duration=Duration.steps(steps),
        callbacks={
            # Synchronous, as the tampering below replaces the synchronous save.
            "checkpointer": CheckpointerCallback(save_interval=2, save_async=False),
            "reproducibility_check": check,
        },
    )


def _tampered_run(folder: str, fsdp: bool) -> tuple[list[str], str, bool]:
    """(checks passed, the error the run stopped with, whether step2's save completed).

    The step-0 checkpoint is sound and the step-2 one tampered with, so one run shows both
    a passing and a failing check.
    """
    checked = record_checks()
    tamper_with_saves_of("step2")
    error = fit_until_error(checked_trainer(folder, ReproducibilityCheckCallback(), fsdp=fsdp))
    return checked, error, (Path(folder) / "step2").is_dir()


@pytest.mark.slow
@pytest.mark.timeout(RANK_TIMEOUT + 30)
@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_every_rank_stops_at_a_tampered_checkpoint(
    tmp_path: Path, one_thread: None, fsdp: bool
) -> None:
    for checked, error, saved in run_two_ranks(_tampered_run, str(tmp_path), fsdp):
        assert checked == ["step0"]
        assert "step2 does not reproduce" in error
        assert "largest difference" in error
        assert saved  # the checkpoint is kept for inspection


def _one_rank_differs_run(folder: str) -> str:
    """Rank 1 alone gets other weights out of the step-2 load: the error each rank stops with."""
    real_load = check_module.load_model_and_optim_state

    def load_then_nudge_on_rank_1(dir: Any, model: torch.nn.Module, **kwargs: Any) -> None:
        real_load(dir, model, **kwargs)
        if get_rank() == 1 and "step2" in str(dir):
            with torch.no_grad():
                next(model.parameters()).add_(1e-3)

    check_module.load_model_and_optim_state = load_then_nudge_on_rank_1  # type: ignore[assignment]
    return fit_until_error(checked_trainer(folder, ReproducibilityCheckCallback()))


@pytest.mark.slow
@pytest.mark.timeout(RANK_TIMEOUT + 30)
def test_a_difference_on_one_rank_stops_every_rank(tmp_path: Path, one_thread: None) -> None:
    # Under DDP each rank checks its own replica. Were rank 0 to go on training while rank 1
    # raised, rank 0 would wait in the next step's collectives: the verdict is agreed first.
    errors = run_two_ranks(_one_rank_differs_run, str(tmp_path))
    assert "step2 does not reproduce" in errors[0] and "on rank(s) [1]" in errors[0]
    assert "step2 does not reproduce" in errors[1] and "largest difference" in errors[1]


def lm_trainer(folder: str, dp: DataParallelConfig, check: ReproducibilityCheckCallback) -> Trainer:
    """A Transformer sharded by TransformerTrainModule itself (apply_fsdp, mixed precision)."""
    model = TransformerConfig(
        vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_sequence_length=64
    ).build(seed=0)
    train_module = TransformerTrainModuleConfig(
        rank_microbatch_size=4 * SEQ_LEN, optim=AdamWConfig(lr=1e-2), dp_config=dp
    ).build(model)
    loader = TokenTensorDataLoader(
        random_token_instances(32, SEQ_LEN, VOCAB, seed=1),
        global_batch_size=8 * SEQ_LEN,
        seed=0,
    )
    config = TrainerConfig(
        save_folder=folder,
        max_duration=Duration.steps(4),
        device="cpu",
        callbacks={
            # Synchronous, as the tampering below replaces the synchronous save.
            "checkpointer": CheckpointerCallback(save_interval=2, save_async=False),
            "reproducibility_check": check,
        },
    )
    return config.build(train_module, loader)


def _sharded_run(folder: str, dp: dict[str, Any]) -> tuple[list[str], bool, bool]:
    """(checks passed in a sound run, whether it trained like an unchecked run, and whether a
    run whose checkpoint differs within the tolerance did too)."""
    config = DataParallelConfig.from_dict(dp)
    checked = record_checks()
    sound = lm_trainer(f"{folder}/sound", config, ReproducibilityCheckCallback())
    sound.fit()
    checks_of_sound_run = list(checked)
    unchecked = lm_trainer(
        f"{folder}/unchecked", config, ReproducibilityCheckCallback(enabled=False)
    )
    unchecked.fit()
    # Loads weights other than the live ones: only a faithful restore trains on unchanged.
    tamper_with_saves_of("step2")
    tolerant = lm_trainer(f"{folder}/tolerant", config, ReproducibilityCheckCallback(atol=1.0))
    tolerant.fit()
    want = full_params(unchecked)

    def same(trainer: Trainer) -> bool:
        return all(torch.equal(a, b) for a, b in zip(full_params(trainer), want, strict=True))

    return checks_of_sound_run, same(sound), same(tolerant)


@pytest.mark.slow
@pytest.mark.timeout(RANK_TIMEOUT + 30)
@pytest.mark.parametrize(
    "dp",
    [
        {"name": "fsdp", "param_dtype": "bfloat16"},
        {"name": "hsdp", "num_replicas": 2},
    ],
    ids=["fsdp-bf16", "hsdp"],
)
def test_sharded_runs_are_checked_and_left_as_they_were(
    tmp_path: Path, one_thread: None, dp: dict[str, Any]
) -> None:
    for checks, sound_unchanged, tolerant_unchanged in run_two_ranks(
        _sharded_run, str(tmp_path), dp
    ):
        assert checks == ["step0", "step2", "step4"]  # bit for bit, under the defaults
        assert sound_unchanged
        assert tolerant_unchanged
