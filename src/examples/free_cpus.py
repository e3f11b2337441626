"""How many torch threads the demos use (``make run``, ``make grpo``, ...) unless
``OMP_NUM_THREADS`` is set: the CPUs this process may run on less the load on them.

Each training step splits its matrix products over the threads and waits for the last one.
On a machine whose cores other work keeps busy, threads beyond the free cores wait their turn,
and every step waits with them: on a loaded 2-core machine the same 200-step run took 26-84 s
with 1 thread and 165-239 s with 2. So: the CPUs in this process's affinity mask, less the
1-minute load average (rounded), at least 1. Standard library only (the Makefile runs it with
any Python, before torch is imported). ``python src/examples/free_cpus.py`` prints the number.
"""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask; all of them where there is none)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def free_cpus(cpus: int | None = None, load: float | None = None) -> int:
    """``cpus`` (default: :func:`usable_cpus`) less ``load`` (default: the 1-minute load
    average, 0 where the system has none), rounded, between 1 and ``cpus``."""
    cpus = usable_cpus() if cpus is None else cpus
    if load is None:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return max(1, min(cpus, round(cpus - load)))


if __name__ == "__main__":
    print(free_cpus())
