"""The benchmarks still run (their --quick smoke sizes); they measure, so nothing is timed here.

Each runs under :mod:`preloaded_python`'s stand-in for ``python`` (the same script, without
importing torch again). What a benchmark starts itself is real (ranks, tracker sinks, the
interpreters whose start-up ``cli_startup.py`` measures), except the fresh processes in
which ``vs_olmo_core.py`` and ``checkpoint_io.py`` measure: ``python THIS_SCRIPT --worker``
commands, which the stand-in runs as written (their code paths are what a smoke check is
for; a fresh interpreter's figures are what ``make bench`` is for)."""

from __future__ import annotations

import importlib.util
import shlex
import subprocess
import sys
from pathlib import Path

import preloaded_python
import pytest
from testutils import patient

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"
ONE_THREAD = {"trainer_overhead.py": ["--threads=1"], "data_loader.py": ["--threads=1"]}
"""The test process's share of the cores (conftest), for benchmarks that default to more:
two torch threads per xdist worker on 2 cores spin for a core the other worker holds."""


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("script", "expected"),
    [
        ("trainer_overhead.py", "ratio"),
        ("checkpoint_stall.py", "async blocking / sync blocking"),
        ("checkpoint_io.py", "peak extra memory, load (GB)"),
        ("gpu_throughput.py", "tokens/s per device"),
        ("data_loader.py", "load / step"),
        ("generation.py", "cached >= 5x recompute"),
        ("cli_startup.py", "ratio olmolike --help / python -c pass"),
        ("parallel_layouts.py", "ratios against FSDP"),
        ("context_parallel.py", "measured / planned"),
        ("moe.py", "MoE / dense tokens/s"),
    ],
)
def test_benchmark_smoke(script: str, expected: str, tmp_path: Path) -> None:
    prelude = _preloaded_children(tmp_path) if script == "checkpoint_io.py" else []
    flags = ["--quick", *ONE_THREAD.get(script, [])]
    result = _run_benchmark(script, *flags, cwd=tmp_path, prelude=prelude)
    assert result.returncode == 0, result.stderr[-3000:]
    assert expected in result.stdout


def _run_benchmark(
    script: str, *flags: str, cwd: Path, prelude: list[str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python SCRIPT FLAGS``; with ``prelude`` (Python statements), run after it."""
    path = str(BENCHMARKS / script)
    command = [path, *flags]
    if prelude:
        code = [
            "import runpy, sys",
            f"sys.path.insert(0, {str(BENCHMARKS)!r})",  # as `python SCRIPT` does
            *prelude,
            f"sys.argv = {command!r}",
            f"runpy.run_path({path!r}, run_name='__main__')",
        ]
        command = ["-c", "\n".join(code)]
    return subprocess.run(
        [*preloaded_python.command(), *command],
        capture_output=True,
        text=True,
        timeout=patient(280),
        cwd=cwd,
    )


def _preloaded_children(folder: Path) -> list[str]:
    """A prelude after which the benchmark's ``sys.executable`` is an executable in ``folder``
    that runs the stand-in: its ``python SCRIPT`` commands run without importing torch again
    (~1 CPU s each instead of ~6)."""
    python = folder / "python"
    python.write_text(f'#!/bin/sh\nexec {shlex.join(preloaded_python.command())} "$@"\n')
    python.chmod(0o755)
    return [f"sys.executable = {str(python)!r}"]


def _run_vs_olmo_core(tmp_path: Path, *prelude: str) -> subprocess.CompletedProcess[str]:
    """vs_olmo_core.py --quick, after ``prelude`` (Python statements) has run."""
    return _run_benchmark("vs_olmo_core.py", "--quick", cwd=tmp_path, prelude=list(prelude))


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(
    importlib.util.find_spec("olmo_core") is None,
    reason="ai2-olmo-core is not installed (pip install -e '.[bench]')",
)
def test_vs_olmo_core_smoke(tmp_path: Path) -> None:
    result = _run_vs_olmo_core(tmp_path, *_preloaded_children(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    for title in ("Checkpoints, 1 rank, 1 torch thread:", "Checkpoints, 2 ranks (FSDP2, gloo)"):
        assert title in result.stdout, result.stdout[-3000:]
    assert result.stdout.count("async save: until complete") >= 2, result.stdout[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_vs_olmo_core_says_how_to_install_it(tmp_path: Path) -> None:
    # None in sys.modules: `import olmo_core` fails, find_spec finds nothing.
    result = _run_vs_olmo_core(tmp_path, "sys.modules['olmo_core'] = None")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines() == [
        "ai2-olmo-core is not installed: `pip install -e '.[bench]'` (or `pip install "
        "ai2-olmo-core==3.0.0`) to compare checkpoints against OLMo-core"
    ]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(
    importlib.util.find_spec("wandb") is None or importlib.util.find_spec("aim") is None,
    reason="needs wandb and aim (pip install -e '.[dev]')",
)
def test_trainer_overhead_runs_the_tracker_callbacks_with_discarding_sinks(tmp_path: Path) -> None:
    """--discard-tracker-metrics separates olmolike's cost for a tracker from the SDK's: the
    W&B and Aim callbacks still start their sink processes, which answer as the real ones."""
    # One round: each fit starts two sink processes (~5 CPU s each); the order of the loops
    # in a round, which a second round swaps, is test_benchmark_smoke's trainer_overhead run.
    flags = ["--quick", "--rounds=1", "--with-callbacks", "--discard-tracker-metrics"]
    flags += ONE_THREAD["trainer_overhead.py"]
    result = _run_benchmark("trainer_overhead.py", *flags, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "wandb, aim" in result.stdout  # the callbacks ran
    assert "W&B and Aim sinks discard what they receive" in result.stdout
    assert "ratio" in result.stdout


def test_discarding_sinks_answer_like_the_real_ones() -> None:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from discarding_sinks import DiscardingAimSink, DiscardingWandBSink
    finally:
        sys.path.remove(str(BENCHMARKS))
    from olmolike.train.callbacks.aim import AimSink
    from olmolike.train.callbacks.wandb import WandBSink

    for real, discarding in ((WandBSink, DiscardingWandBSink), (AimSink, DiscardingAimSink)):
        public = {name for name in vars(real) if not name.startswith("_")}
        assert public <= set(vars(discarding)), f"{discarding.__name__} lacks a method"
    info = DiscardingWandBSink({"dir": "/x"}).info()
    assert set(info) == {"id", "dir", "entity", "project"}
    assert DiscardingAimSink({}, None, None, None).start() == ("discarded", False)
