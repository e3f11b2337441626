"""BookkeepingRunner: ordering, agreed delivery steps, errors, shutdown with a stuck op."""

from __future__ import annotations

import threading
import time

import pytest

from olmolike.threads import DaemonThreadPool
from olmolike.train.background_ops import BookkeepingRunner


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


# -- allow_multiple=False (OLMo-core's option) -------------------------------------------------


@pytest.mark.timeout(120)
def test_one_at_a_time_skips_a_local_op_while_an_earlier_one_runs() -> None:
    r = runner()
    started, release = threading.Event(), threading.Event()
    runs: list[str] = []

    def op(tag: str) -> None:
        started.set()
        release.wait()
        runs.append(tag)

    first = r.submit(op, "first", op_name="tags", distributed=False, allow_multiple=False)
    assert started.wait(timeout=30), "the first invocation never started"
    second = r.submit(op, "second", op_name="tags", distributed=False, allow_multiple=False)
    assert second.cancelled()
    release.set()
    first.result()
    third = r.submit(op, "third", op_name="tags", distributed=False, allow_multiple=False)
    third.result()  # the earlier one is done (delivered or not): this one runs
    r.wait_all()
    assert runs == ["first", "third"]
    r.shutdown(wait=True)


@pytest.mark.timeout(120)
def test_one_at_a_time_cancels_a_queued_local_op_for_the_newer_one() -> None:
    r = runner()
    release = threading.Event()
    busy = [r.submit(release.wait, distributed=False) for _ in range(4)]  # every worker busy
    runs: list[str] = []
    queued = r.submit(runs.append, "old", op_name="x", distributed=False, allow_multiple=False)
    newer = r.submit(runs.append, "new", op_name="x", distributed=False, allow_multiple=False)
    assert queued.cancelled() and not newer.cancelled()
    release.set()
    r.wait_all()
    assert runs == ["new"] and all(f.done() for f in busy)
    r.shutdown(wait=True)


@pytest.mark.parametrize("asynchronous", [True, False])
def test_one_at_a_time_skips_a_distributed_op_until_its_result_is_delivered(
    asynchronous: bool,
) -> None:
    """Whether it has finished differs between ranks, its delivery step does not: the rule
    depends on delivery only, so every rank skips the same invocations."""
    r = runner(asynchronous=asynchronous)
    delivered: list[int] = []
    r.step = 4
    r.submit(lambda: 1, cb=delivered.append, op_name="agree", allow_multiple=False)
    skipped = r.submit(lambda: 2, cb=delivered.append, op_name="agree", allow_multiple=False)
    assert skipped.cancelled()
    r.submit(lambda: 3, cb=delivered.append, op_name="other")  # another name is not affected
    r.poll(5)
    r.step = 6
    r.submit(lambda: 4, cb=delivered.append, op_name="agree", allow_multiple=False)
    r.wait_all()
    assert delivered == [1, 3, 4]
    r.shutdown(wait=True)
