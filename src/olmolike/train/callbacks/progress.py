"""A live progress bar in the terminal: step, tokens, latest loss and time to go."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from typing import IO

from rich.console import Console
from rich.logging import RichHandler
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from ...distributed.utils import get_rank, get_world_size
from ...exceptions import ConfigurationError
from .callback import Callback

__all__ = ["ProgressCallback"]

log = logging.getLogger(__name__)


@dataclass
class ProgressCallback(Callback, name="progress"):
    """Shows a progress bar on rank 0 while training, when standard output is a terminal.

    The bar counts steps up to where this run stops: ``hard_stop`` if it comes first, else
    ``max_duration``, so the time remaining is the time to the end of *this* run. It also
    shows the tokens trained on and the latest loss. The loss arrives through
    ``log_metrics``, i.e. once the trainer has collected it (every
    ``metrics_collect_interval`` steps), so showing it never synchronizes with the device.

    When standard output is not a terminal (a batch job's log file, a pipe, CI) it shows
    nothing at all: a redrawn bar would only fill the file with control codes. Nor, by
    default, with several ranks (``torchrun``): the other ranks' warnings and torchrun's own
    messages come from other processes, which write over a bar's line; the console logger's
    one-line records (with the time to go) show the progress there instead. While the bar
    is up, log handlers that write to the terminal are routed above it so lines and bar do
    not overwrite each other; they are routed back when training ends.
    """

    loss_metric: str | None = None
    """The metric shown as the loss; ``None``: the train module's ``loss_metric``."""
    refresh_per_second: float = 2.0
    """How often the bar is redrawn (by a background thread)."""
    with_several_ranks: bool = False
    """Show the bar on rank 0 of a multi-rank job too (when nothing else writes to its
    terminal, e.g. the other ranks' output goes to files: ``torchrun --redirects 3``)."""

    _progress: Progress | None = field(default=None, init=False, repr=False)
    _task: TaskID | None = field(default=None, init=False, repr=False)
    _rerouted: list[tuple[logging.StreamHandler[IO[str]], IO[str]]] = field(
        default_factory=list, init=False, repr=False
    )
    _rerouted_rich: list[tuple[RichHandler, Console]] = field(
        default_factory=list, init=False, repr=False
    )

    def validate(self) -> None:
        if not self.refresh_per_second > 0:
            raise ConfigurationError(
                f"must be > 0, got {self.refresh_per_second}", path="refresh_per_second"
            )

    def pre_train(self) -> None:
        if get_rank() != 0 or not sys.stdout.isatty():
            return
        if get_world_size() > 1 and not self.with_several_ranks:
            return
        self._progress = Progress(
            TextColumn("step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("{task.fields[tokens]} tokens"),
            TextColumn("loss {task.fields[loss]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=Console(file=sys.stdout),
            refresh_per_second=self.refresh_per_second,
        )
        self._task = self._progress.add_task(
            "train",
            total=self._stop_step(),
            completed=self.step,
            tokens=_short(self.trainer.global_train_tokens_seen),
            loss="-",
        )
        streams_before = (sys.stdout, sys.stderr)
        self._progress.start()
        self._reroute_log_handlers(*streams_before, bar_console=self._progress.console)

    def _stop_step(self) -> int | None:
        trainer = self.trainer
        stops = [trainer.max_steps]
        if trainer.hard_stop is not None:
            try:
                stops.append(trainer.convert_duration_to_steps(trainer.hard_stop))
            except ConfigurationError:
                log.debug("hard_stop has no step count yet; the bar ends at max_duration")
        known = [stop for stop in stops if stop is not None]
        return min(known) if known else None

    def _reroute_log_handlers(self, stdout: IO[str], stderr: IO[str], bar_console: Console) -> None:
        # While the bar is live, sys.stdout/sys.stderr are proxies that print above it; a
        # handler holding the original stream would write through the bar instead.
        proxies = {
            id(stream): proxy
            for stream, proxy in (
                (sys.__stdout__, sys.stdout),
                (sys.__stderr__, sys.stderr),
                (stdout, sys.stdout),
                (stderr, sys.stderr),
            )
            if stream is not None and stream is not proxy
        }
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler) and id(handler.stream) in proxies:
                previous = handler.setStream(proxies[id(handler.stream)])
                if previous is not None:
                    self._rerouted.append((handler, previous))
            elif isinstance(handler, RichHandler):
                # A rich console unwraps the proxies and would draw over the bar; the bar's own
                # console prints records above it.
                self._rerouted_rich.append((handler, handler.console))
                handler.console = bar_console

    def post_step(self) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.update(
                self._task,
                completed=self.step,
                tokens=_short(self.trainer.global_train_tokens_seen),
            )

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        del step
        loss = metrics.get(self.loss_metric or self.train_loss_metric())
        if self._progress is not None and self._task is not None and loss is not None:
            self._progress.update(self._task, loss=f"{loss:.4f}")

    def close(self) -> None:
        if self._progress is None:
            return
        for handler, stream in self._rerouted:
            handler.setStream(stream)
        self._rerouted.clear()
        for rich_handler, console in self._rerouted_rich:
            rich_handler.console = console
        self._rerouted_rich.clear()
        self._progress.stop()
        self._progress = None
        self._task = None


def _short(count: int) -> str:
    """``1234567`` as ``1.23M``: the bar has no room for every digit."""
    for factor, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= factor:
            return f"{count / factor:.2f}{suffix}"
    return str(count)
