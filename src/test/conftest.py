"""Shared pytest set-up: the test helpers are importable as ``testutils`` from every test file."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# Every test checks that no process group is used by two threads at once (inherited by the
# ranks and scripts the tests start).
os.environ.setdefault("OLMOLIKE_DEBUG_GROUPS", "1")


@pytest.fixture(autouse=True)
def _reset_root_logging() -> None:
    """Keep a test's logging set-up from leaking into the next one."""
    logging.getLogger().setLevel(logging.INFO)
