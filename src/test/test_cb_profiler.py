"""ProfilerCallback: Chrome traces of the scheduled steps, on the chosen ranks only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from testutils import build_trainer, run_distributed_test

from olmolike.exceptions import ConfigurationError
from olmolike.train import Duration
from olmolike.train.callbacks.profiler import ProfilerCallback


def fit(folder: Path, profiler: ProfilerCallback, steps: int) -> Any:
    trainer = build_trainer(
        folder,
        num_instances=16,
        instances_per_batch=2,
        max_duration=Duration.steps(steps),
        no_checkpoints=True,
        callbacks={"profiler": profiler},
    )
    trainer.fit()
    return trainer


def trace_events(path: Path) -> list[dict[str, Any]]:
    return list(json.loads(path.read_text())["traceEvents"])


def test_a_short_run_writes_a_chrome_trace_per_cycle(tmp_path: Path) -> None:
    profiler = ProfilerCallback(skip_first=1, wait=1, warmup=1, active=1, repeat=2)
    fit(tmp_path, profiler, steps=8)
    folder = tmp_path / "profiler" / "rank0"
    # Cycles end at steps 1 + 3 = 4 and 4 + 3 = 7.
    assert sorted(p.name for p in folder.iterdir()) == [
        "step4.chrome_trace.json",
        "step7.chrome_trace.json",
    ]
    assert profiler.traces == [
        str(folder / "step4.chrome_trace.json"),
        str(folder / "step7.chrome_trace.json"),
    ]
    names = {event.get("name") for event in trace_events(folder / "step4.chrome_trace.json")}
    assert any(name and name.startswith("aten::") for name in names)


def test_a_run_ending_mid_cycle_keeps_the_partial_trace(tmp_path: Path) -> None:
    fit(tmp_path, ProfilerCallback(wait=0, warmup=1, active=10), steps=4)
    assert [p.name for p in (tmp_path / "profiler" / "rank0").iterdir()] == [
        "step4.chrome_trace.json"
    ]


def test_memory_and_stack_options_reach_the_trace(tmp_path: Path) -> None:
    profiler = ProfilerCallback(wait=0, warmup=0, active=1, profile_memory=True, with_stack=True)
    fit(tmp_path, profiler, steps=1)
    events = trace_events(tmp_path / "profiler" / "rank0" / "step1.chrome_trace.json")
    assert any(event.get("name") == "[memory]" for event in events)
    assert any(event.get("cat") == "python_function" for event in events)


def test_disabled_or_other_rank_writes_nothing(tmp_path: Path) -> None:
    fit(tmp_path / "off", ProfilerCallback(wait=0, warmup=0, enabled=False), steps=2)
    fit(tmp_path / "rank1", ProfilerCallback(wait=0, warmup=0, ranks=[1]), steps=2)
    assert not (tmp_path / "off" / "profiler" / "rank0").exists()
    assert not (tmp_path / "rank1" / "profiler").exists()


def _profile_on_rank_1(folder: str) -> list[str]:
    profiler = ProfilerCallback(wait=0, warmup=0, active=1, ranks=[1])
    fit(Path(folder), profiler, steps=2)
    return profiler.traces


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_only_the_chosen_ranks_profile(tmp_path: Path) -> None:
    traces = run_distributed_test(_profile_on_rank_1, world_size=2, args=(str(tmp_path),))
    assert traces[0] == [] and len(traces[1]) == 1
    assert sorted(p.name for p in (tmp_path / "profiler").iterdir()) == ["rank1"]


@pytest.mark.parametrize(
    ("kwargs", "path"),
    [
        ({"active": 0}, "active"),
        ({"wait": -1}, "wait"),
        ({"skip_first": -1}, "skip_first"),
        ({"repeat": -1}, "repeat"),
        ({"ranks": []}, "ranks"),
        ({"ranks": [-1]}, "ranks"),
    ],
)
def test_bad_settings_are_rejected_at_construction(kwargs: dict[str, Any], path: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        ProfilerCallback(**kwargs)
    assert info.value.path == path
