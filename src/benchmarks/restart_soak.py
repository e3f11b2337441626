"""Restart soak: SIGKILL ranks of one run N times at random moments; it must still finish.

One run of a tiny transformer (75k parameters, an async save every step: ephemeral ones, and
a permanent one every 5 steps) is started under ``olmolike train --max-restarts`` (or
``torchrun --max-restarts``) with a plan of N kills drawn from a seeded RNG: a random rank dies
inside a step, before or after writing its shards of an async save, before a commit, inside a
load, while renewing the lease, or at a random time after its process started (imports,
rendezvous and teardown included). Each kill ends one start of the job; the launcher starts
all ranks again, and they resume from the newest complete checkpoint. The same run is also
trained once without kills. The table says how many kills happened, how many starts the job
took (a start that failed without a planned kill is counted apart: there should be none), the
final step, and whether the final model and optimizer state equal the uninterrupted run's,
bit for bit. The kill points are the test suite's (``src/test/kill_points.py``).

    .venv/bin/python src/benchmarks/restart_soak.py                   # 50 kills, 2 FSDP ranks
    .venv/bin/python src/benchmarks/restart_soak.py --kills 10 --ranks 4 --layout tp-fsdp
    .venv/bin/python src/benchmarks/restart_soak.py --launcher torchrun --seed 3

It exits 1 if the run did not finish or its state differs from the uninterrupted run's.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parents[1] / "test"))

from kill_points import POINTS, Kill, done_kills, kill_env, starts, write_plan

from olmolike.data import prepare_data
from olmolike.data.numpy_data_loader import NumpyDataLoaderConfig
from olmolike.data.numpy_dataset import NumpyDatasetConfig
from olmolike.distributed.checkpoint_reader import load_keys
from olmolike.experiment import ExperimentConfig
from olmolike.nn import TransformerConfig
from olmolike.train import Duration, TrainerConfig
from olmolike.train.callbacks import CheckpointerCallback
from olmolike.train.checkpoint import Checkpointer
from olmolike.train.train_module import TransformerTrainModuleConfig

SEQ = 32
LAYOUTS = {
    "fsdp": ["--train_module.dp_config.name=fsdp"],
    "tp-fsdp": ["--train_module.dp_config.name=fsdp", "--train_module.tp_config.degree=2"],
    "ddp": ["--train_module.dp_config.name=ddp"],
}
WEIGHTS = {"step": 3, "save_begin": 1, "save_written": 2, "commit": 1, "load": 1, "heartbeat": 1,
           "time": 3}  # fmt: skip
"""How often each kill point is drawn."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--kills", type=int, default=50, help="kills to plan (default: %(default)s)"
    )
    parser.add_argument("--ranks", type=int, default=2, help="ranks (default: %(default)s)")
    parser.add_argument("--layout", choices=list(LAYOUTS), default="fsdp")
    parser.add_argument("--launcher", choices=["olmolike", "torchrun"], default="olmolike")
    parser.add_argument("--seed", type=int, default=0, help="of the kill plan (default: 0)")
    parser.add_argument(
        "--steps", type=int, default=None, help="the run's length (default: 2 x kills + 6)"
    )
    parser.add_argument("--work-dir", default=None, help="default: a temporary directory")
    args = parser.parse_args()
    steps = args.steps or 2 * args.kills + 6
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="restart-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    tokens = _tokens(work)
    kills = plan_kills(args.kills, args.ranks, random.Random(args.seed))

    started = time.monotonic()
    _run(args, _experiment(work / "reference", tokens, steps), [], work / "reference")
    reference_seconds = time.monotonic() - started
    started = time.monotonic()
    plan = write_plan(work / "killed" / "kills", kills)
    restarts = args.kills + max(2, args.kills // 10)  # spare restarts: unplanned failures show
    status = _run(
        args, _experiment(work / "killed", tokens, steps), kills, work / "killed", restarts
    )
    killed_seconds = time.monotonic() - started

    done = done_kills(plan)
    n_starts = starts(plan)
    final = Checkpointer.latest_checkpoint(str(work / "killed" / "run"))
    final_step = int(final.rsplit("step", 1)[1])
    equal = final_step == steps and _state(final) == _state(
        Checkpointer.latest_checkpoint(str(work / "reference" / "run"))
    )
    _report(args, steps, kills, done, n_starts, status, final_step, equal,
            reference_seconds, killed_seconds, work)  # fmt: skip
    return 0 if status == 0 and equal else 1


def plan_kills(count: int, ranks: int, rng: random.Random) -> list[Kill]:
    """``count`` kills at random points, ranks and moments (the first is never in a load: the
    first start has nothing to load)."""
    points, weights = list(WEIGHTS), list(WEIGHTS.values())
    kills = []
    for i in range(count):
        point = rng.choices(points, weights)[0]
        while i == 0 and point == "load":
            point = rng.choices(points, weights)[0]
        rank = 0 if point in ("commit", "heartbeat") else rng.randrange(ranks)
        nth = {"load": 1, "heartbeat": rng.randint(1, 6)}.get(point, rng.randint(1, 3))
        seconds = round(rng.uniform(1.0, 15.0), 2) if point == "time" else 0.0
        kills.append(Kill(point, rank=rank, nth=nth, seconds=seconds))
    return kills


def _tokens(work: Path) -> Path:
    text = work / "corpus.txt"
    text.write_text("".join(f"line {i}: the quick brown fox jumps over {i}\n" for i in range(600)))
    prepare_data([text], work / "tokens")
    return work / "tokens"


def _experiment(folder: Path, tokens: Path, steps: int) -> Path:
    config = ExperimentConfig(
        run_name="restart-soak",
        model=TransformerConfig(
            vocab_size=272, d_model=32, n_layers=2, n_heads=4, max_sequence_length=SEQ
        ),
        dataset=NumpyDatasetConfig(paths=[str(tokens)], sequence_length=SEQ),
        data_loader=NumpyDataLoaderConfig(global_batch_size=4 * SEQ, seed=0),
        train_module=TransformerTrainModuleConfig(rank_microbatch_size=SEQ),
        trainer=TrainerConfig(
            save_folder=str(folder / "run"),
            work_dir=str(folder / "work"),
            max_duration=Duration.steps(steps),
            metrics_collect_interval=10,
            callbacks={
                "checkpointer": CheckpointerCallback(
                    save_interval=5, ephemeral_save_interval=1, save_async=True
                )
            },
        ),
    )
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "experiment.yaml"
    path.write_text(config.to_yaml())
    return path


def _run(
    args: argparse.Namespace, experiment: Path, kills: list[Kill], folder: Path, restarts: int = 0
) -> int:
    if args.launcher == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={args.ranks}", f"--max-restarts={restarts}",
                   "-m", "olmolike", "train"]  # fmt: skip
    else:
        command = [sys.executable, "-m", "olmolike", "train", f"--nproc-per-node={args.ranks}",
                   f"--max-restarts={restarts}"]  # fmt: skip
    command += [str(experiment), *LAYOUTS[args.layout], "--trainer.checkpointer.lease_timeout=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if kills:
        env.update(kill_env(folder / "kills"))
    with open(folder / "job.log", "w") as log:
        return subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT).returncode


