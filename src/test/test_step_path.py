"""The rooms one training step passes through, counted on a real step (the method of
test_save_path.py, applied to ``Trainer._train_step``).

A profiler watches one step of a ``BasicTrainModule`` with metrics collected at every step (so
the step records, collects, reduces and logs its metrics), on every thread, and lists the
modules of ``src/olmolike`` in which a function runs, in order. A module is *entered* each time
the flow passes into it from another module. The trainer (``train/trainer.py``) and its two
step components (``train/step_results.py``, ``train/metrics.py``) are each entered at most
twice: the step goes out to the train module, the hooks and the components and does not bounce
back and forth between them. Counted the other way too (calls of a module's functions from
another module), the bound is the same. A step that collects nothing, loop included, calls
at most ``HOT_PATH_CALLS`` of olmolike's functions.

``pytest src/test/test_step_path.py -q -s`` prints the counts and the path.
"""

from __future__ import annotations

import itertools
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
from testutils import build_trainer

import olmolike
import olmolike.train.metric_buffer as metric_buffer
from olmolike.exceptions import ConfigurationError, MetricError
from olmolike.train import Callback, Duration, ReduceType
from olmolike.train.metric_buffer import MetricBuffer

PACKAGE = str(Path(olmolike.__file__).parent) + "/"

BOUNDED = {"train/trainer.py": 2, "train/step_results.py": 2, "train/metrics.py": 2}
"""The most times one step may enter each of these modules."""


class _Watch:
    """Records, on all threads, the module of every function called while it is on, and the
    module of its caller."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []  # (module, caller's module, function)
        self.on = False

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or not self.on:
            return
        room = _room(frame)
        if room is not None:
            self.calls.append((room, _room(frame.f_back) or "-", frame.f_code.co_qualname))

    def entries_by_flow(self) -> Counter[str]:
        """How many times the sequence of rooms passes into each room."""
        entries: Counter[str] = Counter()
        previous = None
        for room, _, _ in self.calls:
            if room != previous:
                entries[room] += 1
            previous = room
        return entries

    def calls_from_elsewhere(self) -> Counter[str]:
        return Counter(room for room, caller, _ in self.calls if room != caller)


def _room(frame: FrameType | None) -> str | None:
    if frame is None or not frame.f_code.co_filename.startswith(PACKAGE):
        return None
    return frame.f_code.co_filename[len(PACKAGE) :]


def watch_one_step(tmp_path: Path, step: int) -> _Watch:
    trainer = build_trainer(tmp_path, max_duration=Duration.steps(3), metrics_collect_interval=1)
    watch = _Watch()
    train_step = trainer._train_step

    def watched(batch: dict[str, Any]) -> None:
        if trainer.global_step != step - 1:
            return train_step(batch)
        sys.setprofile(watch)
        threading.setprofile(watch)
        watch.on = True
        try:
            return train_step(batch)
        finally:
            watch.on = False
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]

    trainer._train_step = watched  # type: ignore[method-assign]
    trainer.fit()
    return watch


def test_a_step_enters_the_trainer_and_its_step_components_at_most_twice(tmp_path: Path) -> None:
    watch = watch_one_step(tmp_path, step=2)
    by_flow, from_elsewhere = watch.entries_by_flow(), watch.calls_from_elsewhere()
    print("\n".join(f"{room} <- {caller}: {function}" for room, caller, function in watch.calls))
    for room in BOUNDED:
        print(f"{room}: entered {by_flow[room]} times, called {from_elsewhere[room]} times")
    assert from_elsewhere["train/train_module/train_module.py"] >= 1  # the scan sees the step
    assert by_flow["train/metrics.py"] >= 1  # ... and the collection reduced this step
    for room, most in BOUNDED.items():
        assert by_flow[room] <= most, (room, by_flow[room])
        assert from_elsewhere[room] <= most, (room, from_elsewhere[room])


HOT_PATH_CALLS = 40
"""The most calls of olmolike's functions in one step that collects nothing, loop included,
the model's forward excluded: 38 when written, 71 before the hot path was cut down. Each costs
~3 us with the caches cold after the step's compute, which the trainer-overhead benchmark's
small model (~9 ms a step) measures; a wall-clock test could not tell."""


@dataclass
class _WatchOneCycle(Callback):
    """Watches from the end of step ``step - 1``'s hooks to the end of step ``step``'s."""

    step: int = 3  # not the first: the end of step 1 shortens the groups' timeouts, once
    watch: _Watch = field(default_factory=_Watch)
    priority = -1000  # after every other callback
    steps: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    """This watcher's own count of steps: reading the trainer's would be a call it counts."""

    def post_step(self) -> None:
        done = next(self.steps)
        if done == self.step - 1:
            sys.setprofile(self.watch)
            self.watch.on = True
        elif done == self.step:
            self.watch.on = False
            sys.setprofile(None)


def test_a_step_that_collects_nothing_calls_few_of_olmolikes_functions(tmp_path: Path) -> None:
    cycle = _WatchOneCycle()
    trainer = build_trainer(
        tmp_path, max_duration=Duration.steps(4), callbacks={"watch": cycle}, no_checkpoints=True
    )
    trainer.fit()
    calls = [f"{room}: {function}" for room, _, function in cycle.watch.calls]
    print("\n".join(calls))
    assert any("train_batch" in call for call in calls)  # the profile saw the step
    own = [call for call in calls if not call.startswith("testing.py")]
    assert len(own) <= HOT_PATH_CALLS, f"{len(own)} calls:\n" + "\n".join(own)


def test_a_metric_is_checked_where_it_is_first_declared_not_at_every_record(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    checked: list[Any] = []
    check_choice = metric_buffer.check_choice

    def counting(value: Any, *args: Any, **kwargs: Any) -> Any:
        checked.append(value)
        return check_choice(value, *args, **kwargs)

    monkeypatch.setattr(metric_buffer, "check_choice", counting)
    buffer = MetricBuffer()
    for step in range(1, 6):
        buffer.begin_step(step)
        buffer.record(step, "loss", torch.tensor(float(step)), ReduceType.mean, namespace="train")
        buffer.record(step, "lr", 0.1, namespace="optim")
    assert checked == [ReduceType.mean, "warn", "warn"]  # the two declarations
    # A declared metric recorded otherwise is checked again, and refused if wrong.
    with pytest.raises(ConfigurationError, match="reduce_type"):
        buffer.record(6, "loss", 1.0, "typo_xyz", namespace="train")  # type: ignore[arg-type]
    with pytest.raises(MetricError, match="one reduce type"):
        buffer.record(6, "loss", 1.0, ReduceType.max, namespace="train")
    buffer.record(6, "loss", 2.0, "mean", namespace="train")  # the same choice, by its name
    collected = buffer.collect()
    assert collected.steps == [1, 2, 3, 4, 5, 6]
    assert collected.reduce_types == {"train/loss": ReduceType.mean, "optim/lr": None}
    values = collected.host_values()
    assert values[(3, "train/loss")] == 3.0 and values[(6, "train/loss")] == 2.0
    assert values[(5, "optim/lr")] == 0.1
