"""A user's mistake is one line naming the field and the fix, printed once per job."""

from __future__ import annotations

import os
import re
import subprocess
import textwrap
from pathlib import Path

import preloaded_python
import pytest
from testutils import build_trainer, free_port, patient

from olmolike.exceptions import ConfigurationError

SCRIPT = """
from olmolike.exceptions import ConfigurationError
from olmolike.train import prepare_training_environment, teardown_training_environment

prepare_training_environment()
try:
    raise ConfigurationError("must be >= 1, got 0", path="trainer.max_duration.value")
finally:
    teardown_training_environment()
"""
MESSAGE = "error: trainer.max_duration.value: must be >= 1, got 0"


def _python() -> list[str]:
    """``python``: :mod:`preloaded_python`'s stand-in whose commands end as the interpreter
    ends (the one line is printed as the process ends)."""
    return preloaded_python.command(real_exit=True)


def test_a_save_folder_that_is_a_file_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigurationError, match=r"save_folder: .*is a file, not a directory"):
        build_trainer(tmp_path / "file")


def test_a_save_folder_that_cannot_be_created_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigurationError, match=r"cannot create .*file/run.*Not a directory"):
        build_trainer(tmp_path / "file" / "run")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_save_folder_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "ro").mkdir(mode=0o555)
    with pytest.raises(ConfigurationError, match="is not writable"):
        build_trainer(tmp_path / "ro")


def _traceback_files(stderr: str) -> list[Path]:
    return [Path(p) for p in re.findall(r"full traceback: (\S+)\)", stderr)]


def test_an_olmolike_error_escaping_a_script_is_one_line(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    result = subprocess.run(
        [*_python(), str(script)], capture_output=True, text=True, timeout=patient(120)
    )
    assert result.returncode == 1
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"{MESSAGE} (full traceback: "), result.stderr
    assert "Traceback" not in result.stderr
    (saved,) = _traceback_files(result.stderr)
    assert "Traceback (most recent call last)" in saved.read_text()
    saved.unlink()


