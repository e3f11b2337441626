"""The demos choose their torch threads from the CPUs free when they start, unless
``OMP_NUM_THREADS`` says otherwise; nothing forces a fixed number."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "src" / "examples" / "free_cpus.py"
DEMOS = ["run", "moe", "sft", "dpo", "two-stage-kl", "grpo"]


def _free_cpus():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("free_cpus", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.free_cpus


@pytest.mark.parametrize(
    ("cpus", "load", "threads"),
    [(2, 21.0, 1), (2, 0.1, 2), (8, 3.6, 4), (8, 0.4, 8), (1, 0.0, 1), (16, 99.0, 1)],
)
def test_threads_are_the_cpus_left_by_the_load(cpus: int, load: float, threads: int) -> None:
    assert _free_cpus()(cpus, load) == threads


def test_the_script_prints_a_thread_count_this_machine_allows() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, check=True)
    assert 1 <= int(out.stdout) <= (os.cpu_count() or 1)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize("target", DEMOS)
def test_each_demo_takes_the_free_cpus_unless_told(target: str) -> None:
    def dry_run(**env: str) -> str:
        environ = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        result = subprocess.run(
            ["make", "-n", target], cwd=REPO, env={**environ, **env},
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        return next(line for line in result.stdout.splitlines() if "src/examples/" in line)

    line = dry_run()
    assert "${OMP_NUM_THREADS:-$(" in line and "src/examples/free_cpus.py" in line, line
    assert "OMP_NUM_THREADS=$threads" in line
    assert "OMP_NUM_THREADS:-2" not in (REPO / "Makefile").read_text()
