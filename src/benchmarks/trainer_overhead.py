"""How much throughput does olmolike's ``Trainer`` cost over a hand-written PyTorch loop?

Both loops do identical work on the CPU: the same ``TinyCausalLM`` (re-initialised from the
same seed for every timed run), AdamW, one micro-batch per step, ``clip_grad_norm_`` at 1.0,
and the mean float32 cross-entropy over next-token labels (``input_ids`` shifted left, padded
with -100). The token batches are built once, before any timing: the hand-written loop iterates
over that list, and the trainer reads the same tokens through a ``TokenTensorDataLoader`` with
``shuffle=False``. The hand-written loop is deliberately tight: forward, loss, backward, clip,
step, ``zero_grad(set_to_none=True)``, with no ``.item()`` and no bookkeeping. The trainer runs
as a user would run it: default callbacks, ``metrics_collect_interval=5``,
``cancel_check_interval=25``, no checkpoints. The steps of ``Trainer.fit()`` are timed, not
building the trainer, nor the start and end of ``fit()`` (loading, starting trackers).
After the first round the final weights of both loops are compared, to show they trained alike.

Methodology. Both loops are first warmed up (allocator, kernels, lazy imports). Then they run
alternately in one process for many short rounds (each run a second or two), swapping which
goes first each round. On a shared machine the speed drifts and jumps over seconds (other
processes, thermal limits, memory placement); timing all hand-written runs and then all trainer
runs would fold that drift into the ratio, whereas two adjacent runs see nearly the same
machine. The per-round ratio of tokens/s (trainer / hand-written) is reported, with its median,
which a few disturbed rounds do not move, and its min-max spread, which shows how noisy the
machine was. Everything runs on the CPU, with an explicit ``torch.set_num_threads``.

The verdict comes from the lockstep measurement (:class:`LockstepHand`): every trainer step is
followed by a hand-written step on the same model, and the ratio of their times is taken per
step. Its median over a run leaves out the one step in ``metrics_collect_interval`` that
collects metrics; the median over windows of that many steps, also printed, includes it. The
verdict is the median over ``--lockstep-runs`` runs (3) of each run's per-step median.

Run it with ``python src/benchmarks/trainer_overhead.py`` (``make bench``); ``--quick`` is a
smoke check. It always exits 0: it measures, it does not test.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import logging
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from discarding_sinks import DiscardingAimSink, DiscardingWandBSink
from rich.console import Console
from rich.table import Table

from olmolike.data import TokenTensorDataLoader
from olmolike.testing import TinyCausalLM, random_token_instances
from olmolike.train import (
    BasicTrainModule,
    Callback,
    Duration,
    Trainer,
    TrainerConfig,
    prepare_training_environment,
)
from olmolike.train.callbacks import (
    AimCallback,
    ConfigSaverCallback,
    EarlyStoppingCallback,
    GarbageCollectorCallback,
    GPUMemoryMonitorCallback,
    MetricSaverCallback,
    ProgressCallback,
    SpeedMonitorCallback,
    StabilityMonitorCallback,
    TensorBoardCallback,
    WandBCallback,
)

IGNORE_INDEX = -100
MAX_GRAD_NORM = 1.0
LEARNING_RATE = 1e-3
SEED = 0


@dataclass(frozen=True)
class Size:
    """A model and batch shape, with its default run length and the ratio it should reach."""

    name: str
    d_model: int
    n_layers: int
    seq_len: int
    batch_size: int
    """Instances per step; the whole batch is one micro-batch."""
    steps: int
    """Timed steps per run, by default."""
    target: float
    """The trainer's tokens/s should be at least this fraction of the hand-written loop's."""
    vocab_size: int = 1024
    n_heads: int = 4
    lockstep_steps: int = 200
    """Steps of the lockstep measurement, the one the verdict uses: enough that its median
    is stable to a few tenths of a percent on a noisy machine (about 40 s per size)."""

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.batch_size


SIZES = (
    Size(
        "small",
        d_model=64,
        n_layers=2,
        seq_len=128,
        batch_size=2,
        steps=120,
        target=0.98,
        lockstep_steps=1000,
    ),
    Size(
        "medium",
        d_model=256,
        n_layers=4,
        seq_len=128,
        batch_size=4,
        steps=12,
        target=0.99,
        lockstep_steps=120,
    ),
)


@dataclass(frozen=True)
class Settings:
    rounds: int
    warmup_steps: int
    steps: int | None
    """Overrides every size's default steps per run."""
    save_folder: str


