"""The GRPO example runs end to end, as one process and under torchrun (a few steps)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import preloaded_python
import pytest
from test_docs_results import grpo_results
from testutils import patient

SCRIPT = Path(__file__).parents[1] / "examples" / "grpo" / "train.py"


def run(out: Path, *launcher: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    steps = ["--trainer.max_duration.value=2", "--warm_up.steps=3"]
    warmup = ["--train_module.scheduler.warmup=0"]
    command = [*(launcher or preloaded_python.command()), str(SCRIPT), str(out), *steps, *warmup]
    return subprocess.run(command, capture_output=True, text=True, timeout=patient(280), env=env)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_grpo_example_reports_accuracy_and_writes_metrics(tmp_path: Path) -> None:
    result = run(tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "held-out greedy accuracy" in result.stdout
    figures = json.loads((tmp_path / "accuracy.json").read_text())
    assert all(0 <= figures[arm] <= 1 for arm in ("before", "grpo", "sft"))
    # The supervised arm trains on as many tokens per step as GRPO generates and trains on.
    assert abs(figures["sft_tokens_per_step"] - figures["grpo_tokens_per_step"]) <= 10
    lines = (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()
    assert "train/reward/exact_answer/mean" in json.loads(lines[-1])["metrics"]
    # It prints its results as docs/grpo.md shows them, and writes every figure the guide's
    # stored ones have (test_docs_results.py).
    results = grpo_results()
    assert results.render(figures) in result.stdout
    assert figures.keys() == json.loads(results.STORED.read_text()).keys()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_grpo_example_runs_under_torchrun(tmp_path: Path) -> None:
    from testutils import free_port

    launcher = preloaded_python.torchrun("--nproc-per-node=2", f"--master-port={free_port()}")
    result = run(tmp_path, *launcher)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 rank(s)" in result.stderr and "held-out greedy accuracy" in result.stdout


def test_a_wrong_override_is_one_line(tmp_path: Path) -> None:
    # It used to be a raw "ValueError: invalid literal for int()" traceback.
    command = [sys.executable, str(SCRIPT), str(tmp_path), "--trainer.max_duration.value=x"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=patient(120))
    assert result.returncode == 1
    (line,) = result.stderr.splitlines()
    assert line.startswith(
        "error: trainer.max_duration.value: expected an integer, got 'x' (full traceback: "
    ), result.stderr
    assert "Traceback" not in result.stderr
