"""Every shell command in docs/*.md runs as written.

Each fenced ``bash`` block in the docs carries a marker on the line before it:

- ``<!-- doc-test: run [ARGS...] -->``: the test runs the block's commands, in order. ``ARGS``
  are appended to the block's training commands (``train.py``, ``olmolike train``), after the
  small-size arguments the test adds to every training command so that all of it fits in CI.
- ``<!-- doc-test: skip REASON -->``: not run (it needs a GPU, a cloud bucket, or minutes), and
  the reason is said in the docs source.

A ``bash`` block without a marker fails the test, so a new command cannot slip in unchecked.
Output and transcripts use ``console`` or ``text`` blocks, which are not run.

The tutorial's first block (``make run``) runs once per test run, in a workspace that holds
the repository's ``src``, ``Makefile`` and ``docs``; every other block is a test of its own,
run in a copy of the workspace that block left (later pages use its runs/stdlib-demo and
data/stdlib), so that the blocks spread over the test processes. A block must not need what
another block (but the first) wrote. ``python`` and ``olmolike`` in the blocks are
:mod:`preloaded_python`'s stand-ins: the same commands, without importing torch again;
``torchrun``'s launcher and ranks run under them too.
"""

from __future__ import annotations

import fcntl
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import preloaded_python
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


def run_blocks() -> list[Block]:
    """The blocks marked to run, in the docs' order (the tutorial's first)."""
    return [b for b in all_blocks() if b.marker is not None and b.marker[0] == "run"]


def adapt(command: str, extra: list[str], venv: Path) -> str:
    """The command with the small sizes added (a trailing ``# comment`` dropped)."""
    code = command.partition(" #")[0].rstrip()
    small = " ".join(shlex.quote(a) for a in [*SMALL, *extra])
    if code.startswith("make run"):
        # The workspace's venv (the stand-in commands) for `make install`'s (-o: never build it).
        stamp = venv / ".installed-stamp"
        return f"{code} VENV={venv} -o {stamp} RUN_ARGS={shlex.quote(small)}"
    if TRAINING.search(code):
        return f"{code} {small}"
    return code


def workspace(root: Path) -> tuple[Path, dict[str, str]]:
    """A directory laid out like a checkout, with ``python``, ``olmolike`` and ``torchrun``
    (preloaded stand-ins; torchrun starts its ranks with the ``python`` here, through
    ``PYTHON_EXEC``) on PATH; ``root/venv`` stands in for `make install`'s."""
    work = root / "work"
    work.mkdir()
    for name in ["src", "Makefile", "pyproject.toml", "constraints.txt", "docs"]:
        (work / name).symlink_to(REPO / name)
    bindir = root / "venv" / "bin"
    bindir.mkdir(parents=True)
    (root / "venv" / ".installed-stamp").touch()
    python = shlex.join(preloaded_python.command())
    ranks_python = shlex.quote(str(bindir / "python"))
    for name, how in [
        ("python", python),
        ("olmolike", f"{python} -m olmolike"),
        ("torchrun", f"env PYTHON_EXEC={ranks_python} {python} -m torch.distributed.run"),
    ]:
        # Scripts, not symlinks: a symlinked venv python would not find its site-packages.
        (bindir / name).write_text(f'#!/bin/sh\nexec {how} "$@"\n')
        (bindir / name).chmod(0o755)
    return work, environment(root)


def environment(root: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PATH": f"{root / 'venv' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(REPO / "src"),
        "OMP_NUM_THREADS": "1",
        "COLUMNS": "100",
    }


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


def test_a_block_reaches_the_preloaded_python(tmp_path: Path) -> None:
    """The workspace's ``python`` and ``olmolike`` run the real commands through the server."""
    work, env = workspace(tmp_path)
    code = "import os, sys; print(os.environ['OLMOLIKE_TEST_PYTHON_SERVER'] != '', sys.argv[1:])"
    out = subprocess.run(
        ["bash", "-c", f"python -c {shlex.quote(code)} a b && olmolike --version"],
        cwd=work, env=env, capture_output=True, text=True, timeout=patient(120), check=True,
    ).stdout  # fmt: skip
    assert out.splitlines()[0] == "True ['a', 'b']" and "olmolike" in out.splitlines()[1]


def run_block(block: Block, work: Path, env: dict[str, str], venv: Path) -> None:
    extra = shlex.split(block.marker[1]) if block.marker else []
    for command in block.commands:
        run(adapt(command, extra, venv), work, env, block.where)


@pytest.fixture(scope="session")
def tutorial_workspace(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The workspace after the tutorial's first block (``make run``), built once per test run:
    by the first test process that needs it, while the others wait (a file lock)."""
    first = run_blocks()[0]
    assert first.path.name == FIRST[0] and first.commands == ["make run"], first.where
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # shared by the run's workers
    root = base / "docs-tutorial"
    with open(base / "docs-tutorial.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        failed = base / "docs-tutorial.failed"
        if failed.exists():
            pytest.fail(failed.read_text())
        if not (root / "done").exists():
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir()
            work, env = workspace(root)
            try:
                run_block(first, work, env, root / "venv")
            except BaseException as e:  # the other workers' tests fail with its message
                failed.write_text(f"the tutorial's {first.where} failed: {e}")
                raise
            (root / "done").touch()
    yield root


def test_the_tutorials_first_block_runs(tutorial_workspace: Path) -> None:
    assert (tutorial_workspace / "work" / "runs" / "stdlib-demo").is_dir()


@pytest.mark.parametrize("block", run_blocks()[1:], ids=lambda b: b.where.removeprefix("docs/"))
def test_docs_block_runs_as_written(block: Block, tutorial_workspace: Path, tmp_path: Path) -> None:
    work, env = workspace(tmp_path)
    for entry in (tutorial_workspace / "work").iterdir():
        if not entry.is_symlink():  # what the first block made; the data is only read
            link = os.link if entry.name == "data" else shutil.copy2
            shutil.copytree(entry, work / entry.name, symlinks=True, copy_function=link)
    run_block(block, work, env, tmp_path / "venv")


def test_enough_commands_are_run() -> None:
    ran = sum(len(block.commands) for block in run_blocks())
    assert ran >= 5, f"only {ran} doc commands are marked to run"
