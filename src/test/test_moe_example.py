"""The MoE example (``make moe``) runs and prints its expert load; its ``--dry-run`` output is an
experiment file that ``olmolike train`` trains, and the checkpoint generates and exports."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import preloaded_python
import pytest
from testutils import patient

from olmolike.cli import main
from olmolike.data import prepare_data
from olmolike.inference import load_checkpoint_model
from olmolike.nn.moe import MoEFeedForward

EXAMPLE = Path(__file__).parents[1] / "examples" / "moe" / "train.py"
SEQ = 32


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Ten small files of code, one or more of them held out for validation."""
    root = tmp_path_factory.mktemp("corpus")
    for n in range(10):
        (root / f"part{n}.py").write_text(
            "".join(f"def f{i}(x):\n    return x * {i} + {n}\n\n" for i in range(60))
        )
    # Relative paths: the validation split hashes each source's name as given, and a tmp path
    # (its pytest-N and corpusN parts change from run to run) held out no file in ~3% of runs.
    files = [Path(f"part{n}.py") for n in range(10)]
    with contextlib.chdir(root):
        prepared = prepare_data(files, Path("data"), val_fraction=0.3)
    assert prepared.paths("val")
    return root / "data"


def small(data: Path) -> list[str]:
    return [
        "--model.d_model=32", "--model.n_layers=2", "--model.n_heads=2",
        "--model.max_sequence_length=32", "--model.moe.num_experts=4",
        "--model.moe.hidden_size=16", f"--dataset.paths=[{data}/train]",
        f"--dataset.sequence_length={SEQ}",
        f"--trainer.callbacks.lm_evaluator.eval_dataset.paths=[{data}/val]",
        f"--trainer.callbacks.lm_evaluator.eval_dataset.sequence_length={SEQ}",
        "--trainer.callbacks.lm_evaluator.eval_interval=4",
        "--trainer.callbacks.lm_evaluator.max_batches=1",
        "--trainer.callbacks.checkpointer.save_interval=4",
        "--trainer.callbacks.checkpointer.ephemeral_save_interval=null",
        "--trainer.max_duration.value=4", "--trainer.metrics_collect_interval=2",
        "--trainer.callbacks.console_logger.log_interval=2",
        f"--data_loader.global_batch_size={4 * SEQ}",
        f"--train_module.rank_microbatch_size={2 * SEQ}",
        "--train_module.scheduler.warmup=1",
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_example_prints_each_layers_expert_load(data: Path, tmp_path: Path) -> None:
    result = subprocess.run(
        [*preloaded_python.command(), str(EXAMPLE), "demo", *small(data)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=patient(280),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("expert load per layer"))
    assert lines[start + 1].split() == ["layer", "e0", "e1", "e2", "e3", "max/mean"]
    for layer, line in enumerate(lines[start + 2 : start + 4]):
        fields = line.split()
        assert int(fields[0]) == layer
        assert sum(float(f) for f in fields[1:5]) == pytest.approx(100.0, abs=0.3)
        assert 1.0 <= float(fields[5]) <= 4.0
    assert "train/load balancing loss=" in result.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_olmolike_train_runs_the_examples_experiment_file(
    data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # the command installs its own
    printed = subprocess.run(
        [*preloaded_python.command(), str(EXAMPLE), "from-file", "--dry-run", *small(data)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=patient(120),
        check=True,
    ).stdout
    assert "num_experts: 4" in printed
    experiment = tmp_path / "moe.yaml"
    experiment.write_text(printed)
    monkeypatch.chdir(tmp_path)
    assert main(["train", str(experiment)]) == 0
    run = tmp_path / "runs" / "from-file"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = next(r["metrics"] for r in reversed(records) if "moe/dropped tokens" in r["metrics"])
    assert last["moe/dropped tokens"] == 0 and last["moe/layer 1/load max/mean"] >= 1.0
    loaded = load_checkpoint_model(str(run))
    assert any(isinstance(m, MoEFeedForward) for m in loaded.model.modules())
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", "def", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.startswith("def")
