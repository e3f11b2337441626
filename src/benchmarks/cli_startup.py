"""How long does ``olmolike --help`` take, and each ``olmolike COMMAND --help``, next to
starting Python itself?

The ``olmolike`` command imports a subcommand's module (most import torch, seconds of CPU)
only when that subcommand runs; the help of every command, the top-level one included, and a
mistyped command need none of them. This runs each help and ``python -c pass`` alternately, in
fresh processes (no warm module cache but the operating system's file cache, as for a user),
and prints for each the median wall time and the median CPU time (user + system, from
``getrusage``: what a busy machine makes slower, and what the target of 0.5 s is about), and
the ratio of the top-level help's wall time to ``python -c pass``'s. A ratio near 1-5 means
the help imports nothing heavy; importing torch alone makes it ~50-150x on a 2-core CPU.

Run it with ``python src/benchmarks/cli_startup.py`` (``--quick``: one round). It always
exits 0: it measures, it does not test (``src/test/test_cli_help.py`` checks that no help
imports torch or matplotlib).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

SRC = Path(__file__).parents[1]
sys.path.insert(0, str(SRC))

from olmolike.cli import COMMANDS  # noqa: E402 (after the path: a checkout, installed or not)


def times(command: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall and CPU seconds of one run of ``command``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="runs of each command")
    parser.add_argument("--quick", action="store_true", help="1 round: a smoke check")
    args = parser.parse_args()
    rounds = 1 if args.quick else args.rounds
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
    }
    olmolike = [sys.executable, "-m", "olmolike"]
    commands = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "olmolike --help": [*olmolike, "--help"],
        **{f"olmolike {name} --help": [*olmolike, name, "--help"] for name in COMMANDS},
    }
    times(commands["olmolike --help"], env)  # warm the file cache once
    walls: dict[str, list[float]] = {name: [] for name in commands}
    cpus: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(rounds):
        for name, command in commands.items():
            wall, cpu = times(command, env)
            walls[name].append(wall)
            cpus[name].append(cpu)
    width = max(map(len, commands))
    print(f"{'command':{width}s}  wall median (min-max) s   CPU median s   ({rounds} runs)")
    for name in commands:
        spread = f"({min(walls[name]):.3f}-{max(walls[name]):.3f})"
        wall, cpu = statistics.median(walls[name]), statistics.median(cpus[name])
        print(f"{name:{width}s}  {wall:.3f} {spread:17s}  {cpu:.3f}")
    slowest = max(commands, key=lambda name: statistics.median(cpus[name]))
    print(f"most CPU: {slowest} ({statistics.median(cpus[slowest]):.3f} s; target < 0.5 s)")
    ratio = statistics.median(walls["olmolike --help"]) / statistics.median(walls["python -c pass"])
    print(f"ratio olmolike --help / python -c pass: {ratio:.1f}x")


if __name__ == "__main__":
    main()
