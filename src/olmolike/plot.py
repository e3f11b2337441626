"""Training curves from ``metrics.jsonl`` files (written by ``MetricSaverCallback``) as a PNG.

``olmolike plot runs/a runs/b -o curves.png`` draws loss, learning rate and throughput against
the step, one panel each, with the runs overlaid so they can be compared at a glance.
matplotlib is an optional dependency (``pip install 'olmolike[plot]'``): training never needs it.
"""

from __future__ import annotations

import argparse
import fnmatch
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import io
from .exceptions import DataError, OLMoLikeError

__all__ = [
    "DEFAULT_PANELS",
    "RunMetrics",
    "add_plot_command",
    "figure_for_runs",
    "load_run",
    "plot_runs",
]


METRICS_FILE = "metrics.jsonl"

DEFAULT_PANELS: dict[str, list[str]] = {
    "loss": ["train/*loss", "eval/*loss*"],
    "learning rate": ["optim/LR*"],
    "tokens per second": ["throughput/device/TPS"],
}
"""Panel title -> glob patterns of the metrics it shows. A panel nothing matches is left out."""

PANEL_UNITS: dict[str, str] = {
    "loss": "loss (nats/token)",
    "learning rate": "learning rate",
    "tokens per second": "tokens/s (one device)",
}
"""The y-axis label of a default panel (others are labelled with their metric pattern)."""

LINE_STYLES = ("-", "--", ":", "-.")
"""One per metric within a panel, so curves that overlap (LR of two groups) stay visible."""


@dataclass
class RunMetrics:
    """One run's curves: for each metric, the steps that logged it and the values."""

    name: str
    source: str
    curves: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)

    def matching(self, patterns: list[str]) -> list[str]:
        return sorted(
            name for name in self.curves if any(fnmatch.fnmatchcase(name, p) for p in patterns)
        )


def _metrics_path(path: str) -> str:
    """A run's save folder, or its metrics file itself, as the metrics file's path."""
    return path if path.endswith(".jsonl") else io.join_path(path, METRICS_FILE)


def _run_name(path: str) -> str:
    """The run's folder name: what a person calls the run, and short enough for a legend."""
    trimmed = path.rstrip("/")
    is_file = trimmed.endswith(".jsonl")
    if io.is_url(trimmed):
        parts = trimmed.split("/")
        return parts[-2] if is_file else parts[-1]
    resolved = Path(trimmed).resolve()
    return resolved.parent.name if is_file else resolved.name


def load_run(path: str | Path) -> RunMetrics:
    """Read the metrics file of a save folder (or the file itself, local or a URL)."""
    # Here, not at the top: the trainer's modules import torch, and `olmolike plot --help`
    # should answer at once.
    from .train.callbacks.metric_saver import read_metrics_file

    path = str(path)
    source = _metrics_path(path)
    try:
        text = io.read_bytes(source).decode()
    except FileNotFoundError:
        raise DataError(
            f"no metrics file at {source}; pass a save folder of a run that had "
            "MetricSaverCallback (callbacks.metric_saver={_CLASS_: metric_saver}) or the path "
            "of its metrics.jsonl"
        ) from None
    run = RunMetrics(name=_run_name(path), source=source)
    for record in read_metrics_file(text):
        for name, value in record["metrics"].items():
            steps, values = run.curves.setdefault(name, ([], []))
            steps.append(int(record["step"]))
            values.append(float(value))
    return run


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise OLMoLikeError(
            "plotting needs matplotlib, an optional dependency; install it with: "
            "pip install 'olmolike[plot]'"
        ) from None
    matplotlib.use("Agg")  # files only: no display is needed or wanted on a training node
    import matplotlib.pyplot as plt

    return plt


def _unique_names(runs: list[RunMetrics]) -> None:
    """Runs from folders with the same name are told apart by their full paths."""
    names = [run.name for run in runs]
    for run in runs:
        if names.count(run.name) > 1:
            run.name = run.source


def plot_runs(
    paths: list[str | Path], output: str | Path, metrics: list[str] | None = None
) -> Path:
    """Draw the curves of the runs at ``paths`` into a PNG at ``output``; returns its path.

    :param metrics: glob patterns, one panel each; default :data:`DEFAULT_PANELS`.
    :raises DataError: if a run has no metrics file, or no run has a metric to draw.
    """
    if not paths:
        raise DataError("no runs to plot; pass at least one save folder or metrics.jsonl")
    runs = [load_run(p) for p in paths]
    plt = _pyplot()
    fig = figure_for_runs(runs, metrics)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, format="png", dpi=100)
    plt.close(fig)
    return output


def figure_for_runs(runs: list[RunMetrics], metrics: list[str] | None = None) -> Any:
    """A matplotlib figure with one panel per metric group, the runs overlaid in each."""
    _unique_names(runs)
    wanted = {p: [p] for p in metrics} if metrics else DEFAULT_PANELS
    panels = {
        title: patterns
        for title, patterns in wanted.items()
        if any(run.matching(patterns) for run in runs)
    }
    if not panels:
        available = sorted({name for run in runs for name in run.curves})
        raise DataError(
            f"none of the metrics {sorted(p for ps in wanted.values() for p in ps)} are in "
            f"{', '.join(run.source for run in runs)}; available: {available or 'none'}. "
            "Choose some with --metrics GLOB ..."
        )
    plt = _pyplot()
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 3.2 * len(panels)), squeeze=False)
    for ax, (title, patterns) in zip(axes[:, 0], panels.items()):
        _draw_panel(ax, title, patterns, runs)
    axes[-1, 0].set_xlabel("step (optimizer steps)")
    fig.tight_layout()
    return fig


def _draw_panel(ax: Any, title: str, patterns: list[str], runs: list[RunMetrics]) -> None:
    """One colour per run (its train and eval curves share it), one line style per metric."""
    # Training curves solid, the rest (evaluations, other groups) in the other styles.
    metrics = sorted(
        {m for run in runs for m in run.matching(patterns)},
        key=lambda m: (not m.startswith("train/"), m),
    )
    for index, run in enumerate(runs):
        for name in run.matching(patterns):
            steps, values = run.curves[name]
            label = f"{run.name}: {name}" if len(metrics) > 1 else run.name
            ax.plot(
                steps,
                values,
                label=label,
                color=f"C{index % 10}",
                linestyle=LINE_STYLES[metrics.index(name) % len(LINE_STYLES)],
                marker="o" if len(steps) < 30 else None,
                markersize=4,
            )
    ax.set_title(title)
    ax.set_ylabel(PANEL_UNITS.get(title, title))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def _run_command(args: argparse.Namespace) -> int:
    output = plot_runs(args.runs, args.output, args.metrics)
    print(output)
    return 0


def add_plot_command(cmd: argparse.ArgumentParser) -> None:
    """The arguments of ``olmolike plot`` (its parser and help come from :mod:`olmolike.cli`)."""
    cmd.add_argument(
        "runs", nargs="+", metavar="RUN", help="save folders or metrics.jsonl files (local or URL)"
    )
    cmd.add_argument("-o", "--output", default="curves.png", help="the PNG to write")
    cmd.add_argument(
        "--metrics",
        nargs="+",
        metavar="GLOB",
        help="metric name patterns, one panel each (default: loss, LR, tokens per second)",
    )
    cmd.set_defaults(run=_run_command)
