"""Async saves work with stagers that stage only once, as torch 2.11's ``DefaultStager`` does.

torch 2.11 closes a ``DefaultStager``'s copier at the end of every ``stage()``; a second stage
with it fails with ``KeyError: <class 'type'>``. olmolike stages a step ahead with the stager
the save then uses, so on an H200 with torch 2.11 every prepared async save failed. The tests
give torch 2.13 (installed here) 2.11's behaviour.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from testutils import build_trainer
from torch.distributed.checkpoint.staging import DefaultStager

from olmolike.train import Duration
from olmolike.train.callbacks import CheckpointerCallback
from olmolike.train.checkpoint import Checkpointer, CheckpointerConfig
from olmolike.train.checkpoint import checkpointer as checkpoint_module


@pytest.fixture
def single_use_stagers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    original = DefaultStager._stage

    def stage_then_close(self: DefaultStager, state_dict: object, **kwargs: object) -> object:
        staged = original(self, state_dict, **kwargs)  # type: ignore[arg-type]
        self._state_dict_stager.close()  # what torch 2.11 does here
        return staged

    monkeypatch.setattr(DefaultStager, "_stage", stage_then_close)
    checkpoint_module.stagers_are_reusable.cache_clear()
    yield
    monkeypatch.undo()  # first: a test may have replaced the probe itself
    checkpoint_module.stagers_are_reusable.cache_clear()


def async_run(folder: Path, keep: bool) -> list[int]:
    trainer = build_trainer(
        folder,
        max_duration=Duration.steps(6),
        checkpointer=CheckpointerConfig(keep_staging_buffers=keep),
        callbacks={"checkpointer": CheckpointerCallback(save_async=True, save_interval=2)},
    )
    trainer.fit()
    return [step for step, _ in Checkpointer.find_checkpoints(folder)]


def test_the_probe_tells_single_use_stagers(single_use_stagers: None) -> None:
    assert checkpoint_module.stagers_are_reusable() is False


def test_the_pinned_torchs_stagers_are_reusable() -> None:
    # torch 2.13 (the version the project pins) keeps a stager's copier until close().
    checkpoint_module.stagers_are_reusable.cache_clear()
    assert checkpoint_module.stagers_are_reusable() is True


@pytest.mark.parametrize("keep", [False, True], ids=["freed", "kept"])
def test_prepared_async_saves_complete_with_single_use_stagers(
    tmp_path: Path, single_use_stagers: None, keep: bool
) -> None:
    assert async_run(tmp_path, keep) == [0, 2, 4, 6]


def test_without_the_probe_they_fail_as_on_torch_2_11(
    tmp_path: Path, single_use_stagers: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The failure the probe prevents: a stager that staged a step ahead is used again.
    monkeypatch.setattr(checkpoint_module, "stagers_are_reusable", lambda: True)
    with pytest.raises(Exception, match="KeyError"):
        async_run(tmp_path, keep=False)
