"""Shared pytest set-up: the test helpers are importable as ``testutils`` from every test file."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from olmolike.testing import busy_machine_factor

# Every test checks that no process group is used by two threads at once (inherited by the
# ranks and scripts the tests start).
os.environ.setdefault("OLMOLIKE_DEBUG_GROUPS", "1")


@pytest.fixture(autouse=True)
def _reset_root_logging() -> None:
    """Keep a test's logging set-up from leaking into the next one."""
    logging.getLogger().setLevel(logging.INFO)


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
