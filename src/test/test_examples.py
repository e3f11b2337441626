"""The examples the docs point to run as written (``python`` being :mod:`preloaded_python`'s
stand-in, which runs the same script without importing torch again; torchrun is real)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import preloaded_python
import pytest
from testutils import patient

EXAMPLES = Path(__file__).parents[1] / "examples"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_quickstart_trains_and_takes_overrides(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            *preloaded_python.command(),
            str(EXAMPLES / "quickstart" / "train.py"),
            "--max_duration.value=10",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=patient(110),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Training done at step 10" in result.stderr
    assert "[step=10/10]" in result.stderr and "train/CE loss=" in result.stderr


TRAIN_LM = EXAMPLES / "train_lm" / "train.py"
SMALL_RUN = [
    "--model.d_model=32",
    "--model.n_layers=2",
    "--model.n_heads=2",
    "--model.max_sequence_length=64",
    "--dataset.sequence_length=64",
    "--trainer.callbacks.lm_evaluator.eval_dataset.sequence_length=64",
    "--trainer.callbacks.lm_evaluator.eval_interval=4",
    "--trainer.callbacks.lm_evaluator.max_batches=2",
    "--trainer.callbacks.checkpointer.save_interval=4",
    "--trainer.callbacks.checkpointer.ephemeral_save_interval=null",
    "--trainer.metrics_collect_interval=2",
    "--data_loader.global_batch_size=512",
    "--train_module.rank_microbatch_size=256",
    "--train_module.scheduler.warmup=2",
]


def olmolike(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*preloaded_python.command(), "-m", "olmolike.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=patient(200),
    )


@pytest.fixture(scope="module")
def prepared_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Byte tokens of 40 standard-library modules, with a validation split."""
    from olmolike.data.prepare import stdlib_python_files

    root = tmp_path_factory.mktemp("corpus")
    sources = root / "sources"
    sources.mkdir()
    for path in stdlib_python_files()[:40]:
        (sources / f"{path.parent.name}_{path.name}").write_bytes(path.read_bytes()[:20_000])
    # Relative paths: the validation split hashes each source's name as given (not a tmp path).
    result = olmolike("prepare-data", "sources", "-o", "data", "--val-fraction", "0.2", cwd=root)
    assert result.returncode == 0, result.stderr[-2000:]
    return root / "data"


def run_train_lm(
    run_dir: Path, data: Path, steps: int, *extra: str, launcher: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    args = [
        "demo",
        *SMALL_RUN,
        f"--dataset.paths=[{data / 'train'}]",
        f"--trainer.callbacks.lm_evaluator.eval_dataset.paths=[{data / 'val'}]",
        f"--trainer.save_folder={run_dir}",
        f"--trainer.max_duration.value={steps}",
        *extra,
    ]
    command = [*(launcher or preloaded_python.command()), str(TRAIN_LM), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return run_in_own_session(command, cwd=run_dir.parent, env=env, timeout=patient(280))


def run_in_own_session(
    command: list[str], *, cwd: Path, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """Run ``command``; on timeout kill its whole process group (torchrun's workers too)."""
    proc = subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{command[:3]} hung for {timeout:.0f}s; stderr tail:\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_train_lm_trains_resumes_generates_and_exports(
    prepared_corpus: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    first = run_train_lm(run_dir, prepared_corpus, 8)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "validation loss (nats/token):" in first.stdout
    assert "unigram baseline of the data:" in first.stdout
    assert (run_dir / "step8").is_dir() and (run_dir / "config.json").is_file()

    # Started again with a longer duration, it continues from the newest checkpoint.
    second = run_train_lm(run_dir, prepared_corpus, 12)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "Training from step 8 to step 12" in second.stderr

    sample = olmolike(
        "generate", str(run_dir), "--prompt", "def ", "--max-new-tokens", "20", cwd=tmp_path
    )
    assert sample.returncode == 0, sample.stderr[-2000:]
    assert sample.stdout.startswith("def ")

    export = olmolike("export-hf", str(run_dir / "step12"), str(tmp_path / "hf"), cwd=tmp_path)
    assert export.returncode == 0, export.stderr[-2000:]
    transformers = pytest.importorskip("transformers")
    import torch

    from olmolike.inference import load_checkpoint_model

    ours = load_checkpoint_model(run_dir / "step12").model
    theirs = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path / "hf", torch_dtype=torch.float32
    )
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids), rtol=1e-5, atol=1e-5)


def dry_run(cwd: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*preloaded_python.command(), str(TRAIN_LM), "demo", "--dry-run", *overrides],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=patient(60),
    )


def test_train_lm_dry_run_prints_the_config_with_overrides(tmp_path: Path) -> None:
    result = dry_run(tmp_path, "--train_module.optim.lr=0.001")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "lr: 0.001" in result.stdout and "run_name: demo" in result.stdout
    assert not (tmp_path / "runs").exists()


def test_train_lm_rejects_mismatched_sequence_lengths(tmp_path: Path) -> None:
    result = dry_run(tmp_path, "--dataset.sequence_length=128")
    assert result.returncode != 0
    assert "eval_dataset.sequence_length" in result.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_train_lm_runs_unchanged_under_torchrun_with_fsdp(
    prepared_corpus: Path, tmp_path: Path
) -> None:
    from testutils import free_port

    run_dir = tmp_path / "run"
    result = run_train_lm(
        run_dir,
        prepared_corpus,
        4,
        "--train_module.dp_config.name=fsdp",
        launcher=preloaded_python.torchrun("--nproc-per-node=2", f"--master-port={free_port()}"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 rank(s)" in result.stderr
    assert "validation loss (nats/token):" in result.stdout
    assert (run_dir / "step4" / ".olmolike-checkpoint.json").is_file()
