"""How long does ``olmolike --help`` take, next to starting Python itself?

The ``olmolike`` command imports a subcommand's module (most import torch, seconds of CPU)
only when that subcommand runs; the top-level help and a mistyped command need none of them.
This runs ``python -m olmolike --help`` and ``python -c pass`` alternately, in fresh processes
(no warm module cache but the operating system's file cache, as for a user), and prints the
median wall time of each and their ratio. A ratio near 1-5 means the help imports nothing
heavy; importing torch alone makes it ~50-150x on a 2-core CPU.

Run it with ``python src/benchmarks/cli_startup.py`` (``--quick``: fewer rounds). It always
exits 0: it measures, it does not test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SRC = Path(__file__).parents[1]


def wall_time(command: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="runs of each command")
    parser.add_argument("--quick", action="store_true", help="3 rounds: a smoke check")
    args = parser.parse_args()
    rounds = 3 if args.quick else args.rounds
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
    }
    commands = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "olmolike --help": [sys.executable, "-m", "olmolike", "--help"],
    }
    wall_time(commands["olmolike --help"], env)  # warm the file cache once
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(rounds):
        for name, command in commands.items():
            times[name].append(wall_time(command, env))
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, median in medians.items():
        spread = f"{min(times[name]):.3f}-{max(times[name]):.3f}"
        print(f"{name:18s} median {median:.3f} s  (min-max {spread} s over {rounds} runs)")
    ratio = medians["olmolike --help"] / medians["python -c pass"]
    print(f"ratio olmolike --help / python -c pass: {ratio:.1f}x")


if __name__ == "__main__":
    main()
