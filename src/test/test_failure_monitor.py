"""RankFailureMonitor against an in-process store: reporting and reacting to peer failures."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from olmolike.distributed import failure
from olmolike.distributed.failure import EXIT_CODE, RankFailureMonitor


def wait_for(condition: object, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


@pytest.fixture
def exits(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    codes: list[int] = []
    monkeypatch.setattr(failure.os, "_exit", codes.append)
    return codes


def monitor(store: dist.Store, rank: int, grace: float = 0.2) -> RankFailureMonitor:
    return RankFailureMonitor(store, rank, poll_interval=0.02, grace_period=grace)


def test_the_first_failure_is_the_one_reported() -> None:
    store = dist.HashStore()
    monitor(store, 1).report(ValueError("root cause"))
    monitor(store, 0).report(RuntimeError("consequence"))
    assert (
        store.get("olmolike/rank_failure/0").decode() == "rank 1 failed with ValueError: root cause"
    )


def test_a_peer_failure_ends_this_rank_after_the_grace_period(exits: list[int]) -> None:
    store = dist.HashStore()
    watcher = monitor(store, 0)
    watcher.start()
    monitor(store, 1).report(ValueError("boom"))
    wait_for(lambda: exits)
    assert exits == [EXIT_CODE]


def test_stopping_during_the_grace_period_cancels_the_exit(
    exits: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    store = dist.HashStore()
    watcher = monitor(store, 0, grace=600.0)
    watcher.start()
    monitor(store, 1).report(ValueError("boom"))
    wait_for(lambda: "Rank 0 is stopping because rank 1 failed" in caplog.text)  # grace began
    watcher.stop()
    watcher._thread.join(60)
    assert not watcher._thread.is_alive()
    assert exits == []


def test_a_rank_that_failed_itself_is_left_to_finish(exits: list[int]) -> None:
    store = dist.HashStore()
    watcher = monitor(store, 0)
    watcher.report(KeyError("mine"))
    monitor(store, 1).report(ValueError("theirs"))
    watcher.start()
    watcher._thread.join(60)  # it stops watching at its first look
    assert not watcher._thread.is_alive()
    assert exits == []


def test_how_a_process_ended_is_read_until_it_is_reaped() -> None:
    """A peer on this host: its signal while it is a zombie, "is gone" once reaped."""
    import signal
    import subprocess
    import sys

    from olmolike.distributed.lost_ranks import RankProcess, _stat, process_end, process_exiting

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        me = RankProcess.this()
        process = RankProcess(me.host, child.pid, _stat(child.pid)[19])
        assert process_end(process) is None and not process_exiting(process)
        child.send_signal(signal.SIGKILL)
        wait_for(lambda: process_end(process) is not None)  # a zombie: not reaped yet
        assert process_end(process) == "was killed by SIGKILL" and process_exiting(process)
    finally:
        child.kill()
        child.wait()
    assert process_end(process) == "is gone"
    elsewhere = RankProcess("another-host", child.pid, process.started)
    assert process_end(elsewhere) is None  # nothing to tell from here


def test_a_rank_on_another_host_whose_heartbeat_stopped_stopped_responding() -> None:
    from olmolike.distributed.lost_ranks import RankProcess, Roster, describe_lost_ranks

    store = dist.HashStore()
    roster = Roster(store, "ranks", rank=0, world_size=2, store_rank=None)
    roster.enter()
    roster.processes[1] = RankProcess("node-7", 1234, "1")
    assert describe_lost_ranks(roster, wait=0.2) == "rank 1 (on node-7) stopped responding"
    # A rank that reported its own failure stops beating, and is not lost.
    Roster(store, "ranks", rank=1, world_size=2, store_rank=None).mark_failed()
    assert describe_lost_ranks(roster, wait=0.2) is None
