"""A restart finishes the run, unattended.

Under ``torchrun --max-restarts 3`` and ``olmolike train --max-restarts 3``, ranks are
SIGKILLed three times at chosen moments (:mod:`kill_points`: inside a step, an async save, a
commit, a load, the lease heartbeat), each time in a new start of the job. The job must reach
its last step with no human step, with the model and optimizer state of a run that was never
interrupted, bit for bit; each start must take the save folder's lease back at once (its
log says why; never that the killed run's lease went stale), and nothing a killed save left
may stay behind.

The launchers and ranks run under :mod:`preloaded_python`'s stand-in for ``python`` (forked
with torch imported, each kill point installed by the plan's ``sitecustomize`` as in a fresh
interpreter): a rank's start costs a fork instead of ~5 CPU s of imports, for 34 starts of a
rank or launcher per test file (204 CPU s before, 63 after).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import preloaded_python
import pytest
import torch
from kill_points import Kill, done_kills, kill_env, starts, write_plan
from testutils import patient

from olmolike.data import prepare_data
from olmolike.data.numpy_data_loader import NumpyDataLoaderConfig
from olmolike.data.numpy_dataset import NumpyDatasetConfig
from olmolike.distributed.checkpoint_reader import load_keys
from olmolike.experiment import ExperimentConfig
from olmolike.nn import TransformerConfig
from olmolike.train import Duration, TrainerConfig
from olmolike.train.callbacks import CheckpointerCallback
from olmolike.train.checkpoint import Checkpointer
from olmolike.train.train_module import TransformerTrainModuleConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

STEPS = 6
SEQ = 32
LEASE_TIMEOUT = 1.2
"""Seconds: a heartbeat every 0.2 s, so that one is killed within a short run on any machine."""


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("data")
    text = folder / "corpus.txt"
    text.write_text("".join(f"line {i}: the quick brown fox jumps over {i}\n" for i in range(300)))
    prepare_data([text], folder / "tokens")
    return folder / "tokens"


def write_experiment(folder: Path, tokens: Path) -> Path:
    """A 75k-parameter model, 6 steps, an async save every step (ephemeral ones between the
    permanent ones at steps 3 and 6, so that retention removes checkpoints too)."""
    config = ExperimentConfig(
        run_name="restarts",
        model=TransformerConfig(
            vocab_size=272, d_model=32, n_layers=2, n_heads=4, max_sequence_length=SEQ
        ),
        dataset=NumpyDatasetConfig(paths=[str(tokens)], sequence_length=SEQ),
        data_loader=NumpyDataLoaderConfig(global_batch_size=4 * SEQ, seed=0),
        train_module=TransformerTrainModuleConfig(rank_microbatch_size=SEQ),
        trainer=TrainerConfig(
            save_folder=str(folder / "run"),
            work_dir=str(folder / "work"),
            max_duration=Duration.steps(STEPS),
            callbacks={
                "checkpointer": CheckpointerCallback(
                    save_interval=3, ephemeral_save_interval=1, save_async=True
                )
            },
        ),
    )
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "experiment.yaml"
    path.write_text(config.to_yaml())
    return path


def torchrun(ranks: int, restarts: int) -> list[str]:
    """``torchrun --standalone`` with its agent and ranks under :mod:`preloaded_python`'s
    stand-in for ``python``: each start of a rank costs a fork, not an import of torch."""
    options = ["--standalone", f"--nproc-per-node={ranks}", f"--max-restarts={restarts}"]
    return [*preloaded_python.torchrun(*options), "-m", "olmolike", "train"]


LAUNCH = (
    "import runpy, sys; sys.executable = sys.argv.pop(1); "
    "runpy.run_module('olmolike', run_name='__main__', alter_sys=True)"
)
"""``python -m olmolike`` whose ``sys.executable`` (what the launcher starts its ranks with) is
the stand-in's command, passed as the first argument."""


def launcher(folder: Path, ranks: int, restarts: int) -> list[str]:
    """``python -m olmolike train --nproc-per-node ...``: the launcher and the ranks it starts
    under :mod:`preloaded_python`'s stand-in for ``python``."""
    python = folder / "python"
    python.write_text(f'#!/bin/sh\nexec {shlex.join(preloaded_python.command())} "$@"\n')
    python.chmod(0o755)
    return [
        *preloaded_python.command(), "-c", LAUNCH, str(python), "train",
        f"--nproc-per-node={ranks}", f"--max-restarts={restarts}",
    ]  # fmt: skip


