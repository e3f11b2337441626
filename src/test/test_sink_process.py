"""SinkProcess: a metrics sink in a real child process; order, results, failures, no hangs."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import pytest
from testutils import patient

from olmolike.train.callbacks.sink_process import SINK_NICENESS, SinkError, SinkProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


class ListSink:
    """Keeps what it is sent; ``fail_at`` makes that value's ``add`` raise."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.values: list[int] = []
        self.fail_at = fail_at

    def add(self, value: int) -> None:
        if value == self.fail_at:
            raise ValueError(f"cannot take {value}")
        self.values.append(value)

    def contents(self) -> tuple[int, list[int]]:
        return os.getpid(), list(self.values)

    def cpu_priority(self) -> tuple[int | None, int]:
        policy = os.sched_getscheduler(0) if hasattr(os, "sched_getscheduler") else None
        return policy, os.nice(0)

    def track(self, value: int, cpu_seconds: float) -> None:
        """Like a tracker's ``log``: some CPU work per step."""
        end = time.process_time() + cpu_seconds
        while time.process_time() < end:
            pass
        self.values.append(value)

    def add_blob(self, value: int, blob: bytes) -> None:
        self.values.append(value)

    def wait_for(self, path: str) -> None:
        while not os.path.exists(path):
            time.sleep(0.01)

    def crash(self) -> None:
        os._exit(3)

    def slow(self, seconds: float) -> str:
        time.sleep(seconds)
        return "late"

    def hang(self) -> None:
        time.sleep(600)


class BrokenSink:
    def __init__(self) -> None:
        raise RuntimeError("no tracker here")


def test_sent_values_arrive_in_order_in_another_process() -> None:
    sink = SinkProcess(ListSink, "list-sink")
    try:
        for value in range(100):
            sink.send("add", value)
        pid, values = sink.call("contents")
        assert values == list(range(100))
        assert pid != os.getpid()
        # Below training's CPU priority, but in the normal class: SCHED_IDLE would starve it
        # where other work keeps the cores busy.
        policy, niceness = sink.call("cpu_priority")
        assert policy in (None, getattr(os, "SCHED_OTHER", None))
        assert niceness == min(os.nice(0) + SINK_NICENESS, 19)
    finally:
        sink.close()


def test_a_failed_send_is_raised_at_the_next_send_or_call() -> None:
    sink = SinkProcess(partial(ListSink, fail_at=3), "failing-sink")
    try:
        for value in range(5):
            sink.send("add", value)  # the failure has not been seen yet, or is seen here
    except SinkError as e:
        assert "cannot take 3" in str(e)
    else:
        with pytest.raises(SinkError, match="cannot take 3"):
            sink.call("contents")
    finally:
        sink.close()
    assert sink.failure is not None and "ValueError" in sink.failure


def test_a_call_that_raises_is_a_sink_error_and_the_sink_goes_on() -> None:
    sink = SinkProcess(ListSink, "list-sink")
    try:
        with pytest.raises(SinkError, match="has no attribute 'missing'"):
            sink.call("missing")
        sink.send("add", 1)
        assert sink.call("contents")[1] == [1]
    finally:
        sink.close()


def test_a_sink_that_cannot_be_built_fails_the_first_call() -> None:
    sink = SinkProcess(BrokenSink, "broken-sink")
    try:
        with pytest.raises(SinkError, match="no tracker here"):
            sink.call("contents")
    finally:
        sink.close()


def test_a_crashed_sink_process_is_an_error_not_a_hang() -> None:
    sink = SinkProcess(ListSink, "crashing-sink")
    try:
        with pytest.raises(SinkError, match=r"exited \(code 3\)"):
            sink.call("crash")
    finally:
        sink.close()


