"""GarbageCollectorCallback: automatic gc off while training, collections at fixed steps."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from testutils import build_trainer

from olmolike.exceptions import ConfigurationError
from olmolike.train import Callback, Duration, Trainer
from olmolike.train.callbacks.garbage_collector import GarbageCollectorCallback


@pytest.fixture(autouse=True)
def _gc_enabled_after() -> Iterator[None]:
    """A failing test must not leave automatic gc off for the rest of the session."""
    yield
    gc.enable()


@dataclass
class GcProbe(Callback):
    """Notes whether automatic gc is on in every step, and which steps ran a collection."""

    enabled: list[bool] = field(default_factory=list)
    collections: list[tuple[int, int]] = field(default_factory=list)
    fail_at: int | None = None

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self.collections.append((self.step, info["generation"]))

    def pre_train(self) -> None:
        gc.callbacks.append(self._on_gc)

    def pre_step(self, batch: dict[str, Any]) -> None:
        del batch
        self.enabled.append(gc.isenabled())

    def post_step(self) -> None:
        if self.step == self.fail_at:
            raise RuntimeError("boom")

    def close(self) -> None:
        gc.callbacks.remove(self._on_gc)


def fit(tmp_path: Path, probe: GcProbe, steps: int = 6, **settings: Any) -> Trainer:
    trainer = build_trainer(
        tmp_path,
        max_duration=Duration.steps(steps),
        no_checkpoints=True,
        callbacks={"gc": GarbageCollectorCallback(**settings), "probe": probe},
    )
    trainer.fit()
    return trainer


def test_automatic_gc_is_off_while_training_and_restored_after(tmp_path: Path) -> None:
    gc.enable()
    probe = GcProbe()
    fit(tmp_path, probe)
    assert probe.enabled == [False] * 6
    assert gc.isenabled()


def test_collects_the_configured_generation_every_interval(tmp_path: Path) -> None:
    probe = GcProbe()
    fit(tmp_path, probe, gc_interval=2, generation=0)
    assert probe.collections == [(2, 0), (4, 0), (6, 0)]


def test_automatic_gc_is_restored_after_an_error(tmp_path: Path) -> None:
    gc.enable()
    probe = GcProbe(fail_at=2)
    with pytest.raises(RuntimeError, match="boom"):
        fit(tmp_path, probe)
    assert probe.enabled == [False, False]
    assert gc.isenabled()


def test_gc_that_was_off_before_stays_off(tmp_path: Path) -> None:
    gc.disable()
    fit(tmp_path, GcProbe(), steps=2)
    assert not gc.isenabled()


@pytest.mark.parametrize(
    ("settings", "path"), [({"gc_interval": 0}, "gc_interval"), ({"generation": 3}, "generation")]
)
def test_rejects_impossible_settings(settings: dict[str, Any], path: str) -> None:
    with pytest.raises(ConfigurationError, match=path):
        GarbageCollectorCallback(**settings)