def _state(checkpoint: str) -> dict[str, object]:
    flat: dict[str, object] = {}

    def add(prefix: str, value: object) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                add(f"{prefix}.{key}", item)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                add(f"{prefix}.{i}", item)
        else:
            flat[prefix] = value.clone() if isinstance(value, torch.Tensor) else value

    for key, value in zip(("model", "optim"), load_keys(checkpoint, ["model", "optim"])):
        add(key, value)
    return {k: (v.numpy().tobytes() if isinstance(v, torch.Tensor) else v) for k, v in flat.items()}


def _report(
    args: argparse.Namespace,
    steps: int,
    kills: list[Kill],
    done: list[dict[str, object]],
    n_starts: int,
    status: int,
    final_step: int,
    equal: bool,
    reference_seconds: float,
    killed_seconds: float,
    work: Path,
) -> None:
    console = Console(width=150)
    title = (
        f"Restart soak: {args.ranks} ranks, {args.layout}, {args.launcher} --max-restarts, "
        f"{steps} steps, seed {args.seed}"
    )
    table = Table(title=title)
    for column in ("kills planned", "kills done", "starts", "restarts", "unplanned failures",
                   "final step", "state = uninterrupted", "exit", "wall s",
                   "uninterrupted wall s"):  # fmt: skip
        table.add_column(column, justify="right")
    restarts = max(0, n_starts - 1)
    table.add_row(
        str(len(kills)), str(len(done)), str(n_starts), str(restarts),
        str(restarts - len(done)), f"{final_step}/{steps}", "yes" if equal else "NO",
        str(status), f"{killed_seconds:.0f}", f"{reference_seconds:.0f}",
    )  # fmt: skip
    console.print(table)
    by_point = Table(title="Kills by point")
    by_point.add_column("point")
    by_point.add_column("planned", justify="right")
    by_point.add_column("done", justify="right")
    planned, happened = Counter(k.point for k in kills), Counter(str(d["point"]) for d in done)
    for point in POINTS:
        by_point.add_row(point, str(planned[point]), str(happened[point]))
    console.print(by_point)
    console.print(f"work directory (job.log, kills/): {work}")


if __name__ == "__main__":
    sys.exit(main())
