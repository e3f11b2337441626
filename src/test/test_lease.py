"""One writer per save folder: the lease, on a local disk, the GCS emulator and moto S3.

A second run is refused with a message naming the first (and never told to set
save_overwrite); a dead run's lease is taken over; runs starting together get exactly one
winner; the heartbeat keeps a lease live and notices a takeover; a trainer releases its lease
when it ends, cleanly or not.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import preloaded_python
import pytest
from remote_servers import RemoteStore
from testutils import build_trainer, patient

from olmolike.exceptions import CheckpointError
from olmolike.train import Callback, Duration
from olmolike.train.checkpoint.lease import (
    LEASE_DIR,
    SaveFolderInUseError,
    SaveFolderLease,
    current_lease,
    run_id,
)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(params=["local", "gs", "s3"])
def folder(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A save folder on a local disk, the GCS emulator or moto S3."""
    if request.param == "local":
        return str(tmp_path / "run")
    store: RemoteStore = request.getfixturevalue(f"{request.param}_bucket".replace("gs_", "gcs_"))
    return store.url("run")


def records(folder: str) -> list[dict[str, object]]:
    from olmolike import io

    lease_dir = io.join_path(folder, LEASE_DIR)
    return [json.loads(io.read_bytes(io.join_path(lease_dir, n))) for n in io.list_dir(lease_dir)]


def test_a_second_run_is_refused_with_a_message_naming_the_first(folder: str) -> None:
    first = SaveFolderLease(folder, run="run-one")
    first.acquire()
    try:
        second = SaveFolderLease(folder, run="run-two")
        with pytest.raises(SaveFolderInUseError) as error:
            second.acquire()
        message = str(error.value)
        assert "run-one" in message and folder in message
        assert "save_overwrite" not in message
        assert current_lease(folder) is not None
    finally:
        first.release()
    # Released: the next run takes it at once, and the record says who holds it now.
    second.acquire()
    second.release()
    assert [r["run_id"] for r in records(folder)] == ["run-two"]
    assert records(folder)[0]["released"] is True


def test_runs_starting_together_get_exactly_one_winner(folder: str) -> None:
    contenders = [SaveFolderLease(folder, run=f"run-{i}") for i in range(4)]
    start = threading.Barrier(len(contenders))
    outcomes: dict[str, str] = {}

    def contend(lease: SaveFolderLease) -> None:
        start.wait(timeout=patient(60))
        try:
            lease.acquire()
            outcomes[lease.run_id] = "won"
        except SaveFolderInUseError as e:
            outcomes[lease.run_id] = f"refused: {e}"

    threads = [threading.Thread(target=contend, args=(lease,)) for lease in contenders]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=patient(120))
    assert not any(t.is_alive() for t in threads), "an acquire hung"
    winners = [run for run, outcome in outcomes.items() if outcome == "won"]
    assert len(winners) == 1, outcomes
    for run, outcome in outcomes.items():
        if run != winners[0]:
            assert winners[0] in outcome  # the refusal names the run that won
    for lease in contenders:
        lease.release()


def write_record(folder: str, **fields: object) -> None:
    from olmolike import io

    now = time.time()
    record = {
        "run_id": "old-run",
        "host": "some-other-host",
        "pid": 1,
        "started_at": now - 1000,
        "heartbeat_at": now,
        "timeout": 60.0,
        "released": False,
        **fields,
    }
    io.write_file(
        io.join_path(folder, LEASE_DIR), "0000000007.json", json.dumps(record), overwrite=True
    )


def test_a_live_lease_on_another_host_is_respected(folder: str) -> None:
    write_record(folder)
    with pytest.raises(SaveFolderInUseError, match=r"old-run.*some-other-host"):
        SaveFolderLease(folder, run="new-run").acquire()


def test_a_stale_lease_is_taken_over_with_a_warning(
    folder: str, caplog: pytest.LogCaptureFixture
) -> None:
    write_record(folder, heartbeat_at=time.time() - 600)  # older than its 60 s timeout
    lease = SaveFolderLease(folder, run="new-run")
    lease.acquire()
    assert "Taking over the lease" in caplog.text and "old-run" in caplog.text
    assert "its last heartbeat is older than lease_timeout=60s" in caplog.text
    assert [r["run_id"] for r in records(folder)] == ["new-run"]  # the old record is gone
    lease.release()


