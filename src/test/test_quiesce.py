"""The end-of-run wait tells gloo worker threads that still work from idle ones (Linux)."""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from olmolike.distributed.quiesce import gloo_worker_threads, wait_for_idle_gloo_workers

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")


def _named_thread(work: Callable[[threading.Event], object]) -> Iterator[threading.Event]:
    """A thread running ``work(stop)`` under the name torch gives gloo's workers."""
    ready, stop = threading.Event(), threading.Event()

    def run() -> None:
        Path(f"/proc/self/task/{threading.get_native_id()}/comm").write_text("pt_gloo_runloop")
        ready.set()
        work(stop)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    ready.wait()
    yield stop
    stop.set()
    thread.join()


@pytest.fixture
def idle_worker() -> Iterator[threading.Event]:
    yield from _named_thread(lambda stop: stop.wait())  # blocks without waking, as gloo's do


@pytest.fixture
def busy_worker() -> Iterator[threading.Event]:
    def spin(stop: threading.Event) -> None:
        while not stop.is_set():
            sum(range(1000))

    yield from _named_thread(spin)


def test_an_idle_worker_is_waited_for_no_longer_than_one_window(
    idle_worker: threading.Event,
) -> None:
    assert len(gloo_worker_threads()) >= 1
    assert wait_for_idle_gloo_workers(timeout=5.0)


def test_a_worker_that_keeps_running_is_waited_for_until_the_timeout(
    busy_worker: threading.Event, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        assert not wait_for_idle_gloo_workers(timeout=0.3)
    assert "1 gloo worker thread(s) still busy" in caplog.text


def test_a_worker_that_stops_is_not_waited_for(busy_worker: threading.Event) -> None:
    busy_worker.set()  # the thread ends: it was busy, then there is nothing to wait for
    assert wait_for_idle_gloo_workers(timeout=5.0)
