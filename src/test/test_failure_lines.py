"""When something dies, each rank left prints one line: what died, how, and where to resume.

These tests look at the output itself (the lines a user sees, the exit status), from real
processes: a rank killed with SIGKILL, a save that fills a real (small tmpfs) disk, a second
Ctrl-C. Progress records (INFO) are not failure output and are left out of the count.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import preloaded_python
import pytest
from testutils import free_port, patient, start_ranks

from olmolike.train.checkpoint import Checkpointer

TEST_DIR = str(Path(__file__).parent)
INFO = re.compile(r"^\S+ \S+ (\[rank\d+\] )?INFO ")


def _python() -> list[str]:
    """``python`` for the scripts: :mod:`preloaded_python`'s stand-in whose commands end as
    the interpreter ends (the one line at exit is the subject). The launchers' tests run
    the real one: the ranks' parenthood (``_rank_pids``, an unreaped rank) is their subject;
    so does the full disk's, whose command runs in a namespace of its own."""
    return preloaded_python.command(real_exit=True)


def failure_lines(output: str) -> list[str]:
    """The lines of ``output`` that are not progress records."""
    return [line for line in output.splitlines() if line.strip() and not INFO.match(line)]


def run(command: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=patient(150),
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": _python_path(), **env},
    )


def _python_path() -> str:
    src = str(Path(TEST_DIR).parent)
    return os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])


def _output_of(
    rank: subprocess.Popen[str], ranks: list[subprocess.Popen[str]], timeout: float
) -> str:
    """``rank``'s output once it ends; then every one of ``ranks`` is killed and reaped,
    whatever happened (a rank waiting on a dead peer would otherwise outlive the test)."""
    try:
        output, _ = rank.communicate(timeout=patient(timeout))
    finally:
        for other in ranks:
            other.kill()
            other.communicate()
    return output


# -- a rank killed with SIGKILL -------------------------------------------------------------

KILLED_SCRIPT = """
import os, signal, sys
sys.path.insert(0, {test_dir!r})
from testutils import build_trainer
from olmolike.distributed.utils import get_rank
from olmolike.train import Callback, Duration, prepare_training_environment
from olmolike.train.callbacks.checkpointer import CheckpointerCallback


class Kill(Callback):
    def pre_step(self, batch):
        if self.step == 5 and get_rank() == int(sys.argv[2]):
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    prepare_training_environment(seed=0)
    callbacks = {{"checkpointer": CheckpointerCallback(save_interval=2), "kill": Kill()}}
    build_trainer(sys.argv[1], max_duration=Duration.steps(100), callbacks=callbacks).fit()
"""

LOST_RANK_LINE = re.compile(
    r"error: rank (?P<lost>\d) \(pid \d+\) (was killed by SIGKILL|is gone); rank (?P<left>\d) "
    r"stopped at step \d+; "
    r"the last complete checkpoint is (?P<checkpoint>\S+): run the same command again to "
    r"resume \(full traceback: (?P<traceback>\S+)\)"
)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("killed", [1, 0], ids=["rank1", "rank0-holding-the-store"])
def test_a_killed_rank_is_one_line_on_the_rank_left(tmp_path: Path, killed: int) -> None:
    """Before: 33-98 lines on the rank left with gloo's raw traceback ("Connection closed by
    peer", naming no rank), and no checkpoint named. Rank 0 holds the job's store: the rank
    left must not call it once rank 0 is gone (each call prints a C++ stack trace)."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(KILLED_SCRIPT.format(test_dir=TEST_DIR)))
    ranks = start_ranks([*_python(), str(script), str(tmp_path / "run"), str(killed)])
    left = ranks[1 - killed]
    output = _output_of(left, ranks, timeout=150)
    assert ranks[killed].returncode == -signal.SIGKILL
    assert left.returncode == 1
    lines = failure_lines(output)
    assert len(lines) == 1, output
    (line,) = lines
    found = LOST_RANK_LINE.fullmatch(line)
    assert found and found["lost"] == str(killed) and found["left"] == str(1 - killed), line
    latest = list(Checkpointer.find_checkpoints(tmp_path / "run"))[-1][1]
    assert found["checkpoint"] == latest
    details = Path(found["traceback"]).read_text()  # gloo's error, kept for debugging
    assert "Traceback (most recent call last)" in details and "peer" in details


END_SCRIPT = """
import os, signal, sys
import torch.distributed as dist
from olmolike.train import prepare_training_environment, teardown_training_environment