def test_the_heartbeat_keeps_the_lease_live_and_notices_a_takeover(tmp_path: Path) -> None:
    folder = str(tmp_path / "run")
    lease = SaveFolderLease(folder, run="beating", timeout=3.0)
    lease.acquire()
    try:
        first = records(folder)[0]["heartbeat_at"]
        deadline = time.monotonic() + 60
        while records(folder)[0]["heartbeat_at"] == first:  # wait for two renewals
            assert time.monotonic() < deadline, "no heartbeat within 60 s"
            time.sleep(0.05)
        holder = current_lease(folder)
        assert holder is not None and holder.run_id == "beating"
        # Another run decided this one was dead and took over: the next beat notices.
        write_record(folder, run_id="taker", host="elsewhere", heartbeat_at=time.time() + 1000)
        os.replace(
            Path(folder, LEASE_DIR, "0000000007.json"), Path(folder, LEASE_DIR, "0000000009.json")
        )
        lease.heartbeat()
        with pytest.raises(SaveFolderInUseError, match="taker"):
            lease.check()
    finally:
        lease.release()


KILLED_HOLDER = """
import os, signal, sys, time
sys.path.insert(0, {src!r})
from olmolike.train.checkpoint.lease import SaveFolderLease
lease = SaveFolderLease(sys.argv[1], run="killed-run", timeout=3600)
lease.acquire()
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_the_lease_of_a_sigkilled_run_on_this_host_is_taken_over(tmp_path: Path) -> None:
    folder = str(tmp_path / "run")
    script = tmp_path / "hold.py"
    src = str(Path(__file__).parents[1])
    script.write_text(textwrap.dedent(KILLED_HOLDER.format(src=src)))
    python = preloaded_python.command(real_exit=True)
    result = subprocess.run([*python, str(script), folder], timeout=patient(120))
    assert result.returncode == -signal.SIGKILL
    assert records(folder)[0]["run_id"] == "killed-run"
    lease = SaveFolderLease(folder, run="restart")  # long before the hour-long timeout
    lease.acquire()
    lease.release()


@dataclass
class WaitForFile(Callback):
    """Holds training at step 1 until ``release`` exists; creates ``ready`` first."""

    ready: str = ""
    release: str = ""

    def post_step(self) -> None:
        if self.step != 1:
            return
        Path(self.ready).touch()
        deadline = time.monotonic() + 120
        while not Path(self.release).exists() and time.monotonic() < deadline:
            time.sleep(0.05)


HOLDING_RUN = """
import sys
sys.path.insert(0, {test_dir!r})
from testutils import build_trainer
from test_lease import WaitForFile
from olmolike.train import Duration
save, ready, release = sys.argv[1:4]
if __name__ == "__main__":
    trainer = build_trainer(save, max_duration=Duration.steps(2))
    trainer.add_callback("wait", WaitForFile(ready=ready, release=release))
    trainer.fit()
"""


def wait_until_ready(holder: subprocess.Popen[bytes], ready: Path) -> None:
    """Wait until the holding run's first step is done (``ready`` exists)."""
    deadline = time.monotonic() + patient(180)
    while not ready.exists():
        assert holder.poll() is None, "the first run ended early"
        assert time.monotonic() < deadline, "the first run did not start in time"
        time.sleep(0.05)


def test_a_trainer_on_a_folder_in_use_is_refused_then_runs_once_it_is_released(
    tmp_path: Path,
) -> None:
    save, ready, release = tmp_path / "run", tmp_path / "ready", tmp_path / "release"
    script = tmp_path / "hold.py"
    script.write_text(textwrap.dedent(HOLDING_RUN.format(test_dir=str(Path(__file__).parent))))
    python = preloaded_python.command(real_exit=True)  # the holder's pid is not the subject
    holder = subprocess.Popen(
        [*python, str(script), str(save), str(ready), str(release)],
        env={**os.environ, "OLMOLIKE_RUN_ID": "the-first-run", "OMP_NUM_THREADS": "1"},
    )
    try:
        wait_until_ready(holder, ready)
        with pytest.raises(SaveFolderInUseError) as error:
            build_trainer(save, max_duration=Duration.steps(4)).fit()
        assert "the-first-run" in str(error.value)
        assert "save_overwrite" not in str(error.value)
        release.touch()
        assert holder.wait(timeout=patient(180)) == 0
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    trainer = build_trainer(save, max_duration=Duration.steps(4))
    trainer.fit()  # the first run released its lease at the end: this one resumes
    assert trainer.global_step == 4
    assert all(r["released"] for r in records(str(save)))


