"""``CheckpointerCallback``'s OLMo-core 3.0 fields: ``save_async=None``, ``remove``,
``fixed_steps``, ``ephemeral_cooldown`` (``max_checkpoints``: see test_checkpoint.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import testutils

from olmolike.exceptions import ConfigurationError
from olmolike.train import Duration
from olmolike.train.callbacks import CheckpointerCallback, CheckpointRemovalStrategy
from olmolike.train.callbacks.checkpointer import checkpoints_to_remove
from olmolike.train.checkpoint import Checkpointer


def run(
    save: Path, steps: int, **fields: Any
) -> tuple[CheckpointerCallback, list[tuple[int, bool]]]:
    """Train ``steps`` steps (resuming from ``save`` if it holds a checkpoint) with a
    checkpointer of ``fields``; return it and the ``(step, ephemeral)`` of every save started."""
    callback = CheckpointerCallback(**fields)
    trainer = testutils.build_trainer(
        save, max_duration=Duration.steps(steps), callbacks={"checkpointer": callback}
    )
    saves: list[tuple[int, bool]] = []
    save_checkpoint = trainer.save_checkpoint

    def recording(ephemeral: bool = False) -> str:
        saves.append((trainer.global_step, ephemeral))
        return save_checkpoint(ephemeral=ephemeral)

    trainer.save_checkpoint = recording  # type: ignore[method-assign]
    trainer.fit()
    return callback, saves


def steps_in(folder: Path) -> list[int]:
    return [step for step, _ in Checkpointer.find_checkpoints(folder)]


def test_fixed_steps_add_permanent_checkpoints_without_an_interval(tmp_path: Path) -> None:
    _, saves = run(tmp_path, 6, save_interval=None, fixed_steps=[2, 3], pre_train_checkpoint=False)
    assert saves == [(2, False), (3, False), (6, False)]  # 6: the end of training
    _, saves = run(tmp_path / "b", 4, save_interval=2, fixed_steps=[3], pre_train_checkpoint=False)
    assert saves == [(2, False), (3, False), (4, False)]


def test_ephemeral_cooldown_skips_ephemeral_saves_right_after_a_checkpoint(
    tmp_path: Path,
) -> None:
    fields = {"save_interval": 4, "ephemeral_save_interval": 1, "pre_train_checkpoint": False}
    _, saves = run(tmp_path / "a", 6, ephemeral_cooldown=2, **fields)
    # 2 and 5 come less than 2 steps after the checkpoints of steps 1 and 4.
    assert saves == [(1, True), (3, True), (4, False), (6, False)]
    _, saves = run(tmp_path / "b", 3, **fields)
    assert saves == [(1, True), (2, True), (3, False)]


@pytest.mark.parametrize(
    ("remove", "left"),
    [
        (CheckpointRemovalStrategy.ephemeral_only, [0, 3, 4, 5, 7]),
        (CheckpointRemovalStrategy.all_non_permanent, [0, 5, 7]),
        (CheckpointRemovalStrategy.never, [0, 3, 4, 5, 7]),
    ],
)
def test_remove_decides_what_happens_to_an_earlier_runs_checkpoints(
    tmp_path: Path, remove: CheckpointRemovalStrategy, left: list[int]
) -> None:
    run(tmp_path, 4, save_interval=3)
    assert steps_in(tmp_path) == [0, 3, 4]
    # Resumed from step 4 with another interval: 3 and 4 are no longer permanent steps.
    run(tmp_path, 7, save_interval=5, remove=remove)
    assert steps_in(tmp_path) == left


@pytest.mark.parametrize(
    ("remove", "left"),
    [
        (CheckpointRemovalStrategy.ephemeral_only, [0, 4]),
        (CheckpointRemovalStrategy.never, [0, 3, 4]),
    ],
)
def test_never_keeps_an_earlier_runs_ephemeral_checkpoint(
    tmp_path: Path, remove: CheckpointRemovalStrategy, left: list[int]
) -> None:
    fields = {"save_interval": 4, "ephemeral_save_interval": 3}
    run(tmp_path, 3, **fields)
    # As if that run had been preempted after its ephemeral checkpoint of step 3.
    marker = tmp_path / "step3" / Checkpointer.METADATA_FNAME
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "ephemeral": True}))
    _, saves = run(tmp_path, 7, remove=remove, **fields)
    assert saves == [(4, False), (6, True), (7, False)]  # this run's own step 6 goes anyway
    assert steps_in(tmp_path) == [*left, 7]


def test_save_async_none_is_synchronous_in_one_process(tmp_path: Path) -> None:
    callback, _ = run(tmp_path, 1)
    assert callback.save_async is False
    # OLMo-core's shortcuts for subclasses
    assert callback.checkpointer is callback.trainer.checkpointer
    assert callback.save_folder == str(tmp_path) and not callback.checkpoint_pending


def _default_saves_async(save: str) -> bool | None:
    callback = CheckpointerCallback(save_interval=1)
    trainer = testutils.build_trainer(
        save, max_duration=Duration.steps(2), callbacks={"checkpointer": callback}
    )
    trainer.fit()
    return callback.save_async


def test_save_async_none_writes_in_the_background_with_a_gloo_group(tmp_path: Path) -> None:
    results = testutils.run_distributed_test(
        _default_saves_async, 2, args=(str(tmp_path),), timeout=120
    )
    assert results == [True, True]
    assert steps_in(tmp_path) == [0, 1, 2]


@pytest.mark.parametrize(
    ("fields", "path"),
    [
        ({"fixed_steps": [0, 5]}, "fixed_steps"),
        ({"ephemeral_cooldown": -1}, "ephemeral_cooldown"),
        ({"save_interval": 0}, "save_interval"),
        ({"save_interval": 4, "ephemeral_save_interval": 4}, "ephemeral_save_interval"),
    ],
)
def test_impossible_values_name_the_field(fields: dict[str, Any], path: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        CheckpointerCallback(**fields)
    assert info.value.path == path


def test_an_ephemeral_interval_needs_no_permanent_one() -> None:
    CheckpointerCallback(save_interval=None, ephemeral_save_interval=10)


def test_removal_strategies_spare_step_zero_fixed_and_interval_steps() -> None:
    found = [
        (0, "s0", False),
        (2, "s2", False),
        (3, "s3", False),
        (4, "s4", True),
        (5, "s5", False),
    ]
    strategy = CheckpointRemovalStrategy.all_non_permanent
    assert checkpoints_to_remove(strategy, found, save_interval=2, fixed_steps=[5]) == [
        "s3",
        "s4",
    ]
    assert checkpoints_to_remove(
        CheckpointRemovalStrategy.ephemeral_only, found, save_interval=2
    ) == ["s4"]
    assert checkpoints_to_remove(CheckpointRemovalStrategy.never, found, save_interval=2) == []
