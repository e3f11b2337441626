"""The examples the docs point to run as written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parents[1] / "examples"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_quickstart_trains_and_takes_overrides(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "quickstart" / "train.py"), "--max_duration.value=10"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Training done at step 10" in result.stderr
    assert "[step=10/10]" in result.stderr and "train/CE loss=" in result.stderr