prepare_training_environment()
dist.barrier()  # every rank's monitor knows every rank's process (and so the store's)
if dist.get_rank() == int(sys.argv[1]):
    os.kill(os.getpid(), signal.SIGKILL)
teardown_training_environment()
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("killed", [1, 0], ids=["rank1", "rank0-holding-the-store"])
def test_a_rank_killed_before_the_teardown_barrier_is_one_line(tmp_path: Path, killed: int) -> None:
    """The teardown's barrier meets a dead rank. Before: gloo's raw traceback from the
    barrier, naming no rank; and with rank 0 dead, the rank left called itself rank 0 (it
    read its rank after its groups had ended)."""
    script = tmp_path / "end.py"
    script.write_text(END_SCRIPT)
    ranks = start_ranks([*_python(), str(script), str(killed)])
    left = 1 - killed
    output = _output_of(ranks[left], ranks, timeout=120)
    assert ranks[left].returncode == 1
    (line,) = failure_lines(output)
    assert re.fullmatch(
        rf"error: rank {killed} \(pid \d+\) (was killed by SIGKILL|is gone); rank {left} was "
        r"ending its run \(full traceback: \S+\)",
        line,
    ), line


def _rank_pids(launcher: int) -> dict[int, int]:
    """The ranks torchrun ``launcher`` started: rank -> pid (from their environments)."""
    pids = {}
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) != launcher:
                continue
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        for item in env:
            if item.startswith(b"RANK="):
                pids[int(item[5:])] = int(entry.name)
    return pids


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_rank_under_torchrun_is_one_line_then_torchrun_s_summary(
    tmp_path: Path, experiment_file: Path
) -> None:
    """``torchrun -m olmolike train``: rank 0 prints the one line and no traceback; what
    follows is torchrun's own summary (see docs/distributed-failures.md). Before: 480 lines
    with three raw tracebacks from the ranks."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2"]
    command = [*torchrun, f"--master-port={free_port()}", "-m", "olmolike", "train"]
    returncode, output = _kill_rank_1_after_step_2([*command, str(experiment_file)], tmp_path)
    assert returncode != 0
    ours = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(ours) == 1 and LOST_RANK_LINE.fullmatch(ours[0]), output[-3000:]
    assert "[rank0]" not in output.replace("[rank0] INFO", "")  # no rank's traceback
    assert output.count("Traceback (most recent call last)") <= 1  # torchrun's own
    # torchrun's summary shows rank 0's line (from its error file), not "To enable traceback".
    assert f"traceback : {ours[0]}" in output or "exitcode  : -15" in output, output[-3000:]


@pytest.mark.timeout(300)
def test_a_killed_rank_under_olmolike_s_own_launcher_is_the_whole_output(
    tmp_path: Path, experiment_file: Path
) -> None:
    """``olmolike train --nproc-per-node 2``: the rank left's line is all the failure output
    (no launcher report), and it names the signal: the launcher keeps the dead rank unreaped
    until the others ended, so they can read how it ended."""
    command = [sys.executable, "-m", "olmolike", "train", "--nproc-per-node=2"]
    returncode, output = _kill_rank_1_after_step_2([*command, str(experiment_file)], tmp_path)
    assert returncode == 128 + signal.SIGKILL
    (line,) = failure_lines(output)
    found = LOST_RANK_LINE.fullmatch(line)
    assert found and "was killed by SIGKILL" in line, line
    assert found["checkpoint"] == list(Checkpointer.find_checkpoints(tmp_path / "run"))[-1][1]


def _kill_rank_1_after_step_2(command: list[str], tmp_path: Path) -> tuple[int, str]:
    """Run the launcher ``command`` (two ranks saving into ``tmp_path/run``), SIGKILL its
    rank 1 once step 2 is saved, and return the launcher's exit status and output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": _python_path()}
    launcher = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        _wait_for(lambda: (tmp_path / "run" / "step2").exists() or launcher.poll() is not None)
        os.kill(_rank_pids(launcher.pid)[1], signal.SIGKILL)
        output, _ = launcher.communicate(timeout=patient(150))
    finally:
        launcher.kill()
        launcher.communicate()
    return launcher.returncode, output


