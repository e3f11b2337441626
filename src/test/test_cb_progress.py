"""ProgressCallback: a bar on a terminal (steps to the real stop, tokens, loss), silence elsewhere."""

from __future__ import annotations

import io
import logging
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from rich.logging import RichHandler
from testutils import SEQ_LEN, build_trainer

from olmolike.exceptions import ConfigurationError
from olmolike.train import Callback, Duration, Trainer
from olmolike.train.callbacks import progress
from olmolike.train.callbacks.progress import ProgressCallback

GLOBAL_TOKENS = 8 * SEQ_LEN


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def fake_terminal(monkeypatch: pytest.MonkeyPatch) -> FakeTerminal:
    """Standard output as a terminal. Set in the test itself: pytest's output capture resets
    ``sys.stdout`` between a fixture's set-up and the test."""
    fake = FakeTerminal()
    monkeypatch.setattr(sys, "stdout", fake)
    monkeypatch.setenv("COLUMNS", "200")
    return fake


@dataclass
class Keep(Callback):
    logged: dict[int, dict[str, float]] = field(default_factory=dict)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.logged[step] = metrics


def fit(tmp_path: Path, *extra: Callback, **config: Any) -> Trainer:
    config.setdefault("max_duration", Duration.steps(4))
    trainer = build_trainer(
        tmp_path,
        no_checkpoints=True,
        metrics_collect_interval=2,
        callbacks={
            "progress": ProgressCallback(refresh_per_second=50),
            **{f"cb{i}": cb for i, cb in enumerate(extra)},
        },
        **config,
    )
    trainer.fit()
    return trainer


def test_bar_counts_to_the_hard_stop_with_tokens_and_latest_loss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    terminal = fake_terminal(monkeypatch)
    keep = Keep()
    fit(tmp_path, keep, max_duration=Duration.steps(8), hard_stop=Duration.steps(4))
    shown = terminal.getvalue()
    assert "4/4" in shown and "4/8" not in shown
    assert f"{4 * GLOBAL_TOKENS} tokens" in shown
    assert f"loss {keep.logged[4]['train/CE loss']:.4f}" in shown


def test_nothing_is_printed_when_stdout_is_not_a_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fit(tmp_path)
    assert capsys.readouterr().out == ""


def test_only_rank_zero_shows_a_bar(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    terminal = fake_terminal(monkeypatch)
    monkeypatch.setattr(progress, "get_rank", lambda: 1)
    fit(tmp_path)
    assert terminal.getvalue() == ""


def test_several_ranks_show_no_bar_unless_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    terminal = fake_terminal(monkeypatch)
    monkeypatch.setattr(progress, "get_world_size", lambda: 2)  # rank 0 of a torchrun job
    fit(tmp_path / "default")
    assert terminal.getvalue() == ""
    fit(tmp_path / "asked", ProgressCallback(with_several_ranks=True))
    assert "step" in terminal.getvalue()


@dataclass
class HandlerProbe(Callback):
    """Logs inside a step and notes whether the handler still held the terminal then."""

    handler: logging.StreamHandler[Any]
    terminal: FakeTerminal
    held_terminal: list[bool] = field(default_factory=list)

    def post_step(self) -> None:
        self.held_terminal.append(self.handler.stream is self.terminal)
        logging.getLogger("probe").warning("line from step %d", self.step)


def test_log_lines_go_above_the_bar_and_handlers_are_restored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    terminal = fake_terminal(monkeypatch)
    handler = logging.StreamHandler(terminal)
    logging.getLogger().addHandler(handler)
    try:
        probe = HandlerProbe(handler, terminal)
        fit(tmp_path, probe)
    finally:
        logging.getLogger().removeHandler(handler)
    assert probe.held_terminal == [False] * 4
    assert handler.stream is terminal
    assert "line from step 3" in terminal.getvalue()


def test_rich_log_records_print_through_the_bar_and_the_console_is_restored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    terminal = fake_terminal(monkeypatch)
    own_console = Console(file=FakeTerminal(), force_terminal=True)
    handler = RichHandler(console=own_console)
    consoles_seen: list[Console] = []

    @dataclass
    class LogDuringTraining(Callback):
        def post_step(self) -> None:
            consoles_seen.append(handler.console)
            logging.getLogger("olmolike.test").warning("rich line from step %d", self.step)

    logging.getLogger().addHandler(handler)
    try:
        fit(tmp_path, LogDuringTraining())
    finally:
        logging.getLogger().removeHandler(handler)
    # While the bar is up, records go through the bar's console, which prints them above it.
    assert consoles_seen and all(c is not own_console for c in consoles_seen)
    printed = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", terminal.getvalue())  # without codes
    assert "rich line from step 3" in printed
    assert handler.console is own_console


def test_rejects_a_non_positive_refresh_rate() -> None:
    with pytest.raises(ConfigurationError, match="refresh_per_second"):
        ProgressCallback(refresh_per_second=0)


@pytest.mark.parametrize(
    ("count", "text"), [(999, "999"), (1_500, "1.50K"), (2_340_000, "2.34M"), (7e9, "7.00B")]
)
def test_token_counts_are_shortened(count: int, text: str) -> None:
    assert progress._short(int(count)) == text