def test_a_failed_run_releases_its_lease(tmp_path: Path) -> None:
    class Boom(Callback):
        def post_step(self) -> None:
            raise RuntimeError("boom")

    trainer = build_trainer(tmp_path, max_duration=Duration.steps(2))
    trainer.add_callback("boom", Boom())
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit()
    assert records(str(tmp_path))[0]["released"] is True
    assert current_lease(str(tmp_path)) is None


def test_saving_after_losing_the_lease_fails_without_a_marker(tmp_path: Path) -> None:
    trainer = build_trainer(tmp_path, max_duration=Duration.steps(1))
    trainer.checkpointer.acquire_lease(str(tmp_path))
    lease = trainer.checkpointer.lease
    assert lease is not None
    write_record(str(tmp_path), run_id="taker", host="elsewhere")
    os.replace(
        Path(tmp_path, LEASE_DIR, "0000000007.json"), Path(tmp_path, LEASE_DIR, "0000000009.json")
    )
    lease.heartbeat()
    with pytest.raises(CheckpointError, match="taker"):
        trainer.save_checkpoint()
    assert not (tmp_path / "step0").exists()
    trainer.checkpointer.release_lease()


def _train_with_fast_heartbeats(save: str) -> list[str]:
    import threading

    import torch.distributed as dist

    from olmolike.train import CheckpointerConfig
    from olmolike.train.callbacks import CheckpointerCallback

    threads: list[str] = []
    for name in ("all_reduce", "barrier", "broadcast_object_list", "all_gather_object", "gather"):
        real = getattr(dist, name)

        def recording(*args: object, _real: object = real, **kwargs: object) -> object:
            threads.append(threading.current_thread().name)
            return _real(*args, **kwargs)  # type: ignore[operator]

        setattr(dist, name, recording)
    trainer = build_trainer(
        save,
        max_duration=Duration.steps(4),
        checkpointer=CheckpointerConfig(lease_timeout=0.3),  # a heartbeat every 50 ms
        callbacks={"checkpointer": CheckpointerCallback(save_interval=2, save_async=True)},
    )
    trainer.fit()
    return sorted(set(threads))


def test_the_heartbeat_thread_runs_no_collective(tmp_path: Path) -> None:
    from testutils import run_distributed_test

    for threads in run_distributed_test(_train_with_fast_heartbeats, 2, args=(str(tmp_path),)):
        assert threads and "lease-heartbeat" not in threads, threads
    assert all(r["released"] for r in records(str(tmp_path)))


@pytest.mark.parametrize(
    "env",
    [
        {"OLMOLIKE_RUN_ID": "job-42"},
        {"SLURM_JOB_ID": "42"},
        {"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "3"},
        {"TORCHELASTIC_RUN_ID": "7f3c-rdzv"},
    ],
    ids=["run-id", "slurm-job", "slurm-step", "torchrun"],
)
def test_the_same_job_restarted_takes_its_own_lease_over_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str]
) -> None:
    folder = str(tmp_path / "run")
    for name in RUN_ID_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    job = run_id()
    for name in env:
        monkeypatch.delenv(name)
    write_record(folder, run_id=job)  # live, on another host: the job's previous attempt
    with pytest.raises(SaveFolderInUseError):
        SaveFolderLease(folder).acquire()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert current_lease(folder, for_run=job) is None
    trainer = build_trainer(folder, max_duration=Duration.steps(1))  # not refused at build
    trainer.fit()
    assert [r["run_id"] for r in records(folder)] == [job]


RUN_ID_VARIABLES = ("OLMOLIKE_RUN_ID", "SLURM_JOB_ID", "SLURM_STEP_ID", "TORCHELASTIC_RUN_ID")


