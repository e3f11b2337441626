"""src/examples/dpo and src/examples/two_stage_kl: config-driven, and unchanged under torchrun
(2 ranks, tiny)."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import preloaded_python
import pytest
from test_examples import run_in_own_session
from testutils import free_port, patient

from olmolike.exceptions import ConfigurationError

EXAMPLES = Path(__file__).parents[1] / "examples"
STAGES_OF_3 = (
    "--data_loader.stages.stage1.steps=3",
    "--data_loader.stages.stage2.steps=3",
    "--train_module.stage1_steps=3",
    "--trainer.max_duration.value=6",
)


@functools.cache
def example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"{name}_example", EXAMPLES / name / "train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        ("dpo", ["--train_module.reference=runs/base", "--train_module.loss_type=ipo"]),
        ("two_stage_kl", [*STAGES_OF_3, "--data_loader.stages.stage2.data_loader.seed=5"]),
    ],
)
def test_example_config_takes_overrides_and_round_trips(
    tmp_path: Path, name: str, overrides: list[str]
) -> None:
    config = example(name).default_config("demo").merge(overrides)
    (tmp_path / "config.yaml").write_text(config.to_yaml())
    assert type(config).from_yaml(tmp_path / "config.yaml") == config
    assert config != example(name).default_config("demo")


def test_two_stage_example_names_the_fix_for_stages_that_disagree() -> None:
    config = example("two_stage_kl").default_config("demo")
    with pytest.raises(ConfigurationError, match=re.escape("--train_module.stage1_steps=5")):
        config.merge(["--data_loader.stages.stage1.steps=5"])
    with pytest.raises(ConfigurationError, match=re.escape("--trainer.max_duration.value=70")):
        config.merge(["--data_loader.stages.stage2.steps=10"])


def test_dpo_example_dry_run_prints_the_config(tmp_path: Path) -> None:
    command = [*preloaded_python.command(), str(EXAMPLES / "dpo" / "train.py"), "demo", "--dry-run",
               "--train_module.reference=runs/base"]  # fmt: skip
    result = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, timeout=patient(120)
    )
    assert result.returncode == 0, result.stderr
    assert "reference: runs/base" in result.stdout and not (tmp_path / "runs").exists()


def torchrun(script: Path, *args: str, cwd: Path) -> str:
    launcher = preloaded_python.torchrun("--nproc-per-node=2", f"--master-port={free_port()}")
    command = [*launcher, str(script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = run_in_own_session(command, cwd=cwd, env=env, timeout=patient(280))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 rank(s)" in result.stderr
    return result.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dpo_example_under_torchrun(tmp_path: Path) -> None:
    out = torchrun(
        EXAMPLES / "dpo" / "train.py",
        "--trainer.max_duration.value=3",
        "--pretrain_steps=1",
        cwd=tmp_path,
    )
    match = re.search(r"before DPO ([0-9.]+)\s+after 3 DPO steps ([0-9.]+)", out)
    assert match, out
    assert float(match.group(1)) == 0.5  # the reference is the policy: every margin is 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_stage_example_under_torchrun(tmp_path: Path) -> None:
    out = torchrun(EXAMPLES / "two_stage_kl" / "train.py", *STAGES_OF_3, cwd=tmp_path)
    lines = [line for line in out.splitlines() if line.startswith("beta=")]
    assert [line.split(":")[0] for line in lines] == ["beta=0", "beta=1"], out
    assert all("KL to snapshot" in line for line in lines)
