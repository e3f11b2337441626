"""SIGKILL at chosen points inside synchronous and asynchronous saves.

A training process is killed while it saves; the next start must find only complete
checkpoints, resume from the latest one, and end with exactly the weights of a run that was
never interrupted.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import preloaded_python
import pytest
import torch
from testutils import patient

from olmolike.train.checkpoint import MARKER, Checkpointer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 6
KILL_STEP = 4

# The kill points, by what has happened to the checkpoint of step 4 when the process dies.
KILL_POINTS = {
    "shards_written": 0,  # model/optimizer shards on disk, no trainer state, no marker
    "state_written": 0,  # every rank's files landed, the marker not yet written
    "marker_written": 0,  # marker written in the staging folder, not yet renamed into place
    "committed": 1,  # renamed into place: step 4 is complete
}

SCRIPT = """
import json, os, signal, sys
sys.path.insert(0, {test_dir!r})
import torch
from testutils import build_trainer
from olmolike import io
from olmolike.train import Callback, Duration, prepare_training_environment
from olmolike.train.checkpoint import checkpointer as ckpt
from olmolike.train.checkpoint.save import CheckpointSave
from olmolike.train.callbacks import CheckpointerCallback

kill_point, mode, save, out = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]

def die_at(point, where):
    # Keyed on the checkpoint being written: async saves finish while later steps run.
    if point == kill_point and "step{kill_step}" in str(where):
        os.kill(os.getpid(), signal.SIGKILL)

def wrap(owner, name, point, before=False):
    original = getattr(owner, name)
    def wrapped(*args, **kwargs):
        where = [getattr(a, "target", a) for a in args]
        if before:
            die_at(point, where)
        result = original(*args, **kwargs)
        if not before:
            die_at(point, where)
        return result
    setattr(owner, name, wrapped)

# Blocking or in the background (on the save's thread), the shards are written by save_local.
wrap(ckpt, "save_local", "shards_written")
wrap(CheckpointSave, "_commit", "state_written", before=True)
original_write = io.write_file
def write_then_die(dir, name, contents, **kwargs):
    path = original_write(dir, name, contents, **kwargs)
    if name == ckpt.MARKER:
        die_at("marker_written", dir)
    return path
io.write_file = write_then_die
wrap(CheckpointSave, "finish", "committed")

class Losses(Callback):
    def log_metrics(self, step, metrics):
        LOSSES[step] = metrics["train/CE loss"]

LOSSES = {{}}

if __name__ == "__main__":
    prepare_training_environment(seed=0)
    callbacks = {{
        "checkpointer": CheckpointerCallback(save_interval=2, save_async=mode == "async"),
        "losses": Losses(),
    }}
    trainer = build_trainer(save, num_instances=48, max_duration=Duration.steps({steps}), callbacks=callbacks)
    trainer.fit()
    torch.save([p.detach() for p in trainer.train_module.model.parameters()], out)
    with open(out + ".losses.json", "w") as f:
        json.dump(LOSSES, f)
"""


def launch(script: Path, kill_point: str, mode: str, save: Path, out: Path) -> int:
    # A real process that SIGKILL ends, forked with torch imported (preloaded_python).
    result = subprocess.run(
        [*preloaded_python.command(), str(script), kill_point, mode, str(save), str(out)],
        capture_output=True,
        text=True,
        timeout=patient(180),
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if result.returncode not in (0, -9):
        raise AssertionError(f"training failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return result.returncode


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("crash") / "train.py"
    test_dir = str(Path(__file__).parent)
    path.write_text(
        textwrap.dedent(SCRIPT.format(test_dir=test_dir, kill_step=KILL_STEP, steps=STEPS))
    )
    return path


def losses(out: Path) -> dict[int, float]:
    return {int(k): v for k, v in json.loads(Path(f"{out}.losses.json").read_text()).items()}


@pytest.fixture(scope="module")
def reference(
    script: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[list[torch.Tensor], dict[int, float]]:
    folder = tmp_path_factory.mktemp("reference")
    assert launch(script, "none", "sync", folder / "run", folder / "params.pt") == 0
    return torch.load(folder / "params.pt", weights_only=True), losses(folder / "params.pt")


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("kill_point", list(KILL_POINTS))
def test_killed_during_a_save_resumes_from_the_latest_complete_checkpoint(
    script: Path,
    reference: tuple[list[torch.Tensor], dict[int, float]],
    tmp_path: Path,
    mode: str,
    kill_point: str,
) -> None:
    save, out = tmp_path / "run", tmp_path / "params.pt"
    assert launch(script, kill_point, mode, save, out) == -9, "the kill point was never reached"
    steps = [s for s, _ in Checkpointer.find_checkpoints(save)]
    assert steps == [0, 2, 4][: 2 + KILL_POINTS[kill_point]]
    for _, path in Checkpointer.find_checkpoints(save):
        assert (Path(path) / MARKER).exists() and (Path(path) / "train" / "rank0.pt").exists()

    resume_step = steps[-1]
    assert launch(script, "none", mode, save, out) == 0
    assert [s for s, _ in Checkpointer.find_checkpoints(save)][-1] == STEPS
    reference_params, reference_losses = reference
    resumed = torch.load(out, weights_only=True)
    assert all(torch.equal(a, b) for a, b in zip(resumed, reference_params))
    after = {s: v for s, v in reference_losses.items() if s > resume_step}
    assert losses(out) == after  # every step after the checkpoint, bit for bit