def test_close_terminates_a_sink_that_does_not_finish(caplog: pytest.LogCaptureFixture) -> None:
    sink = SinkProcess(ListSink, "hanging-sink")
    sink.send("hang")
    sink.close(timeout=1.0)  # the hang lasts 600 s, beyond the test's timeout
    assert "did not finish within 1 s; killing it" in caplog.text
    assert sink._process.returncode == -signal.SIGKILL


@pytest.mark.timeout(300)  # two interpreters that import torch: slow on a busy machine
def test_a_script_without_a_main_guard_is_not_run_again_in_the_sink(tmp_path: Path) -> None:
    """multiprocessing's spawn would re-run such a script (training and all) in the child."""
    script = tmp_path / "train.py"
    script.write_text(
        "from pathlib import Path\n"
        "from olmolike.train.callbacks.sink_process import SinkProcess\n"
        f"with open({str(tmp_path / 'runs.txt')!r}, 'a') as f:\n"
        "    f.write('ran\\n')\n"
        "sink = SinkProcess(list, 'list-sink')\n"
        "sink.send('append', 7)\n"
        "print(sink.call('__len__'))\n"
        "sink.close()\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=patient(280),
        check=True,
    )
    assert done.stdout.strip() == "1"
    assert (tmp_path / "runs.txt").read_text() == "ran\n"


def test_buffered_calls_arrive_in_order_with_the_next_flush_send_or_call() -> None:
    sink = SinkProcess(ListSink, "list-sink")
    try:
        sink.buffer("add", 1)
        sink.buffer("add", 2)
        sink.flush()
        sink.buffer("add", 3)
        sink.send("add", 4)
        sink.buffer("add", 5)
        assert sink.call("contents")[1] == [1, 2, 3, 4, 5]
        sink.buffer("add", 6)
    finally:
        sink.close()  # sends what is still buffered before stopping the child


BLOB = b"x" * 100_000
"""Big enough that a few messages fill the pipe (the kernel holds ~200 KB of a socket)."""


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.01)


def test_a_sink_that_is_behind_does_not_make_send_wait(tmp_path: Path) -> None:
    """Training goes on while the sink catches up: the messages wait in the parent."""
    go = tmp_path / "go"
    sink = SinkProcess(ListSink, "slow-sink")
    try:
        sink.send("wait_for", str(go))
        for value in range(30):  # 3 MB: a send that waited on the pipe would hang here
            sink.send("add_blob", value, BLOB)
        assert not go.exists()
        go.touch()
        assert sink.call("contents")[1] == list(range(30))
    finally:
        sink.close()


def test_a_sink_too_far_behind_makes_send_wait(tmp_path: Path) -> None:
    """Past ``max_pending`` messages a send waits for the sink instead of piling up memory."""
    go = tmp_path / "go"
    sink = SinkProcess(ListSink, "slow-sink", max_pending=3)
    sent = threading.Event()

    def send_all() -> None:
        for value in range(30):  # 3 MB: more than the pipe and 3 pending messages hold
            sink.send("add_blob", value, BLOB)
        sent.set()

    sender = threading.Thread(target=send_all)
    try:
        sink.send("wait_for", str(go))
        sender.start()
        wait_until(sink._outbox.full, "the pending messages reach the bound")
        # The sink takes nothing yet, and at most a few messages fit in the pipe: the
        # sender cannot have got through all 30.
        assert not sent.is_set()
        go.touch()
        sender.join(60)
        assert sent.is_set()
        assert sink.call("contents")[1] == list(range(30))
    finally:
        go.touch()
        if sender.ident is not None:
            sender.join(60)
        sink.close()


def test_close_kills_a_stuck_sink_that_is_far_behind(caplog: pytest.LogCaptureFixture) -> None:
    sink = SinkProcess(ListSink, "stuck-sink", max_pending=3)
    sink.send("hang")
    for value in range(5):  # more than the pipe holds: the feeder is stuck in a write
        sink.send("add_blob", value, BLOB)
    sink.close(timeout=1.0)
    assert sink._process.returncode == -signal.SIGKILL
    assert not sink._feeder.is_alive()
    assert "did not finish within 1 s; killing it" in caplog.text
    with pytest.raises(SinkError, match="is closed"):
        sink.send("add", 1)


