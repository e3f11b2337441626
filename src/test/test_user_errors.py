"""A user's mistake is one line naming the field and the fix, printed once per job."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

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
        [sys.executable, str(script)], capture_output=True, text=True, timeout=patient(120)
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
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2"]
    result = subprocess.run(
        [*torchrun, f"--master-port={free_port()}", str(script)],
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
