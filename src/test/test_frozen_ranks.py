"""A rank that freezes (SIGSTOP, stuck in uninterruptible I/O) is named in one line within the
frozen-rank timeout, and the job ends, instead of every other rank waiting in its collectives
for the process group's timeout (15 minutes by default).

The real-process tests stop a rank with SIGSTOP during a step, inside its async save's writer
thread, and inside a load, with a small timeout; the stopped rank is resumed and killed when
the test ends, whatever happened.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from test_failure_lines import _rank_pids, write_experiment
from testutils import patient, start_ranks

from olmolike.distributed import failure, rank_monitor
from olmolike.distributed.lost_ranks import (
    BoundedStore,
    RankProcess,
    Roster,
    SilenceWatch,
    StoreUnresponsive,
    StuckThreads,
    _stat,
    describe_frozen,
    process_state,
)
from olmolike.distributed.rank_monitor import EXIT_CODE, RankFailureMonitor
from olmolike.train.checkpoint import Checkpointer

TEST_DIR = str(Path(__file__).parent)
INFO = re.compile(r"^\S+ \S+ (\[rank\d+\] )?INFO ")
TIMEOUT = 4
"""The frozen-rank timeout of the real-process tests, in seconds."""

SCRIPT = """
import os, signal, sys
sys.path.insert(0, {test_dir!r})
from testutils import build_trainer
from olmolike.distributed import checkpoint_loading
from olmolike.distributed.utils import get_rank
from olmolike.train import Callback, Duration, prepare_training_environment
from olmolike.train.callbacks.checkpointer import CheckpointerCallback
from olmolike.train.checkpoint import save

folder, where, frozen = sys.argv[1], sys.argv[2], int(sys.argv[3])


def freeze():
    if get_rank() == frozen:
        print("freezing", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)


class FreezeInAStep(Callback):
    def pre_step(self, batch):
        if self.step == 4:
            freeze()


def freezing_in(owner, name, when):
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        if when(*args):
            freeze()
        return original(*args, **kwargs)

    setattr(owner, name, wrapper)


def trainer(steps, **callbacks):
    saving = CheckpointerCallback(save_interval=2, save_async=True)
    callbacks = {{"checkpointer": saving, **callbacks}}
    return build_trainer(folder, max_duration=Duration.steps(steps), callbacks=callbacks)


if __name__ == "__main__":
    prepare_training_environment(seed=0)
    if where == "step":
        trainer(100, freeze=FreezeInAStep()).fit()
    elif where == "save":  # on the async save's writer thread, writing step 4
        freezing_in(save, "write_synced", lambda path, data: "step4" in str(path))
        trainer(100).fit()
    else:  # inside the load that resumes from step 2
        trainer(2).fit()
        freezing_in(checkpoint_loading._SafeParallelReading, "read_data", lambda *a: True)
        trainer(100).fit()