def run_job(command: list[str], env: dict[str, str], timeout: float, log: Path) -> str:
    """Run a job to its end; its output (also written to ``log``). A job still running after
    ``timeout`` seconds (:func:`patient`) is killed with every process it started, and fails
    the test."""
    job = subprocess.Popen(
        command,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = job.communicate(timeout=patient(timeout))
    except subprocess.TimeoutExpired:
        for pid in [job.pid, *descendants(job.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        output, _ = job.communicate()
        log.write_text(output)
        raise AssertionError(
            f"the job hung: still running after {patient(timeout):.0f}s:\n{output[-6000:]}"
        ) from None
    log.write_text(output)
    assert job.returncode == 0, f"the job failed ({job.returncode}):\n{output[-6000:]}"
    return output


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (the ranks run in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def final_state(run: Path) -> dict[str, object]:
    """The last checkpoint's model and optimizer state, flattened (one plain process)."""
    path = Checkpointer.latest_checkpoint(str(run))
    assert path.endswith(f"step{STEPS}"), path
    flat: dict[str, object] = {}

    def add(prefix: str, value: object) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                add(f"{prefix}.{key}", item)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                add(f"{prefix}.{i}", item)
        else:
            flat[prefix] = value

    for key, value in zip(("model", "optim"), load_keys(path, ["model", "optim"]), strict=True):
        add(key, value)
    return flat


def assert_same_state(resumed: dict[str, object], reference: dict[str, object]) -> None:
    assert resumed.keys() == reference.keys()
    differing = [
        key
        for key, value in reference.items()
        if not (
            torch.equal(value, resumed[key])  # type: ignore[arg-type]
            if isinstance(value, torch.Tensor)
            else value == resumed[key]
        )
    ]
    assert not differing, f"differs from the uninterrupted run: {differing[:10]}"


def check_restarted_run(
    folder: Path, output: str, kills: list[Kill], reference: dict[str, object]
) -> None:
    """Every kill happened, one per start; the run ended complete, equal to the reference,
    clean; every start took the lease at once."""
    done = done_kills(folder / "kills")
    assert [(d["point"], d["rank"]) for d in done] == [(k.point, k.rank) for k in kills], output[
        -6000:
    ]
    assert [d["restart"] for d in done] == ["0", "1", "2"]  # a new start for each kill
    assert starts(folder / "kills") == len(kills) + 1, "a start failed without a planned kill"
    assert_same_state(final_state(folder / "run"), reference)
    run = folder / "run"
    leftovers = [
        p.name
        for p in run.iterdir()
        if p.name.startswith((".step", ".purging-"))
        or (p.name.startswith("step") and not Checkpointer.dir_is_checkpoint(str(p)))
    ]
    assert not leftovers, f"a killed save left {leftovers}"
    assert output.count("Holding the lease on") == len(kills) + 1
    assert "older than lease_timeout" not in output, "a start waited for a lease to go stale"
    assert "Traceback" not in output, output[-6000:]


def restarted_run(
    tmp_path: Path,
    tokens: Path,
    command: list[str],
    layout: list[str],
    kills: list[Kill],
    timeout: float,
) -> None:
    """Run the job uninterrupted, then again with ``kills``; compare."""
    started = time.monotonic()
    reference_dir, killed_dir = tmp_path / "reference", tmp_path / "killed"
    overrides = [*layout, f"--trainer.checkpointer.lease_timeout={LEASE_TIMEOUT}"]
    experiment = write_experiment(reference_dir, tokens)
    run_job([*command, str(experiment), *overrides], {}, timeout, reference_dir / "job.log")
    reference = final_state(reference_dir / "run")
    plan = write_plan(killed_dir / "kills", kills)
    experiment = write_experiment(killed_dir, tokens)
    command = [*command, str(experiment), *overrides]
    output = run_job(command, kill_env(plan), timeout * 4, killed_dir / "job.log")
    check_restarted_run(killed_dir, output, kills, reference)
    print(f"{len(kills)} kills {[k.point for k in kills]}: {time.monotonic() - started:.0f}s")


FSDP = ["--train_module.dp_config.name=fsdp"]


def test_torchrun_restarts_two_fsdp_ranks_killed_in_a_save_a_load_and_a_heartbeat(
    tmp_path: Path, tokens: Path
) -> None:
    kills = [
        Kill("save_written", rank=1, nth=3),  # the async save of step 2, its shards written
        Kill("load", rank=0),  # resuming from step 1
        Kill("heartbeat", rank=0, nth=2),  # mid-write of the lease record (during the load)
    ]
    restarted_run(tmp_path, tokens, torchrun(2, 3), FSDP, kills, timeout=120)


def test_olmolike_train_restarts_four_tp_fsdp_ranks_killed_in_a_step_a_commit_and_a_save(
    tmp_path: Path, tokens: Path
) -> None:
    layout = [*FSDP, "--train_module.tp_config.degree=2"]
    kills = [
        Kill("step", rank=2, nth=2),  # after forward and backward of step 2
        Kill("commit", rank=0, nth=3),  # resumed at step 1: step 4's save, every file written
        Kill("save_begin", rank=3, nth=2),  # resumed at step 3: step 5's, no shard written
    ]
    restarted_run(tmp_path, tokens, launcher(tmp_path, 4, 3), layout, kills, timeout=180)