@dataclass(frozen=True)
class SizeResult:
    size: Size
    steps: int
    params: int
    hand_s: list[float]
    """Seconds per timed run, one per round."""
    trainer_s: list[float]
    max_weight_diff: float

    def tokens_per_s(self, seconds: float) -> float:
        return self.steps * self.size.tokens_per_step / seconds

    def ms_per_step(self, runs: list[float]) -> float:
        return statistics.median(runs) / self.steps * 1e3

    @property
    def ratios(self) -> list[float]:
        """Trainer tokens/s over hand-written tokens/s, per round."""
        return [hand / trainer for hand, trainer in zip(self.hand_s, self.trainer_s)]

    @property
    def overhead_us_per_step(self) -> float:
        """The median over rounds of the trainer's extra time per step."""
        extra = [trainer - hand for hand, trainer in zip(self.hand_s, self.trainer_s)]
        return statistics.median(extra) / self.steps * 1e6


def build_model(size: Size) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(SEED)
    model = TinyCausalLM(
        vocab_size=size.vocab_size,
        d_model=size.d_model,
        n_layers=size.n_layers,
        n_heads=size.n_heads,
        max_seq_len=size.seq_len,
    )
    return model, torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)


def hand_step(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    params: list[nn.Parameter],
    input_ids: torch.Tensor,
) -> None:
    """One step of the reference loop, with no host syncs (CPU ops are synchronous anyway)."""
    labels = F.pad(input_ids[:, 1:], (0, 1), value=IGNORE_INDEX)
    logits = model(input_ids)
    # A mean over the non-ignored labels, as BasicTrainModule normalises its summed loss.
    loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=IGNORE_INDEX
    )
    loss.backward()
    nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
    optim.step()
    optim.zero_grad(set_to_none=True)


def hand_loop(model: nn.Module, optim: torch.optim.Optimizer, batches: list[torch.Tensor]) -> None:
    """The reference: a tight loop of :func:`hand_step`."""
    params = list(model.parameters())
    model.train()
    for input_ids in batches:
        hand_step(model, optim, params, input_ids)


def time_hand(size: Size, batches: list[torch.Tensor]) -> tuple[float, nn.Module]:
    """Seconds for the hand-written loop over ``batches`` from a fresh model, and the model."""
    model, optim = build_model(size)
    gc.collect()
    start = time.perf_counter()
    hand_loop(model, optim, batches)
    return time.perf_counter() - start, model


def library_callbacks() -> dict[str, Callback]:
    """Every built-in callback that runs without a GPU, a network service or eval data, at its
    default settings (W&B offline), and whose optional package is installed: what
    ``--with-callbacks`` adds to the trainer."""
    optional: dict[str, Callback] = {}
    if importlib.util.find_spec("wandb") is not None:
        optional["wandb"] = WandBCallback(mode="offline")
    if importlib.util.find_spec("aim") is not None:
        optional["aim"] = AimCallback()
    callbacks: dict[str, Callback] = {
        **optional,
        "speed_monitor": SpeedMonitorCallback(),
        "gpu_memory_monitor": GPUMemoryMonitorCallback(),
        "garbage_collector": GarbageCollectorCallback(),
        "progress": ProgressCallback(),
        "metric_saver": MetricSaverCallback(),
        "config_saver": ConfigSaverCallback(config={"benchmark": "trainer_overhead"}),
        "stability_monitor": StabilityMonitorCallback(),
        "early_stopping": EarlyStoppingCallback(),
        "tensorboard": TensorBoardCallback(),
    }
    return {name: cb for name, cb in callbacks.items() if name not in SKIPPED_CALLBACKS}


WITH_LIBRARY_CALLBACKS = False
SKIPPED_CALLBACKS: set[str] = set()
"""Set by ``--with-callbacks``: every trainer the benchmark builds gets :func:`library_callbacks`."""


