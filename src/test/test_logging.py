"""Log output: rich in a terminal, plain lines elsewhere; and the console logger callback."""

from __future__ import annotations

import io
import logging
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.logging import RichHandler
from testutils import build_trainer

from olmolike.train import Duration
from olmolike.train.callbacks import ConsoleLoggerCallback
from olmolike.utils import setup_logging


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def root_logging() -> Iterator[logging.Logger]:
    """The root logger, restored afterwards (setup_logging replaces its handler)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield root
    root.handlers[:] = handlers
    root.setLevel(level)


def olmolike_handler(root: logging.Logger) -> logging.Handler:
    (handler,) = [h for h in root.handlers if h.get_name() == "olmolike"]
    return handler


def test_records_are_plain_lines_outside_a_terminal(
    root_logging: logging.Logger, monkeypatch: pytest.MonkeyPatch
) -> None:
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    setup_logging()
    assert not isinstance(olmolike_handler(root_logging), RichHandler)
    logging.getLogger("olmolike.test").info("[step=5/30] [bold]x[/bold]")
    line = re.escape("INFO olmolike.test: [step=5/30] [bold]x[/bold]")
    assert re.fullmatch(rf"\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d {line}\n", stream.getvalue())


def test_records_are_rendered_by_rich_in_a_terminal(
    root_logging: logging.Logger, monkeypatch: pytest.MonkeyPatch
) -> None:
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    setup_logging()
    assert isinstance(olmolike_handler(root_logging), RichHandler)
    logging.getLogger("olmolike.test").info("[step=5/30] [bold]x[/bold]")
    logging.getLogger("olmolike.test").debug("below the level")
    # The message is printed as text, not as markup.
    written = re.sub(r"\x1b\[[0-9;]*m", "", terminal.getvalue())  # without color codes
    assert "INFO" in written
    assert "olmolike.test: [step=5/30] [bold]x[/bold]" in written
    assert "below the level" not in written


def test_console_logger_logs_matching_metrics_every_interval(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="olmolike.train.callbacks.console_logger")
    build_trainer(
        tmp_path,
        max_duration=Duration.steps(6),
        no_checkpoints=True,
        callbacks={"console_logger": ConsoleLoggerCallback(log_interval=2, metrics=["train/*"])},
    ).fit()
    messages = [
        r.getMessage() for r in caplog.records if r.name.endswith("callbacks.console_logger")
    ]
    assert [m.split()[0] for m in messages] == ["[step=2/6]", "[step=4/6]", "[step=6/6]"]
    for message in messages:
        assert "\n" not in message  # one record per line, for grep
        assert re.search(r" train/CE loss=\d+\.\d+ ", message)
        assert re.search(r" eta=\d+:\d\d:\d\d$", message)
        assert "optim/" not in message  # no optim/* without its glob


def test_console_logger_formats_nothing_when_info_is_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    logger = logging.getLogger("olmolike.train.callbacks.console_logger")
    monkeypatch.setattr(logger, "level", logging.WARNING)
    callback = ConsoleLoggerCallback(log_interval=1)
    build_trainer(
        tmp_path,
        max_duration=Duration.steps(2),
        no_checkpoints=True,
        callbacks={"console_logger": callback},
    ).fit()
    assert callback._shown == {}  # no metric name was even matched


def test_storage_clients_are_silenced_unless_configured(
    root_logging: logging.Logger, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("gcsfs", "botocore"):
        monkeypatch.setattr(logging.getLogger(name), "level", logging.NOTSET)
    logging.getLogger("botocore").setLevel(logging.DEBUG)  # the user's choice stays
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    setup_logging()
    assert logging.getLogger("gcsfs").level == logging.CRITICAL
    assert logging.getLogger("botocore").level == logging.DEBUG
