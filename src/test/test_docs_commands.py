"""Every shell command in docs/*.md runs as written.

Each fenced ``bash`` block in the docs carries a marker on the line before it:

- ``<!-- doc-test: run [ARGS...] -->``: the test runs the block's commands, in the order of the
  docs, in one workspace that holds the repository's ``src``, ``Makefile`` and data. ``ARGS``
  are appended to the block's training commands (``train.py``, ``olmolike train``), after the
  small-size arguments the test adds to every training command so that all of it fits in CI.
- ``<!-- doc-test: skip REASON -->``: not run (it needs a GPU, a cloud bucket, or minutes), and
  the reason is said in the docs source.

A ``bash`` block without a marker fails the test, so a new command cannot slip in unchecked.
Output and transcripts use ``console`` or ``text`` blocks, which are not run.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from testutils import patient

REPO = Path(__file__).parents[2]
DOCS = REPO / "docs"
# The tutorial first: later pages use the runs it leaves behind (runs/stdlib-demo).
FIRST = ["train-your-first-model.md", "getting-started.md"]
MARKER = re.compile(r"<!--\s*doc-test:\s*(run|skip)\b(.*?)-->")
FENCE = re.compile(r"^```bash\s*$")
# Added to every training command: a 2-layer, d=32 model, half the batch and a short validation,
# so the tutorial's 400 steps take seconds. The markers' arguments come after and win.
SMALL = [
    "--model.d_model=32",
    "--model.n_layers=2",
    "--model.n_heads=2",
    "--trainer.callbacks.lm_evaluator.max_batches=2",
    "--data_loader.global_batch_size=2048",
    "--train_module.rank_microbatch_size=1024",
]
TRAINING = re.compile(r"(train\.py|olmolike train|-m olmolike train)\b")


@dataclass
class Block:
    path: Path
    line: int
    marker: tuple[str, str] | None
    commands: list[str]

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def doc_files() -> list[Path]:
    rest = sorted(p for p in DOCS.rglob("*.md") if p.name not in FIRST)
    return [DOCS / name for name in FIRST if (DOCS / name).exists()] + rest


def parse_blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        if not FENCE.match(lines[i]):
            i += 1
            continue
        previous = next((t for t in reversed(lines[:i]) if t.strip()), "")
        found = MARKER.search(previous)
        marker = (found.group(1), found.group(2).strip()) if found else None
        start, body = i + 1, []
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        blocks.append(Block(path, start, marker, join_commands(body)))
        i += 1
    return blocks


def join_commands(body: list[str]) -> list[str]:
    """Lines joined at trailing backslashes; blank and comment-only lines dropped."""
    commands, current = [], ""
    for text in body:
        current += text.strip() if current else text.rstrip()
        if current.endswith("\\"):
            current = current[:-1].rstrip() + " "
            continue
        if current.strip() and not current.lstrip().startswith("#"):
            commands.append(current.strip())
        current = ""
    return commands


def all_blocks() -> list[Block]:
    return [block for path in doc_files() for block in parse_blocks(path)]


def adapt(command: str, extra: list[str], venv: Path) -> str:
    """The command with the small sizes added (a trailing ``# comment`` dropped)."""
    code = command.partition(" #")[0].rstrip()
    small = " ".join(shlex.quote(a) for a in [*SMALL, *extra])
    if code.startswith("make run"):
        # The shared virtualenv stands in for `make install`'s (-o: never rebuild it).
        stamp = venv / ".installed-stamp"
        return f"{code} VENV={venv} -o {stamp} RUN_ARGS={shlex.quote(small)}"
    if TRAINING.search(code):
        return f"{code} {small}"
    return code


def workspace(root: Path) -> tuple[Path, dict[str, str]]:
    """A directory laid out like a checkout, with `olmolike`, `python`, `torchrun` on PATH."""
    work = root / "work"
    work.mkdir()
    for name in ["src", "Makefile", "pyproject.toml", "constraints.txt", "docs"]:
        (work / name).symlink_to(REPO / name)
    bindir = root / "bin"
    bindir.mkdir()
    python = Path(sys.executable)
    for name, how in [
        ("python", ""),
        ("olmolike", "-m olmolike"),
        ("torchrun", "-m torch.distributed.run"),
    ]:
        # Scripts, not symlinks: a symlinked venv python would not find its site-packages.
        (bindir / name).write_text(f'#!/bin/sh\nexec {python} {how} "$@"\n')
        (bindir / name).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(REPO / "src"),
        "OMP_NUM_THREADS": "1",
        "COLUMNS": "100",
    }
    return work, env


def run(command: str, cwd: Path, env: dict[str, str], where: str) -> None:
    proc = subprocess.Popen(
        ["bash", "-c", command],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    start = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=patient(240))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{where}: `{command}` hung for 240 s; output tail:\n{out[-3000:]}")
    if proc.returncode != 0:
        pytest.fail(f"{where}: `{command}` exited {proc.returncode}; output tail:\n{out[-3000:]}")
    print(f"{where}: {time.monotonic() - start:.1f} s: {command[:60]}")  # for `pytest -s`


def test_every_bash_block_is_marked() -> None:
    unmarked = [b.where for b in all_blocks() if b.marker is None]
    assert not unmarked, (
        "these ```bash blocks have no <!-- doc-test: run --> or <!-- doc-test: skip REASON -->"
        f" marker on the line before: {unmarked}"
    )
    no_reason = [b.where for b in all_blocks() if b.marker == ("skip", "")]
    assert not no_reason, f"a skipped block must say why: {no_reason}"


def test_parse_joins_continuations_and_reads_markers(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text(
        "<!-- doc-test: run --a=1 -->\n```bash\npython train.py x \\\n    --b=2  # note\n"
        "# only a comment\n\necho hi\n```\n\n<!-- doc-test: skip needs a GPU -->\n\n"
        "```bash\nnvidia-smi\n```\n```bash\nls\n```\n"
    )
    blocks = parse_blocks(doc)
    assert [b.marker for b in blocks] == [("run", "--a=1"), ("skip", "needs a GPU"), None]
    assert blocks[0].commands == ["python train.py x --b=2  # note", "echo hi"]
    adapted = adapt(blocks[0].commands[0], ["--a=1"], tmp_path)
    assert adapted.startswith("python train.py x --b=2 --model.d_model=32")
    assert adapted.endswith("--a=1")
    assert adapt("make run", [], tmp_path).startswith(f"make run VENV={tmp_path} -o ")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_docs_commands_run_as_written(tmp_path: Path) -> None:
    work, env = workspace(tmp_path)
    venv = Path(sys.executable).parent.parent
    ran = 0
    for block in all_blocks():
        if block.marker is None or block.marker[0] != "run":
            continue
        extra = shlex.split(block.marker[1])
        for command in block.commands:
            run(adapt(command, extra, venv), work, env, block.where)
            ran += 1
    assert ran >= 5, f"only {ran} doc commands are marked to run"