def test_torchruns_default_rendezvous_id_names_no_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """A multi-node torchrun without --rdzv-id gives every job the id "none": two such jobs
    are not one run restarted."""
    for name in RUN_ID_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert run_id() != run_id() and "none" not in run_id()
    monkeypatch.setenv("SLURM_JOB_ID", "42")  # a scheduler's id comes first
    assert run_id() == "slurm-job-42"


def own_start_time(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[19])


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux's /proc")
def test_a_holder_whose_pid_now_belongs_to_another_process_is_gone(tmp_path: Path) -> None:
    """A restarted container numbers its processes from 1 again, and pids are reused: a
    live process with the holder's pid but another start time is not the holder."""
    folder = str(tmp_path / "run")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        started = own_start_time(holder.pid)
        here = {"host": socket.gethostname(), "pid": holder.pid}
        write_record(folder, run_id="other-run", process_started=started, **here)
        with pytest.raises(SaveFolderInUseError, match="other-run"):
            SaveFolderLease(folder, run="mine").acquire()
        write_record(folder, run_id="other-run", process_started=started - 1, **here)
        lease = SaveFolderLease(folder, run="mine")
        lease.acquire()  # the process with that pid started later: not the holder
        lease.release()
    finally:
        holder.communicate(b"")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux's /proc")
def test_a_holder_that_died_unreaped_or_before_a_reboot_is_gone(tmp_path: Path) -> None:
    """A zombie (``olmolike train`` keeps a dead rank unreaped until the others end) has
    ended; so has every process of an earlier boot."""
    folder = str(tmp_path / "run")
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + patient(60)
    while Path(f"/proc/{zombie.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline, "the child did not end"
        time.sleep(0.02)
    try:
        write_record(folder, run_id="other-run", host=socket.gethostname(), pid=zombie.pid)
        lease = SaveFolderLease(folder, run="mine")
        lease.acquire()
        lease.release()
    finally:
        zombie.wait()
    live = {"host": socket.gethostname(), "pid": os.getppid()}  # pytest's parent: alive
    shutil.rmtree(Path(folder, LEASE_DIR))
    write_record(folder, run_id="other-run", boot_id="an-earlier-boot", **live)
    lease = SaveFolderLease(folder, run="mine")
    lease.acquire()
    lease.release()
    shutil.rmtree(Path(folder, LEASE_DIR))
    write_record(folder, run_id="other-run", **live)  # this boot (a record without one)
    with pytest.raises(SaveFolderInUseError, match="other-run"):
        SaveFolderLease(folder, run="mine").acquire()


@pytest.mark.skipif(not Path("/proc/self/ns/pid").exists(), reason="needs Linux's /proc")
def test_a_holder_in_another_pid_namespace_is_judged_as_on_another_host(tmp_path: Path) -> None:
    """Containers with the host's network share its host name but not its pids: a holder's pid
    that is no process here says nothing about it. Its lease is live until it goes stale,
    unless it has this run's id (the same run, restarted)."""
    folder = str(tmp_path / "run")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True)  # fmt: skip
    elsewhere = {"host": socket.gethostname(), "pid": int(dead.stdout), "pid_namespace": "pid:[1]"}
    write_record(folder, run_id="other-run", **elsewhere)
    with pytest.raises(SaveFolderInUseError, match="other-run"):
        SaveFolderLease(folder, run="mine").acquire()
    write_record(folder, run_id="mine", **elsewhere)
    lease = SaveFolderLease(folder, run="mine")
    lease.acquire()
    lease.release()


def test_a_record_with_fields_of_a_later_version_is_still_a_live_lease(folder: str) -> None:
    write_record(folder, written_by="olmolike 9.0", priority=3)
    with pytest.raises(SaveFolderInUseError, match="old-run"):
        SaveFolderLease(folder, run="new-run").acquire()


def test_a_new_holder_removes_what_killed_record_writes_left(tmp_path: Path) -> None:
    """A process killed while it renewed its record leaves the record's temporary file; the
    next holder removes those older than the timeout (a younger one may be a racing
    taker's, about to become its record)."""
    folder = tmp_path / "run"
    lease_dir = folder / LEASE_DIR
    lease_dir.mkdir(parents=True)
    old, young = lease_dir / ".0000000003.json.1a2b.tmp", lease_dir / ".0000000004.json.3c4d.tmp"
    old.write_text('{"run_id": "hal')
    young.write_text("")
    os.utime(old, (time.time() - 100, time.time() - 100))
    lease = SaveFolderLease(str(folder), run="mine", timeout=60)
    lease.acquire()
    lease.release()
    assert not old.exists() and young.exists()