def build_trainer(
    size: Size, instances: torch.Tensor, save_folder: str, extra: dict[str, Callback] | None = None
) -> tuple[Trainer, nn.Module]:
    model, optim = build_model(size)
    train_module = BasicTrainModule(
        model, optim, rank_microbatch_size=size.tokens_per_step, max_grad_norm=MAX_GRAD_NORM
    )
    loader = TokenTensorDataLoader(instances, global_batch_size=size.tokens_per_step, shuffle=False)
    config = TrainerConfig(
        save_folder=save_folder,
        max_duration=Duration.steps(instances.shape[0] // size.batch_size),
        no_checkpoints=True,
        device="cpu",
        callbacks={**(library_callbacks() if WITH_LIBRARY_CALLBACKS else {}), **(extra or {})},
    )
    return config.build(train_module, loader), model


@dataclass
class TrainingClock(Callback):
    """Times the training steps of ``fit()``: from the end of ``pre_train`` to the end of the
    last step. Starting a tracker's process (W&B, Aim: seconds, once per run) and waiting for
    it at the end would otherwise swamp runs of a second or two."""

    started: float = 0.0
    seconds: float = 0.0
    priority = -1000  # after every other callback's pre_train and post_step

    def pre_train(self) -> None:
        self.started = time.perf_counter()

    def post_step(self) -> None:
        if self.trainer.training_complete:
            self.seconds = time.perf_counter() - self.started


def time_trainer(size: Size, instances: torch.Tensor, save_folder: str) -> tuple[float, nn.Module]:
    """Seconds of training steps in ``Trainer.fit()`` over one epoch of ``instances``."""
    clock = TrainingClock()
    trainer, model = build_trainer(size, instances, save_folder, {"training_clock": clock})
    gc.collect()
    trainer.fit()
    return clock.seconds, model


@dataclass
class LockstepHand(Callback):
    """Runs one hand-written step right after each trainer step, timing both.

    It runs last in ``post_step``, so the time from the end of one hand step to the start of
    the next is everything the trainer did for one step: loading, the step, every hook, metric
    collection and bookkeeping. Adjacent measurements milliseconds apart see the same machine,
    which rounds of whole runs (seconds apart) on a noisy machine do not.
    """

    model: nn.Module | None = None
    optim: torch.optim.Optimizer | None = None
    batches: list[torch.Tensor] = field(default_factory=list)
    trainer_s: list[float] = field(default_factory=list)
    hand_s: list[float] = field(default_factory=list)
    _mark: float | None = None
    _params: list[nn.Parameter] = field(default_factory=list)
    _calls: int = 0

    priority = -100

    def train(self, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        """Take hand-written steps on ``model`` and ``optim`` (the trainer's own)."""
        self.model, self.optim, self._params = model, optim, list(model.parameters())

    def post_step(self) -> None:
        # Its own bookkeeping counts as the trainer's time: kept to a few plain operations.
        batch = self.batches[self._calls % len(self.batches)]
        self._calls += 1
        start = time.perf_counter()
        if self._mark is not None:
            self.trainer_s.append(start - self._mark)
        hand_step(self.model, self.optim, self._params, batch)
        self._mark = time.perf_counter()
        self.hand_s.append(self._mark - start)


@dataclass(frozen=True)
class Lockstep:
    ratio: float
    """Median over steps of hand / trainer step time: the verdict."""
    extra_us: float
    """Median over steps of the trainer's extra microseconds."""
    window_ratio: float
    """Median over windows of ``metrics_collect_interval`` steps of hand / trainer time. Each
    window holds one metric collection (with every ``log_metrics`` call), which the per-step
    median leaves out as one step in five."""


def measure_lockstep(size: Size, steps: int, warmup: int, save_folder: str) -> Lockstep:
    """Hand-written and trainer step times, measured in lockstep (see :class:`LockstepHand`).

    The hand-written steps train the trainer's own model and optimizer: both loops touch the
    same memory, so a run in which one model happened to land at slower addresses (a bias
    that lasts the whole run on these VMs) does not show up as overhead.
    """
    instances = random_token_instances(
        steps * size.batch_size, size.seq_len, size.vocab_size, seed=SEED
    )
    probe = LockstepHand(batches=[b.clone() for b in instances.split(size.batch_size)])
    trainer, model = build_trainer(size, instances, save_folder, {"lockstep": probe})
    probe.train(model, trainer.train_module.optim)  # type: ignore[attr-defined]
    trainer.fit()
    pairs = list(zip(probe.trainer_s, probe.hand_s[1:]))[warmup:]
    ratios = [hand / trainer for trainer, hand in pairs]
    extra_us = [(trainer - hand) * 1e6 for trainer, hand in pairs]
    every = trainer.metrics_collect_interval
    windows = [pairs[i : i + every] for i in range(0, len(pairs) - every + 1, every)]
    window_ratios = [sum(h for _, h in w) / sum(t for t, _ in w) for w in windows]
    return Lockstep(
        statistics.median(ratios), statistics.median(extra_us), statistics.median(window_ratios)
    )


def median_lockstep(runs: list[Lockstep]) -> Lockstep:
    """Each figure's median over several lockstep runs: a run whose whole minute the machine
    was slower (these VMs drift by about +-0.5% between minutes) does not decide the verdict."""
    return Lockstep(
        statistics.median(r.ratio for r in runs),
        statistics.median(r.extra_us for r in runs),
        statistics.median(r.window_ratio for r in runs),
    )


def max_weight_diff(a: nn.Module, b: nn.Module) -> float:
    return max((pa - pb).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters()))


def hand_first(round_index: int) -> bool:
    """Which loop runs first in a round: they take turns, so neither always runs warmer."""
    return round_index % 2 == 0


def measure(size: Size, settings: Settings) -> SizeResult:
    steps = settings.steps or size.steps
    instances = random_token_instances(
        steps * size.batch_size, size.seq_len, size.vocab_size, seed=SEED
    )
    batches = [batch.clone() for batch in instances.split(size.batch_size)]
    warmup = settings.warmup_steps
    time_hand(size, batches[:warmup])
    time_trainer(size, instances[: warmup * size.batch_size], settings.save_folder)
    params = sum(p.numel() for p in build_model(size)[0].parameters())
    hand_s, trainer_s, weight_diff = [], [], 0.0
    for round_index in range(settings.rounds):
        if hand_first(round_index):
            hand, hand_model = time_hand(size, batches)
            trainer, trainer_model = time_trainer(size, instances, settings.save_folder)
        else:
            trainer, trainer_model = time_trainer(size, instances, settings.save_folder)
            hand, hand_model = time_hand(size, batches)
        if round_index == 0:
            weight_diff = max_weight_diff(hand_model, trainer_model)
        hand_s.append(hand)
        trainer_s.append(trainer)
    return SizeResult(size, steps, params, hand_s, trainer_s, weight_diff)


def rounds_table(result: SizeResult) -> Table:
    table = Table(title=f"{result.size.name}: per round ({result.steps} steps per run)")
    for column in ("round", "first", "tokens/s hand", "tokens/s trainer", "ratio"):
        table.add_column(column, justify="right", no_wrap=True)
    for i, (hand, trainer, ratio) in enumerate(zip(result.hand_s, result.trainer_s, result.ratios)):
        table.add_row(
            str(i + 1),
            "hand" if hand_first(i) else "trainer",
            f"{result.tokens_per_s(hand):,.0f}",
            f"{result.tokens_per_s(trainer):,.0f}",
            f"{ratio:.4f}",
        )
    return table


def summary_table(results: list[SizeResult]) -> Table:
    table = Table(title="Trainer vs hand-written loop (medians over rounds)")
    columns = [
        "size",
        "params",
        "ms/step\n(hand)",
        "ms/step\n(trainer)",
        "tokens/s\nhand",
        "tokens/s\ntrainer",
        "ratio\n(median)",
        "ratio\nrange",
    ]
    for column in columns:
        table.add_column(column, justify="right", no_wrap=True)
    for r in results:
        table.add_row(
            r.size.name,
            f"{r.params:,d}",
            f"{r.ms_per_step(r.hand_s):.2f}",
            f"{r.ms_per_step(r.trainer_s):.2f}",
            f"{r.tokens_per_s(statistics.median(r.hand_s)):,.0f}",
            f"{r.tokens_per_s(statistics.median(r.trainer_s)):,.0f}",
            f"{statistics.median(r.ratios):.4f}",
            f"{min(r.ratios):.4f}-{max(r.ratios):.4f}",
        )
    return table


def print_targets(
    console: Console, results: list[SizeResult], lockstep: dict[str, list[Lockstep]]
) -> None:
    for r in results:
        runs = lockstep[r.size.name]
        ls = median_lockstep(runs)
        verdict = "[green]met[/]" if ls.ratio >= r.size.target else "[red]NOT met[/]"
        console.print(
            f"target {r.size.name}: ratio >= {r.size.target:.2f}: {verdict} -- lockstep median "
            f"{ls.ratio:.4f} (runs: {', '.join(f'{run.ratio:.4f}' for run in runs)}), "
            f"trainer - hand = "
            f"{ls.extra_us:+.0f} us/step; median over collection windows "
            f"{ls.window_ratio:.4f}; whole-run rounds: median "
            f"{statistics.median(r.ratios):.4f} (range {min(r.ratios):.4f}-{max(r.ratios):.4f})\n"
            f"    max |weight difference| between the two loops after round 1: "
            f"{r.max_weight_diff:.2e}"
        )


def print_setup(
    console: Console, settings: Settings, threads: int, sizes: tuple[Size, ...]
) -> None:
    console.print(
        f"torch {torch.__version__}, device cpu, torch.set_num_threads({threads}) "
        f"(interop threads {torch.get_num_interop_threads()}), {settings.rounds} rounds, "
        f"{settings.warmup_steps} warm-up steps per loop"
    )
    console.print(
        "Logging: the 'olmolike' loggers are set to WARNING: the default ConsoleLoggerCallback "
        "(log_interval=1)\nstill runs at every metric collection, but its INFO records are dropped."
    )
    if WITH_LIBRARY_CALLBACKS:
        console.print(f"With the library callbacks: {', '.join(library_callbacks())}")
    if WandBCallback.sink_class is DiscardingWandBSink:
        console.print("W&B and Aim sinks discard what they receive (--discard-tracker-metrics)")
    for size in sizes:
        console.print(
            f"{size.name}: TinyCausalLM d_model={size.d_model} n_layers={size.n_layers} "
            f"n_heads={size.n_heads} vocab={size.vocab_size}; batch {size.batch_size} x "
            f"seq {size.seq_len} = {size.tokens_per_step} tokens/step, one micro-batch"
        )


def usable_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--quick", action="store_true", help="a short smoke run on the smallest size only"
    )
    parser.add_argument(
        "--with-callbacks",
        action="store_true",
        help="add every built-in callback that needs no GPU, service or eval data",
    )
    parser.add_argument(
        "--skip",
        default="",
        help="comma-separated callbacks to leave out of --with-callbacks, e.g. 'wandb,aim'",
    )
    parser.add_argument(
        "--discard-tracker-metrics",
        action="store_true",
        help="run the W&B and Aim callbacks with sinks that discard what they receive: "
        "olmolike's cost for a tracker without the tracker SDK's own work",
    )
    parser.add_argument("--steps", type=int, help="timed steps per run, for every size")
    parser.add_argument("--rounds", type=int, help="alternating rounds per size (default 15)")
    parser.add_argument(
        "--lockstep-runs",
        type=int,
        default=3,
        help="lockstep runs per size; the verdict is their median (default 3)",
    )
    parser.add_argument(
        "--threads", type=int, default=usable_cores(), help="torch threads (default: all cores)"
    )
    args = parser.parse_args()
    for name in ("steps", "rounds", "threads", "lockstep_runs"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    return args


def main() -> None:
    global WITH_LIBRARY_CALLBACKS
    args = parse_args()
    WITH_LIBRARY_CALLBACKS = args.with_callbacks
    SKIPPED_CALLBACKS.update(name for name in args.skip.split(",") if name)
    if args.discard_tracker_metrics:
        WandBCallback.sink_class = DiscardingWandBSink  # type: ignore[assignment]
        AimCallback.sink_class = DiscardingAimSink  # type: ignore[assignment]
    os.environ.setdefault("WANDB_SILENT", "true")
    prepare_training_environment(backend=None)
    logging.getLogger("olmolike").setLevel(logging.WARNING)
    torch.set_num_threads(args.threads)
    console = Console(width=120)
    with tempfile.TemporaryDirectory(prefix="trainer-overhead-") as save_folder:
        settings = Settings(
            rounds=args.rounds or (2 if args.quick else 15),
            warmup_steps=2 if args.quick else 5,
            steps=args.steps or (5 if args.quick else None),
            save_folder=save_folder,
        )
        sizes = SIZES[:1] if args.quick else SIZES
        print_setup(console, settings, args.threads, sizes)
        results, lockstep = [], {}
        for size in sizes:
            results.append(measure(size, settings))
            console.print(rounds_table(results[-1]))
            # --quick: the warm-up steps, then one window of metrics_collect_interval (5)
            # steps (the window median needs one), and the step that closes it.
            lockstep_steps = settings.warmup_steps + 6 if args.quick else size.lockstep_steps
            lockstep[size.name] = [
                measure_lockstep(size, lockstep_steps, settings.warmup_steps, save_folder)
                for _ in range(1 if args.quick else args.lockstep_runs)
            ]
    console.print(summary_table(results))
    print_targets(console, results, lockstep)


if __name__ == "__main__":
    main()
