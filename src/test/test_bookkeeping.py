"""BookkeepingRunner: ordering, agreed delivery steps, errors, shutdown with a stuck op."""

from __future__ import annotations

import threading
import time

import pytest

from olmolike.threads import DaemonThreadPool
from olmolike.train.bookkeeping import BookkeepingRunner


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


def test_a_distributed_result_is_delivered_at_the_end_of_the_next_step_only() -> None:
    r = runner()
    gate = threading.Event()
    delivered: list[str] = []
    r.step = 3
    r.submit(lambda: gate.wait() and "slow", cb=delivered.append)
    r.poll(3)  # the step it was submitted in: never delivered there, even when finished
    assert delivered == []
    threading.Timer(0.2, gate.set).start()
    r.poll(4)  # due now: poll waits for it
    assert delivered == ["slow"]
    r.shutdown(wait=True)


def test_a_finished_distributed_result_still_waits_for_its_step() -> None:
    r = runner(asynchronous=False)
    delivered: list[int] = []
    r.step = 7
    r.submit(lambda: 1, cb=delivered.append)
    r.poll(7)
    assert delivered == []
    r.poll(8)
    assert delivered == [1]


def test_a_local_result_is_delivered_once_done() -> None:
    r = runner(asynchronous=False)
    delivered: list[int] = []
    r.step = 7
    r.submit(lambda: 1, cb=delivered.append, distributed=False)
    r.poll(7)
    assert delivered == [1]


def test_errors_surface_at_poll_in_order() -> None:
    r = runner(asynchronous=False)

    def fail() -> None:
        raise KeyError("missing")

    r.submit(fail, op_name="lookup")
    r.poll(0)  # not due yet: the error waits for the agreed step too
    with pytest.raises(KeyError, match="missing"):
        r.poll(1)


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