"""

FROZEN_LINE = re.compile(
    r"error: rank (?P<frozen>\d) \(pid (?P<pid>\d+) on \S+, T \(stopped\)\) is frozen: "
    r"no (heartbeat|answer) for (?P<silent>\d+)s( from the job's key-value store, which it "
    r"holds)?; rank (?P<left>\d) stopped at step (?P<step>\d+); the last complete checkpoint "
    r"is (?P<checkpoint>\S+): run the same command again to resume"
)


def _failure_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.strip() and not INFO.match(line)]


def _run_with_a_frozen_rank(
    tmp_path: Path, where: str, frozen: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[int, str, str]:
    """Two ranks, ``frozen`` stops itself ``where``; the exit status and output of the rank
    left, and what the frozen one printed. The frozen rank is resumed and killed at the end."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT.format(test_dir=TEST_DIR)))
    command = [sys.executable, str(script), str(tmp_path / "run"), where, str(frozen)]
    monkeypatch.setenv(rank_monitor.FROZEN_ENV, str(TIMEOUT))  # the ranks inherit it
    ranks = start_ranks(command)
    left = ranks[1 - frozen]
    try:
        output, _ = left.communicate(timeout=patient(200))
    finally:
        for rank in ranks:
            if rank.poll() is None:
                os.kill(rank.pid, signal.SIGCONT)
                rank.kill()
        frozen_output, _ = ranks[frozen].communicate()
    return left.returncode, output, frozen_output


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    ("where", "frozen"),
    [("step", 1), ("save", 1), ("load", 1), ("step", 0)],
    ids=["in-a-step", "in-an-async-save", "in-a-load", "rank0-holding-the-store"],
)
def test_a_frozen_rank_is_named_in_one_line_and_the_job_ends(
    tmp_path: Path, where: str, frozen: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the rank left waited in its collective for the group's timeout (5 minutes in a
    step, 15 in a load or in the checkpointer's group), then named no rank, or hung for good
    in a call to the store when the frozen rank held it."""
    returncode, output, frozen_output = _run_with_a_frozen_rank(
        tmp_path, where, frozen, monkeypatch
    )
    assert "freezing" in frozen_output  # it did stop where the test meant
    assert returncode == EXIT_CODE, output[-3000:]
    (line,) = _failure_lines(output)
    found = FROZEN_LINE.fullmatch(line)
    assert found, line
    assert found["frozen"] == str(frozen) and found["left"] == str(1 - frozen)
    assert int(found["silent"]) >= TIMEOUT
    run = tmp_path / "run"
    assert found["checkpoint"] == list(Checkpointer.find_checkpoints(run))[-1][1]
    if where == "load":
        assert found["step"] == "0" and found["checkpoint"].endswith("step2")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_frozen_rank_0_under_olmolike_s_own_launcher_is_named_by_its_heartbeat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``olmolike train --nproc-per-node 2`` holds the job's store itself: a frozen rank 0
    does not take it along, and the line is the heartbeat's. The rank that said it ends on
    its own; the launcher exits once the stopped rank is gone too."""
    monkeypatch.setenv(rank_monitor.FROZEN_ENV, str(TIMEOUT))
    command = [sys.executable, "-m", "olmolike", "train", "--nproc-per-node=2"]
    launcher = subprocess.Popen(
        [*command, str(write_experiment(tmp_path))],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    pids: dict[int, int] = {}
    lines: list[str] = []
    watchdog = threading.Timer(patient(300), launcher.kill)
    watchdog.start()
    try:
        for line in launcher.stdout or ():
            lines.append(line)
            if not pids and "Saved checkpoint" in line:  # training, and saving
                pids = _rank_pids(launcher.pid)
                os.kill(pids[0], signal.SIGSTOP)
            if line.startswith("error: "):
                break
        assert pids, "".join(lines)[-3000:]
        _wait_until_ended(pids[1])  # the rank that said it: the launcher's first failure
        os.kill(pids[0], signal.SIGCONT)  # what the user does next: end the stopped rank
        os.kill(pids[0], signal.SIGKILL)
        output = "".join(lines) + launcher.communicate(timeout=patient(120))[0]
    finally:
        watchdog.cancel()
        launcher.kill()
        launcher.communicate()
    # Rank 1 ended on its own (above); the launcher's status is the first failure it saw,
    # rank 1's or, seen in the same look, the stopped rank's SIGKILL.
    assert launcher.returncode in (EXIT_CODE, 128 + signal.SIGKILL), output[-3000:]
    said = _failure_lines(output)
    assert len(said) == 1, output[-3000:]
    found = FROZEN_LINE.fullmatch(said[0])
    assert found and found["frozen"] == "0" and "no heartbeat" in said[0], said[0]


def _wait_until_ended(pid: int) -> None:
    """Until ``pid`` has exited (a zombie its launcher has not reaped yet, or gone)."""
    deadline = time.monotonic() + patient(60)
    while time.monotonic() < deadline:
        try:
            if _stat(pid)[0] in ("Z", "X"):
                return
        except OSError:
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} did not end")


# -- the pieces, in one process ----------------------------------------------------------------


def _stopped_child() -> subprocess.Popen[bytes]:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    os.kill(child.pid, signal.SIGSTOP)
    deadline = time.monotonic() + patient(30)
    while _stat(child.pid)[0] != "T":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return child


def test_a_stopped_process_s_state_is_read_on_its_host_only() -> None:
    child = _stopped_child()
    try:
        here = RankProcess.this()
        process = RankProcess(here.host, child.pid, _stat(child.pid)[19])
        assert process_state(process) == "T (stopped)"
        assert process_state(RankProcess("node-7", child.pid, process.started)) is None
        assert process_state(RankProcess(here.host, child.pid, "1")) is None  # pid reused
    finally:
        os.kill(child.pid, signal.SIGCONT)
        child.kill()
        child.wait()


def _roster(store: dist.Store, rank: int, world_size: int = 2) -> Roster:
    roster = Roster(store, "ranks", rank, world_size, store_rank=None)
    roster.processes[rank] = RankProcess.this()
    return roster


def test_silence_counts_after_the_first_beat_and_not_for_a_rank_that_ended() -> None:
    store = dist.HashStore()
    watcher, watched = _roster(store, 0), _roster(store, 1)
    watched.processes[1] = RankProcess("node-7", 1234, "1")  # elsewhere: silence alone tells
    watcher.processes[1] = watched.processes[1]
    watch = SilenceWatch(watcher, timeout=10, poll_interval=0.5)
    assert watch.rank == 1
    assert watch.look(0.0) is None and watch.look(4.0) is None  # never beat: no monitor there
    watched.beat()
    assert watch.look(4.5) is None  # a beat: the silence starts now
    assert watch.look(9.0) is None and watch.look(13.0) is None
    assert watch.look(14.6) == pytest.approx(10.1)
    watched.mark_done()  # a rank that ended its run stops beating: no news
    assert watch.look(15.0) is None


def test_a_pause_of_the_watcher_itself_is_not_the_watched_rank_s_silence() -> None:
    """A watcher that was stopped (or starved) for longer than the timeout sees no beat
    between two looks: that gap is its own, not the other rank's."""
    store = dist.HashStore()
    watcher, watched = _roster(store, 0), _roster(store, 1)
    watcher.processes[1] = RankProcess("node-7", 1234, "1")
    watch = SilenceWatch(watcher, timeout=10, poll_interval=0.5)
    watched.beat()
    assert watch.look(0.0) is None
    assert watch.look(60.0) is None  # 60 s between two looks: this process was held up
    assert watch.look(65.0) is None and watch.look(69.9) is None
    assert watch.look(70.6) == pytest.approx(10.6)


def test_a_silent_rank_that_uses_cpu_on_this_host_is_busy_not_frozen(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A call that holds Python's lock silences the heartbeat thread of a healthy process:
    on the same host its CPU use tells it from a frozen one; a stopped one is frozen."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    stopped = _stopped_child()
    try:
        here = RankProcess.this()
        store = dist.HashStore()
        _roster(store, 1).beat()
        for child, frozen in ((busy, False), (stopped, True)):
            watcher = _roster(store, 0)
            watcher.processes[1] = RankProcess(here.host, child.pid, _stat(child.pid)[19])
            watch = SilenceWatch(watcher, timeout=1, poll_interval=0.1)
            started = time.monotonic()
            assert watch.look(started) is None
            time.sleep(1.5)  # real time: the busy child uses CPU meanwhile
            silent = watch.look(time.monotonic())
            assert (silent is not None) == frozen
        assert "its process runs (R (running)" in caplog.text
    finally:
        for child in (busy, stopped):
            os.kill(child.pid, signal.SIGCONT)
            child.kill()
            child.wait()


class _FrozenStore:
    """A store whose calls never return once ``frozen`` is set, as a TCPStore client's
    against a stopped server."""

    def __init__(self) -> None:
        self.store = dist.HashStore()
        self.frozen = threading.Event()

    def __getattr__(self, name: str) -> object:
        method = getattr(self.store, name)

        def call(*args: object) -> object:
            if self.frozen.is_set():
                threading.Event().wait()
            return method(*args)

        return call


def test_a_store_call_that_never_returns_is_given_up_after_its_deadline() -> None:
    frozen = _FrozenStore()
    store = BoundedStore(frozen, deadline=0.2)  # type: ignore[arg-type]
    assert store.add("k", 1) == 1
    frozen.frozen.set()
    with pytest.raises(StoreUnresponsive, match="did not answer for 0s"):
        store.add("k", 1)
    started = time.monotonic()
    with pytest.raises(StoreUnresponsive):  # at once from then on
        store.check(["k"])
    assert time.monotonic() - started < 0.2


@pytest.fixture
def ends(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    codes: list[int] = []
    monkeypatch.setattr(rank_monitor.os, "_exit", codes.append)
    return codes


def _wait_for(condition: object) -> None:
    deadline = time.monotonic() + patient(60)
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_the_rank_that_finds_a_frozen_rank_says_it_once_and_the_others_end_quietly(
    ends: list[int], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three ranks, rank 2 frozen (it stops beating): rank 1 watches it, prints the line
    and ends; rank 0 sees the report and ends without a line, and so would its own error."""
    store = dist.HashStore()
    monitors = [
        RankFailureMonitor(store, r, world_size=3, poll_interval=0.02, frozen_timeout=0.5)
        for r in range(3)
    ]
    for monitor in monitors:
        monitor.roster.processes[2] = RankProcess("node-7", 4242, "1")
    rank_monitor.set_failure_context(lambda: "rank 1 stopped at step 5")
    try:
        starting = [threading.Thread(target=m.start) for m in monitors]  # they enter together
        for thread in starting:
            thread.start()
        for thread in starting:
            thread.join()
        _wait_for(lambda: all(m.roster.beat_count(2) > 0 for m in monitors))
        monitors[2]._stopped.set()  # frozen: no more beats
        _wait_for(lambda: len(ends) == 2)
    finally:
        rank_monitor.set_failure_context(None)
        for monitor in monitors:
            monitor._stopped.set()
    assert ends == [EXIT_CODE, EXIT_CODE]
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert re.fullmatch(
        r"error: rank 2 \(pid 4242 on node-7\) is frozen: no heartbeat for \d+s; "
        r"rank 1 stopped at step 5",
        lines[0],
    )
    assert monitors[0].line_said and monitors[1].line_said
    assert not monitors[0].report(RuntimeError("a collective failed: rank 1 exited"))
    # The rank that said it: its main thread's error (its collective's peer was killed
    # meanwhile) is not a second line, nor an error record.
    monkeypatch.setattr(failure, "_monitor", monitors[1])
    assert not failure.report_rank_failure(RuntimeError("Connection closed by peer"))


def test_a_frozen_rank_is_described_with_its_state_only_from_its_host() -> None:
    store = dist.HashStore()
    roster = _roster(store, 0)
    roster.processes[1] = RankProcess("node-7", 4242, "1")
    assert describe_frozen(roster, 1, 61.4) == (
        "rank 1 (pid 4242 on node-7) is frozen: no heartbeat for 61s"
    )
    assert describe_frozen(roster, 2, 3) == "rank 2 is frozen: no heartbeat for 3s"


def _task(tasks: Path, tid: int, name: str, state: str, switches: int) -> None:
    (tasks / str(tid)).mkdir(parents=True, exist_ok=True)
    (tasks / str(tid) / "stat").write_text(f"{tid} ({name}) {state} 1 2 3\n")
    (tasks / str(tid) / "status").write_text(
        f"Name:\t{name}\nvoluntary_ctxt_switches:\t{switches}\nnonvoluntary_ctxt_switches:\t7\n"
    )


def test_a_thread_that_sleeps_in_d_without_running_for_the_timeout_is_stuck(
    tmp_path: Path,
) -> None:
    """An async save's writer on a dead mount sleeps in D (uninterruptible) and is never
    switched in again, while the rest of the rank, its heartbeat included, runs on: the rank
    finds it in its own /proc (no real dead mount here: a /proc-shaped folder)."""
    tasks = tmp_path / "task"
    _task(tasks, 100, "python", "S", 5000)
    _task(tasks, 101, "writer", "D", 40)  # stuck from now on
    _task(tasks, 102, "reader", "D", 10)  # busy reading: in D often, but switched in
    stuck = StuckThreads(timeout=10, tasks=tasks)
    assert stuck.look(0.0) is None
    _task(tasks, 102, "reader", "D", 11)
    assert stuck.look(6.0) is None
    _task(tasks, 102, "reader", "R", 12)
    assert stuck.look(10.5) == (
        "thread 'writer' (tid 101) has been in D (disk sleep) for 10s without running"
    )
    _task(tasks, 101, "writer", "D", 41)  # it ran again: the count starts afresh
    assert stuck.look(11.0) is None and stuck.look(20.0) is None
    assert stuck.look(21.0) is not None
    assert StuckThreads(timeout=10).look(0.0) is None  # this process has no such thread


@pytest.mark.parametrize(
    ("text", "seconds"), [(None, 120.0), ("30", 30.0), ("0", 0.0), ("inf", 0.0), ("2.5", 2.5)]
)
def test_the_frozen_rank_timeout_is_read_from_the_environment(
    text: str | None, seconds: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    if text is None:
        monkeypatch.delenv(rank_monitor.FROZEN_ENV, raising=False)
    else:
        monkeypatch.setenv(rank_monitor.FROZEN_ENV, text)
    assert failure.frozen_rank_timeout() == seconds


@pytest.mark.parametrize("text", ["-3", "abc", "nan", "-inf", "1e300", ""])
def test_a_frozen_rank_timeout_that_is_no_duration_is_refused(
    text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: a negative one made every store call of the monitor time out at once and an
    infinite one overflowed its waits, and either ended a healthy job with a line that blamed
    the store's holder ("rank 0 is frozen: no answer for -5s ...")."""
    from olmolike.exceptions import ConfigurationError

    monkeypatch.setenv(rank_monitor.FROZEN_ENV, text)
    with pytest.raises(ConfigurationError, match=rf"^{rank_monitor.FROZEN_ENV} must be a number"):
        failure.frozen_rank_timeout()
    with pytest.raises(ConfigurationError, match=r"^frozen_rank_timeout must be .* got -5.0$"):
        failure.check_frozen_timeout(-5.0, "frozen_rank_timeout")


def test_a_refused_frozen_rank_timeout_is_said_once_per_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The refusal is raised once the monitor runs (with the default timeout): every rank
    refuses alike, and only the job's first failing rank prints it."""
    from olmolike.exceptions import ConfigurationError

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")  # never reached: the store is this test's
    store = dist.HashStore()
    monkeypatch.setattr(failure.dist, "TCPStore", lambda *a, **k: store)
    monkeypatch.setattr(failure, "_monitor", None)
    monkeypatch.setattr(failure, "_stopped_monitor", None)
    with pytest.raises(ConfigurationError) as refused:
        failure.start_failure_monitor(0, frozen_timeout=-1.0)
    monitor = failure._monitor
    assert monitor is not None and monitor.frozen_timeout == rank_monitor.DEFAULT_FROZEN_SECONDS
    try:
        assert failure.report_rank_failure(refused.value)  # the job's first: it prints the line
        second = RankFailureMonitor(store, 1, world_size=2)
        assert not second.report(refused.value)  # another rank's, alike: no second line
    finally:
        monitor.stop()


def test_a_rank_beats_once_before_its_monitor_start_returns() -> None:
    """Silence counts only after a rank's first beat. Before, the first beat came from the
    monitor's thread one poll later: a rank that froze at once (a load from a dead mount
    right at the start) never beat, and the others waited for the group's timeout."""
    store = dist.HashStore()
    watcher = RankFailureMonitor(store, 0, world_size=2, poll_interval=3600)
    frozen = RankFailureMonitor(store, 1, world_size=2, poll_interval=3600)
    starting = [threading.Thread(target=m.start) for m in (watcher, frozen)]
    for thread in starting:
        thread.start()
    for thread in starting:
        thread.join()
    try:
        assert watcher.roster.beat_count(1) == 1  # no thread has polled yet
    finally:
        for monitor in (watcher, frozen):
            monitor._stopped.set()


PAUSED_CALL = """
import sys, time
from pathlib import Path
from olmolike.distributed.lost_ranks import BoundedStore

flag = Path(sys.argv[1])


class Store:  # answers once the test says so
    def add(self, key, value):
        print("calling", flush=True)
        while not flag.exists():
            time.sleep(0.02)
        return 1


print(BoundedStore(Store(), deadline=2.0).add("k", 1), flush=True)
"""


@pytest.mark.timeout(120)
def test_a_pause_of_this_process_during_a_store_call_is_not_the_store_s_silence(
    tmp_path: Path,
) -> None:
    """Every process of the job stopped and resumed together (SLURM's ``scontrol suspend``)
    while a store call waits: the wait wakes up long after its slice, and that time was this
    process's, not the store's. Before: the call raised on resume, and a healthy job ended
    blaming the store's holder ("the launcher: the job's key-value store did not answer")."""
    flag = tmp_path / "answer"
    child = subprocess.Popen(
        [sys.executable, "-c", PAUSED_CALL, str(flag)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "calling\n"
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(7)  # longer than the deadline and than a late wake-up's allowance
        os.kill(child.pid, signal.SIGCONT)
        time.sleep(0.5)  # the store answers soon after the resume
        flag.touch()
        output, _ = child.communicate(timeout=patient(60))
    finally:
        child.kill()
    assert child.returncode == 0 and output == "1\n", output
