"""Commands that error messages suggest work as written.

The ones that start runs are run where the error is tested (``test_inference.py``: the
``generate --nproc-per-node`` an unlaunched ``--tp 2`` suggests; ``test_resume_model_change.py``:
the overrides a refused resume suggests). Here: the pieces those rely on, and the install
hints, whose extras must exist.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from olmolike.cli import main
from olmolike.launch import without_option

REPO = Path(__file__).resolve().parents[2]


def test_every_pip_install_hint_names_an_extra_that_exists() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    named = {
        (path.name, extra)
        for path in (REPO / "src" / "olmolike").rglob("*.py")
        for extra in re.findall(r"pip install 'olmolike\[(\w+)\]'", path.read_text())
    }
    assert named, "the hints were not found"
    assert [(file, extra) for file, extra in sorted(named) if extra not in extras] == []


@pytest.mark.parametrize(
    "argv",
    [
        ["ckpt", "--nproc-per-node", "2", "--tp", "2"],
        ["ckpt", "--nproc-per-node=2", "--tp", "2"],
        ["ckpt", "--nproc", "2", "--tp", "2"],  # argparse takes a unique prefix
    ],
)
def test_the_launcher_drops_its_own_option_from_the_ranks_command(argv: list[str]) -> None:
    assert without_option(argv, "--nproc-per-node", len("--np")) == ["ckpt", "--tp", "2"]


def test_generate_refuses_ranks_that_do_not_match_the_split(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["generate", "ckpt", "--nproc-per-node=2", "--tp", "4"]) == 2
    assert "--tp: is 4 but --nproc-per-node starts 2 ranks" in capsys.readouterr().err