def _wait_for(condition: object) -> None:
    import time

    deadline = time.monotonic() + patient(150)
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "the run did not get there in time"
        time.sleep(0.05)


@pytest.fixture
def experiment_file(tmp_path: Path) -> Path:
    """A tiny `olmolike train` experiment that saves every 2 steps and runs long."""
    return write_experiment(tmp_path)


def write_experiment(tmp_path: Path) -> Path:
    """:func:`experiment_file`'s file, written into ``tmp_path``."""
    from olmolike.data import prepare_data
    from olmolike.data.numpy_data_loader import NumpyDataLoaderConfig
    from olmolike.data.numpy_dataset import NumpyDatasetConfig
    from olmolike.experiment import ExperimentConfig
    from olmolike.nn import TransformerConfig
    from olmolike.optim import AdamWConfig
    from olmolike.train import Duration, TrainerConfig
    from olmolike.train.callbacks import CheckpointerCallback
    from olmolike.train.train_module import TransformerTrainModuleConfig

    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(300)))
    data = prepare_data([text], tmp_path / "data")
    config = ExperimentConfig(
        run_name="dies",
        model=TransformerConfig(
            vocab_size=data.vocab_size, d_model=16, n_layers=1, n_heads=2, max_sequence_length=32
        ),
        dataset=NumpyDatasetConfig(paths=data.paths("train"), sequence_length=32),
        data_loader=NumpyDataLoaderConfig(global_batch_size=4 * 32, seed=0),
        train_module=TransformerTrainModuleConfig(
            rank_microbatch_size=2 * 32, optim=AdamWConfig(lr=1e-3)
        ),
        trainer=TrainerConfig(
            save_folder=str(tmp_path / "run"),
            max_duration=Duration.steps(100_000),
            callbacks={"checkpointer": CheckpointerCallback(save_interval=2)},
        ),
    )
    path = tmp_path / "experiment.yaml"
    path.write_text(config.to_yaml())
    return path


# -- a full disk ----------------------------------------------------------------------------

DISK_SCRIPT = """
import sys
sys.path.insert(0, {test_dir!r})
from testutils import build_trainer
from olmolike.train import Duration, prepare_training_environment
from olmolike.train.callbacks.checkpointer import CheckpointerCallback

if __name__ == "__main__":
    prepare_training_environment(seed=0)
    saving = CheckpointerCallback(save_interval=2, save_async=sys.argv[2] == "async")
    build_trainer(sys.argv[1], max_duration=Duration.steps(20), callbacks={{"c": saving}}).fit()
"""