@pytest.mark.timeout(180)
def test_under_torchrun_the_line_is_printed_once_per_job(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    torchrun = preloaded_python.torchrun(
        "--nproc-per-node=2", f"--master-port={free_port()}", real_exit=True
    )
    result = subprocess.run(
        [*torchrun, str(script)],
        capture_output=True,
        text=True,
        timeout=patient(150),
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode != 0
    printed = [line for line in result.stderr.splitlines() if line.startswith(MESSAGE)]
    assert len(printed) == 1, result.stderr[-3000:]
    # torchrun's summary names it too (the rank's error file), instead of "To enable traceback".
    assert f"traceback : {printed[0]}" in result.stderr, result.stderr[-3000:]
    assert "ConfigurationError" not in result.stderr  # no traceback from either rank
    for saved in set(_traceback_files(result.stderr)):
        saved.unlink()


# -- a layout the ranks cannot run, under `olmolike train --nproc-per-node 4` -----------------


@pytest.fixture(scope="module")
def experiment(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny `olmolike train` experiment (one layer: a pipeline of two stages is too deep)."""
    from olmolike.data import prepare_data
    from olmolike.data.numpy_data_loader import NumpyDataLoaderConfig
    from olmolike.data.numpy_dataset import NumpyDatasetConfig
    from olmolike.experiment import ExperimentConfig
    from olmolike.nn import TransformerConfig
    from olmolike.train import Duration, TrainerConfig
    from olmolike.train.train_module import TransformerTrainModuleConfig

    root = tmp_path_factory.mktemp("experiment")
    text = root / "corpus.txt"
    text.write_text("".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(100)))
    data = prepare_data([text], root / "data")
    config = ExperimentConfig(
        run_name="refused",
        model=TransformerConfig(
            vocab_size=data.vocab_size, d_model=16, n_layers=1, n_heads=2, max_sequence_length=32
        ),
        dataset=NumpyDatasetConfig(paths=data.paths("train"), sequence_length=32),
        data_loader=NumpyDataLoaderConfig(global_batch_size=4 * 32, seed=0),
        train_module=TransformerTrainModuleConfig(rank_microbatch_size=32),
        trainer=TrainerConfig(save_folder=str(root / "run"), max_duration=Duration.steps(2)),
    )
    path = root / "experiment.yaml"
    path.write_text(config.to_yaml())
    return path


REFUSED_LAYOUTS = {
    "tp-3-on-4": (
        ["--train_module.tp_config.degree=3"],
        "error: train_module.tp_config.degree: pp (1) x dp_replicate (1) x cp (1) x tp (3) = 3 "
        "does not divide the world size (4): choose degrees whose product divides it",
    ),
    "pp-3-on-4": (
        ["--train_module.pp_config.degree=3"],
        "error: train_module.pp_config.degree: pp (3) x dp_replicate (1) x cp (1) x tp (1) = 3 "
        "does not divide the world size (4): choose degrees whose product divides it",
    ),
    "hsdp-3-replicas-on-4": (
        ["--train_module.dp_config.name=hsdp", "--train_module.dp_config.num_replicas=3"],
        "error: train_module.dp_config.num_replicas: the data-parallel ranks (4 = world size 4 "
        "/ 1 for the other degrees) must be a multiple of num_replicas (3)",
    ),
    "interleaved-4-stages-over-3-layers": (
        [
            "--model.n_layers=3",
            "--train_module.pp_config.degree=2",
            "--train_module.pp_config.schedule=interleaved_1f1b",
        ],
        "error: train_module.pp_config: the model has 3 layers but the pipeline has 4 stages",
    ),
    # Context parallelism is refused as a whole today, and a degree of 3 cannot split 4 ranks
    # once it is not: either way the one line names the field.
    "cp-3-on-4": (["--train_module.cp_config.degree=3"], "error: train_module.cp_config.degree: "),
    "tp-x-pp-sequence": (
        [
            "--model.max_sequence_length=33",
            "--train_module.tp_config.degree=2",
            "--train_module.pp_config.degree=2",
            "--train_module.dp_config.name=fsdp",
            "--model.n_layers=2",
        ],
        "error: model.max_sequence_length: under pipeline parallelism every sequence is padded "
        "to a multiple of the tensor-parallel degree (2), so one of max_sequence_length (33) "
        "tokens would become 34, longer than the model's positions; set "
        "model.max_sequence_length to a multiple of 2 (e.g. 34)",
    ),
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", list(REFUSED_LAYOUTS))
def test_a_refused_layout_is_one_line_before_any_rank_starts(experiment: Path, case: str) -> None:
    """The launcher checks the layout against the world size before it starts a rank.
    Before: the message 4 times (once per rank) and 4 C++ stack dumps of `TCPStore ...
    Broken pipe` (64-68 lines); a TP x PP run with a sequence of max_sequence_length tokens
    not a multiple of the tp degree crashed at its first step with a 75-line traceback."""
    overrides, expected = REFUSED_LAYOUTS[case]
    command = [*_python(), "-m", "olmolike", "train", "--nproc-per-node=4", str(experiment)]
    result = subprocess.run(
        [*command, *overrides],
        capture_output=True,
        text=True,
        timeout=patient(150),
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert line.startswith(expected), line
    assert result.stdout == ""  # no rank started: not even the process group's record


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_refusal_from_the_ranks_themselves_is_one_line_per_job(experiment: Path) -> None:
    """Four ranks started without a launcher that holds the job's store (rank 0 holds it):
    every rank refuses the layout, and rank 0's store must outlive the others' reports.
    Before: 4 lines and 4 `TCPStore ... Broken pipe` stack dumps."""
    from testutils import start_ranks

    command = [*_python(), "-m", "olmolike", "train", str(experiment)]
    ranks = start_ranks([*command, "--train_module.tp_config.degree=3"], ranks=4)
    outputs = []
    for rank in ranks:
        try:
            outputs.append(rank.communicate(timeout=patient(200))[0])
        finally:
            for other in ranks:
                if other.poll() is None and rank.returncode is None:
                    other.kill()
    assert [rank.returncode for rank in ranks] == [2, 2, 2, 2], outputs
    lines = [line for line in "".join(outputs).splitlines() if " INFO " not in line]
    assert lines == [REFUSED_LAYOUTS["tp-3-on-4"][1]], "".join(outputs)[-3000:]


def test_the_hsdp_error_names_its_field_in_full() -> None:
    from olmolike.distributed.parallel import DataParallelConfig, DataParallelType
    from olmolike.train.train_module import TransformerTrainModuleConfig

    config = TransformerTrainModuleConfig(
        rank_microbatch_size=32,
        dp_config=DataParallelConfig(name=DataParallelType.hsdp, num_replicas=3),
    )
    with pytest.raises(ConfigurationError, match=r"^train_module.dp_config.num_replicas: "):
        config.parallel_degrees(4, local_world_size=4)


@pytest.mark.timeout(180)
def test_a_bad_frozen_rank_timeout_is_one_line_before_any_rank_starts(experiment: Path) -> None:
    command = [*_python(), "-m", "olmolike", "train", "--nproc-per-node=4", str(experiment)]
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=patient(150),
        env={**os.environ, "OMP_NUM_THREADS": "1", "OLMOLIKE_FROZEN_RANK_TIMEOUT": "-1"},
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "error: OLMOLIKE_FROZEN_RANK_TIMEOUT must be a number of seconds >= 0 (0 or inf: never "
        "name a rank frozen), got '-1'"
    ]
    assert result.stdout == ""