def test_a_hung_sink_far_behind_is_an_error_after_the_stall_timeout() -> None:
    sink = SinkProcess(ListSink, "hung-sink", max_pending=3, stall_timeout=1.0)
    try:
        sink.send("hang")
        with pytest.raises(SinkError, match="did not finish in time"):
            for value in range(30):  # 3 MB: past the pipe and the bound, so a send waits
                sink.send("add_blob", value, BLOB)
        with pytest.raises(SinkError, match="timed out"):
            sink.send("add", 1)  # the sink stays failed
    finally:
        sink.close(timeout=1.0)
    assert sink._process.returncode == -signal.SIGKILL


def test_a_call_that_times_out_leaves_the_sink_failed_not_answering_late() -> None:
    sink = SinkProcess(ListSink, "slow-sink")
    try:
        with pytest.raises(SinkError, match=r"slow\(\) did not finish in time"):
            sink.call("slow", 2.0, timeout=0.3)
        wait_until(lambda: bool(sink._can_read.poll(0)), "the late reply arrives")
        with pytest.raises(SinkError, match="timed out"):
            sink.call("contents")
    finally:
        sink.close()


def test_a_killed_sink_is_a_sink_error_at_the_next_send() -> None:
    sink = SinkProcess(ListSink, "killed-sink")
    try:
        pid, _ = sink.call("contents")
        sink.send("hang")
        for value in range(5):  # unread data: the kernel resets the connection on exit
            sink.send("add_blob", value, BLOB)
        os.kill(pid, signal.SIGKILL)
        sink._process.wait(10)
        with pytest.raises(SinkError, match=r"exited \(code -9\)"):
            for value in range(5):
                sink.send("add", value)
            sink.call("contents")
    finally:
        sink.close()


def test_works_with_descriptors_numbered_above_1024() -> None:
    """select() cannot watch such descriptors; a big training process easily has them."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the file descriptor limit ({hard}) is below 1200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    fillers = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        sink = SinkProcess(ListSink, "list-sink")
        try:
            assert sink._conn.fileno() >= 1024
            sink.send("add", 1)
            assert sink.call("contents")[1] == [1]
        finally:
            sink.close()
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@contextmanager
def busy_cores(per_core: int = 4) -> Iterator[None]:
    """Other work on every core: ``per_core`` spinning processes per core, at training's
    priority. Each also stops by itself after 5 minutes, should this process be killed."""
    spin = "import time\nend = time.monotonic() + 300\nwhile time.monotonic() < end: pass"
    spinners: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(per_core * (os.cpu_count() or 1)):
            spinners.append(subprocess.Popen([sys.executable, "-c", spin]))
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
        for spinner in spinners:
            spinner.wait()


@pytest.mark.timeout(300)
def test_a_sink_gets_every_metric_while_other_work_keeps_the_cores_busy(tmp_path: Path) -> None:
    """A sink in SCHED_IDLE got no CPU at all beside busy cores: it never caught up, and
    training waited for it. A sink behind by up to ``max_pending`` never makes a send wait."""
    go = tmp_path / "go"
    sink = SinkProcess(ListSink, "busy-sink", max_pending=100, stall_timeout=120)
    try:
        sink.call("contents")  # started before the load, as a tracker at the start of a run
        with busy_cores(per_core=4):
            sink.send("wait_for", str(go))
            for value in range(100):  # the sink takes none of these: had one waited, it would
                sink.send("add", value)  # wait for stall_timeout and fail
            assert not go.exists()
            go.touch()
            for value in range(100, 500):  # past the bound: each waits for the sink, which
                sink.send("track", value, 0.001)  # spends 1 ms of CPU on it, as Aim does
            assert sink.call("contents", timeout=patient(120))[1] == list(range(500))
    finally:
        sink.close()
