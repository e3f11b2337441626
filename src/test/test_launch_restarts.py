"""``olmolike train --max-restarts K``: what the launcher restarts, and what it tells the ranks.

The ranks here are a small shell program standing in for ``python -m olmolike``: each start
records its variables and fails or succeeds as the test says. The training itself, killed and
restarted, is test_restarts.py's.
"""

from __future__ import annotations

import os
import signal
import stat
import sys
import threading
from pathlib import Path

import pytest

from olmolike import launch as launcher
from olmolike.cli import main

pytestmark = pytest.mark.timeout(120)

FAKE_RANK = """#!/bin/sh
# A rank: record this start, then end as $FAKE_RANK_OUTCOME says for this restart count.
echo "$RANK $OLMOLIKE_RESTART_COUNT $OLMOLIKE_RUN_ID $MASTER_PORT" >> "$FAKE_RANK_RECORD"
outcome=$(echo "$FAKE_RANK_OUTCOME" | cut -d, -f$((OLMOLIKE_RESTART_COUNT + 1)))
case "$outcome" in
  ok) exit 0 ;;
  kill) [ "$RANK" = 1 ] && kill -9 $$; trap 'exit 143' TERM; while :; do sleep 0.05; done ;;
  wait) trap 'exit 143' TERM; touch "$FAKE_RANK_RECORD.waiting.$RANK"; while :; do sleep 0.05; done ;;
  *) exit "$outcome" ;;
esac
"""


@pytest.fixture
def ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The fake rank program as the launcher's Python; returns the file each start writes."""
    program = tmp_path / "fake-python"
    program.write_text(FAKE_RANK)
    program.chmod(program.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(launcher.sys, "executable", str(program))
    monkeypatch.setattr(launcher, "GRACE_SECONDS", 0.2)  # then the ranks left get SIGTERM
    record = tmp_path / "starts.txt"
    monkeypatch.setenv("FAKE_RANK_RECORD", str(record))
    for name in ("OLMOLIKE_RUN_ID", "SLURM_JOB_ID", "OLMOLIKE_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    return record


def starts(record: Path) -> list[list[str]]:
    return sorted(line.split() for line in record.read_text().splitlines())


def test_a_failed_start_is_restarted_with_the_same_run_id_until_it_succeeds(
    ranks: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FAKE_RANK_OUTCOME", "kill,5,ok")
    assert launcher.launch(2, ["train", "x.yaml"], max_restarts=3) == 0
    seen = starts(ranks)
    assert [(rank, count) for rank, count, _, _ in seen] == [
        ("0", "0"), ("0", "1"), ("0", "2"), ("1", "0"), ("1", "1"), ("1", "2"),
    ]  # fmt: skip
    assert len({run for _, _, run, _ in seen}) == 1  # one run id for every start
    err = capsys.readouterr().err
    restarting = "restarting the 2 rank(s) from the latest checkpoint"
    assert f"rank 1 was killed by SIGKILL; {restarting} (restart 1 of 3)" in err
    assert f"exited with status 5; {restarting} (restart 2 of 3)" in err
    assert "restart 3 of 3" not in err


def test_the_last_failure_is_the_launchers_status_once_the_restarts_are_spent(
    ranks: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_RANK_OUTCOME", "4,4,7")
    assert launcher.launch(2, ["train", "x.yaml"], max_restarts=2) == 7
    assert len(starts(ranks)) == 6
    monkeypatch.setenv("FAKE_RANK_OUTCOME", "kill")
    assert launcher.launch(2, ["train", "x.yaml"]) == 128 + signal.SIGKILL  # no restarts


def test_a_run_id_from_the_environment_is_kept(
    ranks: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Set by the user, or a SLURM job's (the ranks' lease reads it from SLURM_JOB_ID, the
    same in a requeued job's next attempt)."""
    monkeypatch.setenv("FAKE_RANK_OUTCOME", "3,ok")
    monkeypatch.setenv("OLMOLIKE_RUN_ID", "my-run")
    assert launcher.launch(2, ["train", "x.yaml"], max_restarts=1) == 0
    assert {run for _, _, run, _ in starts(ranks)} == {"my-run"}
    assert launcher.shared_run_id({"SLURM_JOB_ID": "42"}) == {}
    assert "OLMOLIKE_RUN_ID" in launcher.shared_run_id({})


def test_a_run_the_user_stopped_is_not_restarted(
    ranks: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM (or Ctrl-C) to the launcher goes to the ranks, which end with 143: that is
    the user's stop, not a failure to recover from."""
    monkeypatch.setenv("FAKE_RANK_OUTCOME", "wait,ok")
    waiting = [Path(f"{ranks}.waiting.{rank}") for rank in (0, 1)]

    def stop_once_waiting() -> None:
        while not all(path.exists() for path in waiting):
            if stopper_done.wait(0.05):
                return
        os.kill(os.getpid(), signal.SIGTERM)

    stopper_done = threading.Event()
    stopper = threading.Thread(target=stop_once_waiting, daemon=True)
    stopper.start()
    try:
        assert launcher.launch(2, ["train", "x.yaml"], max_restarts=3) == 143
    finally:
        stopper_done.set()
        stopper.join()
    assert [count for _, count, _, _ in starts(ranks)] == ["0", "0"]


def test_max_restarts_is_the_launchers_option(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Under torchrun it names torchrun's own option; a negative count is refused."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["train", "--max-restarts", "2", "x.yaml"]) == 2
    err = capsys.readouterr().err
    assert "--max-restarts is olmolike's launcher's" in err and "torchrun has its own" in err
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert main(["train", "--nproc-per-node", "2", "--max-restarts", "-1", "x.yaml"]) == 2
    assert "--max-restarts must be >= 0, got -1" in capsys.readouterr().err


if sys.platform != "linux":  # PR_SET_PDEATHSIG and /proc: the launcher is Linux's
    pytestmark = [pytestmark, pytest.mark.skip(reason="the launcher needs Linux")]


def test_under_torchrun_on_one_node_each_start_has_keys_of_its_own(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """torch 2.13's torchrun keeps one store across restarts: a restarted rank could read a
    gone rank's address. On one node the ranks' keys go under their start's restart count;
    across nodes (restart counts differ per node) a warning names torchrun's way out."""
    import datetime

    import torch.distributed as dist
    from testutils import free_port

    from olmolike.distributed.utils import _store_of_this_start

    timeout = datetime.timedelta(seconds=30)
    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0",
                        "TORCHELASTIC_USE_AGENT_STORE": "True", "GROUP_WORLD_SIZE": "1",
                        "TORCHELASTIC_MAX_RESTARTS": "3"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    first = _store_of_this_start(timeout)
    assert first is not None
    first.set("gloo/rank_0", "127.0.0.1:4000")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    second = _store_of_this_start(timeout)
    assert second is not None
    assert not second.check(["gloo/rank_0"])  # the first start's address is not seen
    second.set("gloo/rank_0", "127.0.0.1:5000")
    assert first.get("gloo/rank_0") == b"127.0.0.1:4000"

    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    assert _store_of_this_start(timeout) is None
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in caplog.text
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # rank 0 holds a fresh store
    assert _store_of_this_start(timeout) is None
    del agent