def _can_mount_a_small_disk() -> bool:
    """Whether this user may mount a tmpfs in a user namespace (``unshare -rm``): a real,
    small filesystem, full when it is full, without root."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
        capture_output=True,
    )
    return probe.returncode == 0


@pytest.mark.skipif(not _can_mount_a_small_disk(), reason="no user namespaces to mount a tmpfs")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_full_disk_during_a_save_is_one_line(tmp_path: Path, mode: str) -> None:
    """A 1.2 MB disk: step0 and step2 fit, step4 does not. Before: 17 (sync) and 44 (async)
    lines, the async one with a raw traceback of DCP's writer thread ending in "enforce fail
    ... unexpected pos", and no free space or needed size named."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(DISK_SCRIPT.format(test_dir=TEST_DIR)))
    disk = tmp_path / "disk"
    disk.mkdir()
    run_dir = disk / "run"
    # The run and a copy of what it left, inside the namespace that sees the small disk.
    shell = (
        f"mount -t tmpfs -o size=1200k tmpfs {disk} && "
        f"{sys.executable} {script} {run_dir} {mode}; status=$?; "
        f"cp -a {run_dir} {tmp_path}/left; exit $status"
    )
    result = run(["unshare", "-rm", "sh", "-c", shell])
    assert result.returncode == 1, result.stdout[-3000:]
    (line,) = failure_lines(result.stdout)
    assert line.startswith(
        f"error: no space left on the disk of {run_dir}: saving {run_dir}/step4 failed on rank 0: "
        "OSError: [Errno 28] No space left on device, left "
        f"incomplete (no marker); a checkpoint needs about "
    ), line
    assert re.search(
        r"needs about [\d.]+ KiB \(the size of \S+/step2\) and [\d.]+ KiB are free", line
    )
    assert f"the last complete checkpoint is {run_dir}/step2: free space" in line
    left = tmp_path / "left"
    assert [step for step, _ in Checkpointer.find_checkpoints(left)] == [0, 2]
    assert not (left / "step4").exists() and not (left / ".step4.tmp").exists()


# -- a second Ctrl-C ------------------------------------------------------------------------

CTRL_C_SCRIPT = """
import atexit, os, signal, sys
sys.path.insert(0, {test_dir!r})
from testutils import build_trainer
from olmolike.train import Callback, Duration, prepare_training_environment
from olmolike.train.callbacks.checkpointer import CheckpointerCallback

when = sys.argv[2]


class FirstCtrlC(Callback):
    def post_step(self):
        if self.step == 3:
            os.kill(os.getpid(), signal.SIGINT)


if __name__ == "__main__":
    prepare_training_environment(seed=0)
    callbacks = {{"checkpointer": CheckpointerCallback(save_interval=2), "first": FirstCtrlC()}}
    trainer = build_trainer(sys.argv[1], max_duration=Duration.steps(50), callbacks=callbacks)
    state_dict_to_save = trainer.train_module.state_dict_to_save

    def second_ctrl_c_in_the_final_save():
        if trainer.is_canceled:
            os.kill(os.getpid(), signal.SIGINT)
        return state_dict_to_save()

    if when == "save":
        trainer.train_module.state_dict_to_save = second_ctrl_c_in_the_final_save
    else:  # once the run is saved, canceled and on its way out
        atexit.register(os.kill, os.getpid(), signal.SIGINT)
    trainer.fit()
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("when", ["save", "exit"])
def test_a_second_ctrl_c_is_one_line_naming_the_last_checkpoint(tmp_path: Path, when: str) -> None:
    """Before: during the save, "interrupted: second SIGINT: aborting without a graceful stop"
    without the checkpoint (named only in a log record above it); while exiting, a 10-line
    traceback from an ``atexit`` callback after the line."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(CTRL_C_SCRIPT.format(test_dir=TEST_DIR)))
    result = run([*_python(), str(script), str(tmp_path / "run"), when])
    assert result.returncode in (130, -signal.SIGINT), result.stdout[-3000:]
    lines = failure_lines(result.stdout)
    # The first Ctrl-C's records: it asked to cancel, and the run stopped at step 3.
    assert "asks to cancel the run: received SIGINT" in lines[0]
    assert "Run canceled at step 3" in lines[1]
    (line,) = lines[2:]
    latest = list(Checkpointer.find_checkpoints(tmp_path / "run"))[-1][1]
    if when == "save":
        expected = "interrupted: second SIGINT during a checkpoint save at step 3 (left incomplete)"
        assert latest.endswith("step2")
    else:
        expected = "interrupted: run canceled at step 3 (received SIGINT)"
        assert latest.endswith("step3")
    assert line.startswith(f"{expected}; the last complete checkpoint is {latest}: run the same")
    assert "Traceback" not in result.stdout


