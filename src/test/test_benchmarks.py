"""The benchmarks still run (their --quick smoke sizes); they measure, so nothing is timed here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from testutils import patient

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("script", "expected"),
    [
        ("trainer_overhead.py", "ratio"),
        ("checkpoint_stall.py", "async blocking / sync blocking"),
        ("gpu_throughput.py", "tokens/s per device"),
        ("data_loader.py", "load / step"),
        ("generation.py", "cached >= 5x recompute"),
        ("cli_startup.py", "ratio olmolike --help / python -c pass"),
    ],
)
def test_benchmark_smoke(script: str, expected: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--quick"],
        capture_output=True,
        text=True,
        timeout=patient(280),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert expected in result.stdout
