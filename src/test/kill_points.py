"""Kill points for restart tests: a rank SIGKILLs itself at a chosen moment of a run.

A test writes a plan (:func:`write_plan`) and starts the job with :func:`kill_env` added to its
environment: a ``sitecustomize`` module on ``PYTHONPATH`` then calls :func:`install` in every
Python process the job starts, before the program runs. Processes that are not ranks (the
launcher, torchrun's agent) install nothing.

The plan is a list of kills, done in order, across the job's restarts: kill ``i`` is armed in a
rank only once kills ``0 .. i-1`` have happened (each leaves ``kill-{i}.done`` in the plan's
folder, created just before the rank dies). So a plan of three kills kills three
incarnations, whatever the launcher, and a test checks that every kill happened.

A kill names the rank that dies and where:

* ``step``: inside the ``nth`` step of the incarnation, after forward and backward, before
  the optimizer step;
* ``save_begin`` / ``save_written``: inside the ``nth`` save, on the thread that writes it (the
  background thread of an async save), before any shard is written / once this rank's shards
  are written, before the save's agreement and marker;
* ``commit``: rank 0 about to commit the ``nth`` save (every rank's files written, no marker);
* ``load``: inside a load, once the checkpoint is verified, before DCP reads the shards;
* ``heartbeat``: rank 0's lease heartbeat thread, the ``nth`` time it renews the record,
  between writing the new record's temporary file and renaming it into place;
* ``time``: ``seconds`` after the rank's process started (a moment nobody chose).

Rank 0 of every start also appends a line to ``starts.log`` in the plan's folder: how many
starts the job took.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["POINTS", "Kill", "done_kills", "install", "kill_env", "starts", "write_plan"]

POINTS = ("step", "save_begin", "save_written", "commit", "load", "heartbeat", "time")

PLAN_VARIABLE = "OLMOLIKE_TEST_KILL_PLAN"

SITECUSTOMIZE = """\
import os, sys
if os.environ.get({variable!r}) and os.environ.get("RANK") is not None:
    sys.path.insert(0, {test_dir!r})
    import kill_points
    kill_points.install()
"""


@dataclass(frozen=True)
class Kill:
    """One kill: ``rank`` dies at the ``nth`` occurrence of ``point`` in its incarnation."""

    point: str
    rank: int = 0
    nth: int = 1
    seconds: float = 0.0
    """For ``time``: how long after the process started."""

    def __post_init__(self) -> None:
        if self.point not in POINTS:
            raise ValueError(f"unknown kill point {self.point!r}; one of {POINTS}")


def write_plan(folder: Path, kills: list[Kill]) -> Path:
    """Write the plan and the ``sitecustomize`` that installs it; returns the plan's folder."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "plan.json").write_text(json.dumps([asdict(k) for k in kills]))
    site = folder / "site"
    site.mkdir(exist_ok=True)
    test_dir = str(Path(__file__).parent)
    (site / "sitecustomize.py").write_text(
        SITECUSTOMIZE.format(variable=PLAN_VARIABLE, test_dir=test_dir)
    )
    return folder


def kill_env(folder: Path) -> dict[str, str]:
    """The variables that make every rank of a job follow the plan in ``folder``."""
    path = [str(folder / "site"), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {PLAN_VARIABLE: str(folder), "PYTHONPATH": os.pathsep.join(path)}


def done_kills(folder: Path) -> list[dict[str, Any]]:
    """The kills that happened, in order (what each ``kill-{i}.done`` recorded)."""
    done = sorted(folder.glob("kill-*.done"), key=lambda p: int(p.stem.split("-")[1]))
    return [json.loads(p.read_text()) for p in done]


def starts(folder: Path) -> int:
    """How many times the job's ranks started (rank 0's count)."""
    log = folder / "starts.log"
    return len(log.read_text().splitlines()) if log.exists() else 0


@dataclass
class _Armed:
    index: int
    kill: Kill
    folder: Path
    seen: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def at(self, point: str) -> None:
        """Called at each occurrence of ``point`` in this process: die if it is the one."""
        if point != self.kill.point:
            return
        with self.lock:
            self.seen[point] = self.seen.get(point, 0) + 1
            if self.seen[point] != self.kill.nth:
                return
        self.die()

    def die(self) -> None:
        record = {**asdict(self.kill), "pid": os.getpid(), "at": time.time()}
        record["restart"] = os.environ.get("TORCHELASTIC_RESTART_COUNT") or os.environ.get(
            "OLMOLIKE_RESTART_COUNT"
        )
        try:
            fd = os.open(
                self.folder / f"kill-{self.index}.done", os.O_WRONLY | os.O_CREAT | os.O_EXCL
            )
        except FileExistsError:
            return  # another process of this incarnation did it first (never: one rank per kill)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(record))
            f.flush()
            os.fsync(f.fileno())
        sys.stderr.write(f"KILL POINT {self.index}: rank {self.kill.rank} at {self.kill.point}\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def install() -> None:
    """In a rank: arm the plan's next kill if it is this rank's (see the module docstring)."""
    folder = Path(os.environ[PLAN_VARIABLE])
    if os.environ["RANK"] == "0":
        with open(folder / "starts.log", "a") as log:
            log.write(f"{os.getpid()}\n")
    kills = [Kill(**k) for k in json.loads((folder / "plan.json").read_text())]
    index = len(list(folder.glob("kill-*.done")))
    if index >= len(kills) or kills[index].rank != int(os.environ["RANK"]):
        return
    armed = _Armed(index, kills[index], folder)
    if armed.kill.point == "time":
        timer = threading.Timer(armed.kill.seconds, armed.die)
        timer.daemon = True
        timer.start()
        return
    _patch(armed)


def _wrap(owner: Any, name: str, before: Callable[..., None] | None = None,
          after: Callable[..., None] | None = None) -> None:  # fmt: skip
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if before is not None:
            before(*args, **kwargs)
        result = original(*args, **kwargs)
        if after is not None:
            after(*args, **kwargs)
        return result

    setattr(owner, name, wrapped)


def _patch(armed: _Armed) -> None:
    from olmolike import io
    from olmolike.train.checkpoint import checkpointer, load
    from olmolike.train.checkpoint.save import CheckpointSave
    from olmolike.train.train_module.transformer import TransformerTrainModule

    def at(point: str) -> Callable[..., None]:
        return lambda *args, **kwargs: armed.at(point)

    _wrap(TransformerTrainModule, "train_batch", after=at("step"))
    _wrap(checkpointer, "save_local", before=at("save_begin"), after=at("save_written"))
    _wrap(CheckpointSave, "_commit", before=at("commit"))
    _wrap(load, "load_state_dict", before=at("load"))

    def fsync(path: Path) -> None:
        if threading.current_thread().name == "lease-heartbeat" and path.name.endswith(".tmp"):
            armed.at("heartbeat")

    _wrap(io, "fsync_path", after=fsync)
