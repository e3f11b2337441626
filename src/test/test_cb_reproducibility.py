"""ReproducibilityCheckCallback: a saved checkpoint must give the live model's outputs."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from testutils import build_trainer, run_distributed_test

import olmolike.train.checkpoint as train_checkpoint
from olmolike.exceptions import CheckpointError, ConfigurationError
from olmolike.train import Duration
from olmolike.train.callbacks.checkpointer import CheckpointerCallback
from olmolike.train.callbacks.reproducibility_check import ReproducibilityCheckCallback

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


def checked_steps(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.args[0].rsplit("/", 1)[-1] for r in caplog.records if CHECK_LOG in r.getMessage()]


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
    real_save = train_checkpoint.save_state_dict

    def tampering_save(dir: Any, state: dict[str, Any], **kwargs: Any) -> None:
        tampered = perturb_first_weight(state) if "step2" in str(dir) else state
        real_save(dir, tampered, **kwargs)

    monkeypatch.setattr(train_checkpoint, "save_state_dict", tampering_save)
    with pytest.raises(CheckpointError, match=r"step2 does not reproduce.*largest difference"):
        fit(tmp_path, ReproducibilityCheckCallback())
    assert not (tmp_path / "step4").exists()  # the run stopped at the bad checkpoint


def test_tolerances_accept_a_small_difference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, check_logs: pytest.LogCaptureFixture
) -> None:
    real_save = train_checkpoint.save_state_dict

    def tampering_save(dir: Any, state: dict[str, Any], **kwargs: Any) -> None:
        real_save(dir, perturb_first_weight(state), **kwargs)

    monkeypatch.setattr(train_checkpoint, "save_state_dict", tampering_save)
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
    real_save = train_checkpoint.async_save_state_dict

    def tampering_save(dir: Any, state: dict[str, Any], **kwargs: Any) -> Any:
        tampered = perturb_first_weight(state) if "step2" in str(dir) else state
        return real_save(dir, tampered, **kwargs)

    monkeypatch.setattr(train_checkpoint, "async_save_state_dict", tampering_save)
    with pytest.raises(CheckpointError, match=r"step2 does not reproduce"):
        fit(tmp_path, ReproducibilityCheckCallback(), save_async=True, steps=6)
    assert not (tmp_path / "step6").exists()


def test_an_async_checkpoint_is_checked_at_the_next_save_even_an_unchecked_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_save = train_checkpoint.async_save_state_dict

    def tampering_save(dir: Any, state: dict[str, Any], **kwargs: Any) -> Any:
        tampered = perturb_first_weight(state) if "step0" in str(dir) else state
        return real_save(dir, tampered, **kwargs)

    monkeypatch.setattr(train_checkpoint, "async_save_state_dict", tampering_save)
    check = ReproducibilityCheckCallback(every_n_saves=2)  # step0 is checked, step2 is not
    with pytest.raises(CheckpointError, match=r"step0 does not reproduce"):
        fit(tmp_path, check, save_async=True, steps=6)
    assert check.state_dict() == {"saves_seen": 2}  # found when step2's save began, not later


def test_a_weight_missing_from_the_load_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import olmolike.train.callbacks.reproducibility_check as module

    def load_nothing(dir: Any, model: torch.nn.Module, **kwargs: Any) -> None:
        # Loads nothing: the copy keeps the NaN it was filled with.
        del dir, model, kwargs

    monkeypatch.setattr(module, "load_model_and_optim_state", load_nothing)
    with pytest.raises(CheckpointError, match=r"step0 does not reproduce.*nan"):
        fit(tmp_path, ReproducibilityCheckCallback())


def test_live_model_is_left_as_it_was(tmp_path: Path) -> None:
    reference = fit(tmp_path / "ref", ReproducibilityCheckCallback(enabled=False), steps=2)
    checked = fit(tmp_path / "checked", ReproducibilityCheckCallback(), steps=2)
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


def _ddp_run(folder: str) -> tuple[int, str]:
    """A run whose step-2 checkpoint is tampered with: (saves seen, the error it stopped with).

    Its step-0 checkpoint is sound, so one run shows both a passing and a failing check.
    """
    real_save = train_checkpoint.save_state_dict

    def tampering_save(dir: Any, state: dict[str, Any], **kwargs: Any) -> None:
        tampered = perturb_first_weight(state) if "step2" in str(dir) else state
        real_save(dir, tampered, **kwargs)

    train_checkpoint.save_state_dict = tampering_save  # type: ignore[assignment]
    check = ReproducibilityCheckCallback()
    trainer = build_trainer(
        folder,
        num_instances=32,
        max_duration=Duration.steps(2),
        callbacks={
            "checkpointer": CheckpointerCallback(save_interval=2),
            "reproducibility_check": check,
        },
    )
    try:
        trainer.fit()
    except CheckpointError as e:
        return int(check.state_dict()["saves_seen"]), str(e)
    return int(check.state_dict()["saves_seen"]), ""


@pytest.mark.timeout(120)
def test_ddp_ranks_each_check_their_replica(tmp_path: Path) -> None:
    for saves, error in run_distributed_test(_ddp_run, 2, args=(str(tmp_path),)):
        assert saves == 2
        assert "step2 does not reproduce" in error


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