SLOW_SAVE_SCRIPT = """
import atexit, os, signal, sys, time
sys.path.insert(0, {test_dir!r})
from testutils import build_trainer
from olmolike.train import Callback, Duration, prepare_training_environment
from olmolike.train.callbacks.checkpointer import CheckpointerCallback
from olmolike.train.checkpoint import save


class TwoCtrlCs(Callback):
    # What the launcher passes on to every rank: a Ctrl-C, then another, at step 5, while
    # the async save of step 4 is still being written.
    def post_step(self):
        if self.step == 5:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)


write_synced = save.write_synced


def slowly(path, data):
    if "step4" in str(path):
        time.sleep(2)
    write_synced(path, data)


if __name__ == "__main__":
    prepare_training_environment(seed=0)
    save.write_synced = slowly
    # Exit handlers that take their time (a logger's upload, say): the process outlives the
    # save in flight, whose marker lands before it exits.
    atexit.register(time.sleep, 5)
    saving = CheckpointerCallback(save_interval=2, save_async=True)
    callbacks = {{"checkpointer": saving, "ctrl_c": TwoCtrlCs()}}
    build_trainer(sys.argv[1], max_duration=Duration.steps(50), callbacks=callbacks).fit()
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_second_ctrl_c_names_the_checkpoint_an_async_save_in_flight_completes(
    tmp_path: Path,
) -> None:
    """Two ranks, a second Ctrl-C while the async save of step 4 is still being written: the
    one line of the job names the newest checkpoint that is complete once the job ended.
    Before: it named step 2 (composed at once), and step 4's marker landed after it."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SLOW_SAVE_SCRIPT.format(test_dir=TEST_DIR)))
    ranks = start_ranks([*_python(), str(script), str(tmp_path / "run")])
    try:
        outputs = [rank.communicate(timeout=patient(200))[0] for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
            rank.communicate()
    assert [rank.returncode for rank in ranks] == [130, 130], outputs
    lines = [line for out in outputs for line in failure_lines(out)]
    said = [line for line in lines if line.startswith("interrupted: ")]
    assert len(said) == 1, lines  # the job's first failing rank alone
    latest = list(Checkpointer.find_checkpoints(tmp_path / "run"))[-1][1]
    assert latest.endswith("step4")
    assert said[0].startswith(
        f"interrupted: second SIGINT during step 5; the last complete checkpoint is {latest}: "
    ), said[0]


def test_a_writer_thread_that_fails_fails_the_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's writer lets an extra writing thread die on a full disk and returns the other
    threads' results as a success: the checkpoint would be marked complete without those
    tensors. Before: the save returned normally with one shard file's tensors missing."""
    import errno

    import torch
    import torch.distributed.checkpoint as dcp

    from olmolike.distributed import checkpoint_save
    from olmolike.distributed.checkpoint_save import dcp_writer

    open_file = checkpoint_save._ShardFile.__init__

    def full_for_the_first_shard(self: object, path: str, mode: str) -> None:
        if str(path).endswith("__0_0.distcp"):  # a real write fails: raise from the open
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        open_file(self, path, mode)  # type: ignore[arg-type]

    monkeypatch.setattr(checkpoint_save._ShardFile, "__init__", full_for_the_first_shard)
    state = {f"t{i}": torch.randn(100) for i in range(8)}
    with pytest.raises(BaseException, match=r"\[Errno 28\] No space left on device"):
        dcp.save(state, storage_writer=dcp_writer(tmp_path, thread_count=2))
    assert not (tmp_path / ".metadata").exists()
