"""BookkeepingRunner: ordering, dedupe, errors, shutdown with a stuck op."""

from __future__ import annotations

import threading
import time

import pytest

from olmolike.exceptions import BookkeepingError
from olmolike.train.bookkeeping import BookkeepingRunner, DaemonThreadPool


def runner(asynchronous: bool = True, distributed: bool = False) -> BookkeepingRunner:
    return BookkeepingRunner(asynchronous=asynchronous, distributed=distributed, soft_timeout=30)


def test_distributed_ops_run_one_at_a_time_in_submission_order() -> None:
    r = runner()
    order: list[int] = []
    for i in range(6):
        r.submit(lambda i=i: (time.sleep(0.01 * (6 - i)), order.append(i)))
    r.wait_all()
    assert order == list(range(6))
    r.shutdown(wait=True)


def test_callbacks_are_delivered_in_order_even_when_ops_finish_out_of_order() -> None:
    r = runner()
    delivered: list[int] = []
    for i in range(4):
        r.submit(
            time.sleep, 0.05 * (4 - i), distributed=False, cb=lambda _, i=i: delivered.append(i)
        )
    r.wait_all()
    assert delivered == [0, 1, 2, 3]
    r.shutdown(wait=True)


def test_allow_multiple_false_cancels_queued_and_ignores_while_running() -> None:
    r = runner()
    started, gate = threading.Event(), threading.Event()
    ran: list[str] = []

    def upload() -> None:
        started.set()
        gate.wait()

    blocker = r.submit(upload, distributed=False, op_name="upload", allow_multiple=False)
    assert started.wait(60)
    again = r.submit(
        ran.append, "second", distributed=False, op_name="upload", allow_multiple=False
    )
    assert again is blocker  # still running: the new invocation is ignored
    gate.set()
    r.wait_all()
    assert ran == []
    r.shutdown(wait=True)


def test_allow_multiple_false_is_refused_for_distributed_ops() -> None:
    with pytest.raises(BookkeepingError, match="deadlock"):
        runner(distributed=True).submit(print, op_name="x", allow_multiple=False)


def test_errors_surface_at_poll_in_order() -> None:
    r = runner(asynchronous=False)

    def fail() -> None:
        raise KeyError("missing")

    r.submit(fail, op_name="lookup")
    with pytest.raises(KeyError, match="missing"):
        r.poll()


@pytest.mark.timeout(60)
def test_shutdown_without_wait_abandons_a_stuck_op() -> None:
    r = runner()
    never = threading.Event()
    r.submit(never.wait)
    r.shutdown(wait=False)  # returns at all: the op never ends
    assert all(t.daemon for t in threading.enumerate() if t.name.startswith("bookkeeping"))


def test_daemon_pool_is_an_executor() -> None:
    pool = DaemonThreadPool(2, "test")
    assert pool.submit(sum, [1, 2, 3]).result() == 6
    pool.shutdown()
    with pytest.raises(RuntimeError):
        pool.submit(sum, [1])
