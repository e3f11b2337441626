"""src/examples/sft runs as documented: from a base run, single process and under torchrun."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from types import ModuleType

import preloaded_python
import pytest
from test_examples import olmolike, prepared_corpus, run_in_own_session, run_train_lm  # noqa: F401
from testutils import patient

SFT = Path(__file__).parents[1] / "examples" / "sft" / "train.py"


@pytest.fixture(scope="module")
def base_run(prepared_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    """A short train_lm run whose model takes SFT's 256-byte sequences."""
    run_dir = tmp_path_factory.mktemp("base") / "run"
    result = run_train_lm(run_dir, prepared_corpus, 12, "--model.max_sequence_length=256")
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def load_example() -> ModuleType:
    """The example script as a module (under its own name: train_lm's is also train.py)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("sft_example_train", SFT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def functions(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example's JSONL from 150 standard-library files (the example scans them all)."""
    from olmolike.data.prepare import stdlib_python_files

    examples = load_example().function_examples(stdlib_python_files()[:150])
    assert len(examples) > 100
    path = tmp_path_factory.mktemp("functions") / "functions.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in examples))
    return path


def run_sft(base: Path, functions: Path, out: Path, *launcher: str) -> str:
    import os
    import shutil

    data_dir = out.parent / "sft-data"
    data_dir.mkdir()
    shutil.copy(functions, data_dir / "functions.jsonl")  # present: the example uses it

    args = [
        "demo",
        f"--base={base}",
        f"--data_dir={data_dir}",
        f"--trainer.save_folder={out}",
        "--trainer.max_duration.value=16",
        "--trainer.metrics_collect_interval=4",
        "--trainer.callbacks.sft_evaluator.eval_interval=8",
        "--trainer.callbacks.sft_evaluator.max_batches=2",
        "--trainer.callbacks.checkpointer.save_interval=8",
        "--data_loader.global_batch_size=2048",
        "--train_module.rank_microbatch_size=1024",
        "--train_module.optim.lr=0.004",
        "--train_module.scheduler.warmup=2",
    ]
    command = [*(launcher or preloaded_python.command()), str(SFT), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = run_in_own_session(command, cwd=out.parent, env=env, timeout=patient(500))
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def ratio(stdout: str) -> float:
    match = re.search(r"fine-tuned / base: ([0-9.]+)", stdout)
    assert match, stdout
    return float(match.group(1))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sft_example_lowers_the_held_out_masked_loss(
    base_run: Path, functions: Path, tmp_path: Path
) -> None:
    stdout = run_sft(base_run, functions, tmp_path / "sft")
    assert "masked loss on held-out completions" in stdout and "base model :" in stdout
    assert ratio(stdout) < 0.9
    assert (tmp_path / "sft" / "step16").is_dir()
    # The checkpoint names its model and tokenizer: olmolike generate takes it.
    prompt = "<|user|>\nWrite add(a, b): Add two numbers.<|end|>\n<|assistant|>\n"
    sample = olmolike(
        "generate", str(tmp_path / "sft"), "--prompt", prompt, "--max-new-tokens", "8",
        cwd=tmp_path,
    )  # fmt: skip
    assert sample.returncode == 0, sample.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sft_example_runs_under_torchrun(base_run: Path, functions: Path, tmp_path: Path) -> None:
    from testutils import free_port

    launcher = preloaded_python.torchrun("--nproc-per-node=2", f"--master-port={free_port()}")
    stdout = run_sft(base_run, functions, tmp_path / "sft", *launcher)
    assert ratio(stdout) < 0.9


def test_missing_base_says_how_to_make_it(tmp_path: Path) -> None:
    sft_example = load_example()
    config = sft_example.default_config("x").replace(base=str(tmp_path / "nothing"))
    with pytest.raises(SystemExit, match="make run"):
        sft_example.load_base(config)
