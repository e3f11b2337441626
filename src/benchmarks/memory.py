"""This process's resident memory, read from ``/proc`` (Linux): what the checkpoint benchmarks
report as memory held and peak memory."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import re
from collections.abc import Iterator
from pathlib import Path

CLEAR_REFS = Path("/proc/self/clear_refs")
GB = 1e9


def status_bytes(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``), in bytes."""
    with open("/proc/self/status") as f:
        match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    assert match is not None, f"/proc/self/status has no {field}"
    return int(match.group(1)) * 1024


def rss() -> int:
    """Resident memory now, after returning freed memory to the system (not allocator
    caches, which would count memory nobody holds)."""
    gc.collect()
    # Not glibc: no malloc_trim, and the figure includes malloc's free lists.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return status_bytes("VmRSS")


def reset_peak() -> None:
    """Start a new high-water mark (``VmHWM``) at the current resident memory."""
    CLEAR_REFS.write_text("5")  # Linux >= 4.0


@contextlib.contextmanager
def peak_above(
    base: float, figures: dict[str, float], name: str, unit: float = 1.0
) -> Iterator[None]:
    """Put the kernel's peak resident memory during the block, over ``base`` bytes, in
    ``figures[name]`` (in bytes / ``unit``). The kernel tracks it at every page fault: nothing is missed
    between samples, and no sampling thread competes with what is measured."""
    reset_peak()
    yield
    figures[name] = (status_bytes("VmHWM") - base) / unit
