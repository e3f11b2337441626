"""Shared pytest set-up: the test helpers are importable as ``testutils`` from every test file."""

from __future__ import annotations

import functools
import logging
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# The storage servers' fixtures, registered here once for every test file: a session fixture
# imported into each test module would be a module's own, one server per module alive at once.
from remote_servers import (  # noqa: F401
    gcs_bucket,
    gcs_server,
    restartable_gcs_bucket,
    s3_bucket,
    s3_server,
)

from olmolike.testing import busy_machine_factor

# Every test checks that no process group is used by two threads at once (inherited by the
# ranks and scripts the tests start).
os.environ.setdefault("OLMOLIKE_DEBUG_GROUPS", "1")


def _share_the_cores() -> None:
    """Under pytest-xdist, each test process (and what it starts) gets its share of the cores
    for torch's threads, unless ``OMP_NUM_THREADS`` says otherwise: two workers on 2 cores with
    2 threads each run 4 busy threads on 2 cores, and OpenMP's waiting threads spin. test_trainer
    took 73 CPU seconds that way beside other work, 18 with one thread each."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 0 and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        import torch

        torch.set_num_threads(threads)


_share_the_cores()


@pytest.fixture(autouse=True)
def _reset_root_logging() -> Iterator[None]:
    """Keep a test's logging set-up from leaking into the next one: its level, and a handler
    it installed (``setup_logging`` in the test's process writes to the stderr pytest captured
    for that test, closed once it ends: a later test's log line then printed a "Logging error"
    traceback into that test's stderr, which one-line checks count; seen in the full suite)."""
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    before = set(root.handlers)
    yield
    for handler in list(root.handlers):
        if handler not in before and not type(handler).__module__.startswith("_pytest"):
            root.removeHandler(handler)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> Any:
    """Stretch each test's pytest-timeout by how busy the machine is right now.

    On a machine whose cores other work saturates, every test runs several times slower: its
    timeout (the marker's, or the ini default) is multiplied by ``busy_machine_factor()``, so
    the test still passes, and a hang still fails with pytest-timeout's message. Runs before
    pytest-timeout's own hook reads the marker.
    """
    factor = busy_machine_factor()
    marker = item.get_closest_marker("timeout")
    seconds = marker.args[0] if marker and marker.args else None
    if marker and seconds is None:
        seconds = marker.kwargs.get("timeout")
    if marker is None:
        seconds = item.config.getini("timeout")
    if seconds and factor > 1:
        args = marker.args[1:] if marker else ()
        kwargs = {k: v for k, v in (marker.kwargs if marker else {}).items() if k != "timeout"}
        stretched = pytest.mark.timeout(float(seconds) * factor, *args, **kwargs)
        item.add_marker(stretched, append=False)
    yield


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``make test``), long tests first: the tests marked ``slow`` or with a
    ``timeout`` of their own start while the short ones wait, and the short ones fill in at
    the end. A long test dealt last would keep its worker busy while the other one idles.
    A run without workers keeps the files' order."""
    if hasattr(config, "workerinput"):
        items.sort(key=lambda item: not _long(item))  # stable: the files' order otherwise


def _long(item: pytest.Item) -> bool:
    return any(item.get_closest_marker(name) is not None for name in ("slow", "timeout"))


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, which may be missing
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``-n N``: tests are dealt out one by one (xdist's ``load``), but those of a test file
    that shares a module- or class-scoped fixture go to one worker together, so that the
    fixture (a trained checkpoint, an example run) is built once, not on every worker.

    (xdist's own grouping, ``--dist loadgroup``, renames the tests, which pytest 9 ignores.)
    Large groups go first (xdist's ``loadscope`` order), then the other tests in the order of
    :func:`pytest_collection_modifyitems`.
    """
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SharedFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if _shares_a_fixture(config.rootpath / path) else nodeid

    return SharedFixtureScheduling(config, log)


@functools.cache
def _shares_a_fixture(path: Path) -> bool:
    """Whether a test file defines a module- or class-scoped fixture (read, not imported: the
    process that deals out the tests collects none)."""
    return re.search(r"scope=[\"'](module|class)[\"']", path.read_text()) is not None