def test_a_run_given_another_runs_id_by_mistake_commits_nothing_after_a_takeover(
    tmp_path: Path,
) -> None:
    """Two jobs on two hosts with one run id: the second takes the lease as a restart would;
    the first finds out before its next marker, though no heartbeat ran in between."""
    trainer = build_trainer(tmp_path, max_duration=Duration.steps(1))
    trainer.checkpointer.acquire_lease(str(tmp_path))
    lease = trainer.checkpointer.lease
    assert lease is not None
    write_record(str(tmp_path), run_id=lease.run_id, host="elsewhere")
    os.replace(
        Path(tmp_path, LEASE_DIR, "0000000007.json"), Path(tmp_path, LEASE_DIR, "0000000009.json")
    )
    with pytest.raises(CheckpointError, match="has this run's id"):
        trainer.save_checkpoint()
    assert not (tmp_path / "step0").exists()
    trainer.checkpointer.release_lease()


def test_the_same_job_step_restarted_on_this_host_takes_over_from_its_dead_process(
    tmp_path: Path,
) -> None:
    folder = str(tmp_path / "run")
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    write_record(
        folder, run_id="slurm-job-42-step-0", host=socket.gethostname(), pid=int(dead.stdout)
    )
    lease = SaveFolderLease(folder, run="slurm-job-42-step-0")
    lease.acquire()
    lease.release()


def test_a_live_process_on_this_host_with_this_runs_id_is_not_taken_over(tmp_path: Path) -> None:
    folder = str(tmp_path / "run")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        write_record(folder, run_id="same-id", host=socket.gethostname(), pid=holder.pid)
        with pytest.raises(
            SaveFolderInUseError, match=rf"same-id \(host {socket.gethostname()}, pid {holder.pid}"
        ):
            SaveFolderLease(folder, run="same-id").acquire()
    finally:
        holder.communicate(b"")


def test_a_takeover_by_a_run_with_this_runs_id_is_reported_as_such(tmp_path: Path) -> None:
    folder = str(tmp_path / "run")
    lease = SaveFolderLease(folder, run="shared-id")
    lease.acquire()
    try:
        write_record(folder, run_id="shared-id", host="elsewhere")
        os.replace(
            Path(folder, LEASE_DIR, "0000000007.json"), Path(folder, LEASE_DIR, "0000000009.json")
        )
        lease.heartbeat()
        with pytest.raises(SaveFolderInUseError) as error:
            lease.check()
        assert "has this run's id" in str(error.value)
        assert "heartbeats" not in str(error.value)  # they did arrive: do not say otherwise
    finally:
        lease.release()


def test_two_job_steps_of_one_slurm_allocation_are_two_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two ``srun`` steps of one job on one host: the second is refused, naming the first's
    host, pid, job and step, and the first trains on to its end."""
    save, ready, release = tmp_path / "run", tmp_path / "ready", tmp_path / "release"
    script = tmp_path / "hold.py"
    script.write_text(textwrap.dedent(HOLDING_RUN.format(test_dir=str(Path(__file__).parent))))
    env = {k: v for k, v in os.environ.items() if k != "OLMOLIKE_RUN_ID"}
    step_env = {"SLURM_JOB_ID": "4242", "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(
        [sys.executable, str(script), str(save), str(ready), str(release)],
        env={**env, **step_env, "SLURM_STEP_ID": "0"},
    )
    try:
        wait_until_ready(first, ready)
        monkeypatch.delenv("OLMOLIKE_RUN_ID", raising=False)
        monkeypatch.setenv("SLURM_JOB_ID", "4242")
        monkeypatch.setenv("SLURM_STEP_ID", "1")
        with pytest.raises(SaveFolderInUseError) as error:
            build_trainer(save, max_duration=Duration.steps(4)).fit()
        message = str(error.value)
        assert f"host {socket.gethostname()}, pid {first.pid}" in message
        assert "slurm-job-4242-step-0" in message
        release.touch()
        assert first.wait(timeout=patient(180)) == 0  # it kept its lease to the end
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert all(r["released"] for r in records(str(save)))
