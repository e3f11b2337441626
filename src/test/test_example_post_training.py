"""src/examples/dpo and src/examples/two_stage_kl run unchanged under torchrun (2 ranks, tiny)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
from test_examples import run_in_own_session
from testutils import free_port

EXAMPLES = Path(__file__).parents[1] / "examples"


def torchrun(script: Path, *args: str, cwd: Path) -> str:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
        f"--master-port={free_port()}", str(script), *args,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = run_in_own_session(command, cwd=cwd, env=env, timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 rank(s)" in result.stderr
    return result.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dpo_example_under_torchrun(tmp_path: Path) -> None:
    out = torchrun(EXAMPLES / "dpo" / "train.py", "3", "1", cwd=tmp_path)
    match = re.search(r"before DPO ([0-9.]+)\s+after 3 DPO steps ([0-9.]+)", out)
    assert match, out
    assert float(match.group(1)) == 0.5  # the reference is the policy: every margin is 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_stage_example_under_torchrun(tmp_path: Path) -> None:
    out = torchrun(EXAMPLES / "two_stage_kl" / "train.py", "3", cwd=tmp_path)
    lines = [line for line in out.splitlines() if line.startswith("beta=")]
    assert [line.split(":")[0] for line in lines] == ["beta=0", "beta=1"], out
    assert all("KL to snapshot" in line for line in lines)
