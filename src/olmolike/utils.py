"""Logging, seeding and device helpers."""

from __future__ import annotations

import datetime
import logging
import math
import os
import random
import sys
from collections.abc import Mapping
from typing import Any, TypeVar

import numpy as np
import torch

from .config import StrEnum, check_choice
from .distributed.utils import get_local_rank, get_rank, get_world_size

__all__ = [
    "LogFilterType",
    "format_float",
    "format_int",
    "format_timedelta",
    "get_default_device",
    "get_rng_state",
    "move_to_device",
    "seed_all",
    "set_rng_state",
    "setup_logging",
]

T = TypeVar("T")

LOG_FILTER_ENV = "LOG_FILTER_TYPE"


class LogFilterType(StrEnum):
    """Which ranks may emit log messages below WARNING (all ranks always emit warnings)."""

    rank0_only = "rank0_only"
    local_rank0_only = "local_rank0_only"
    all_ranks = "all_ranks"


class _RankFilter(logging.Filter):
    def __init__(self, filter_type: LogFilterType) -> None:
        super().__init__()
        self.filter_type = filter_type

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING or self.filter_type == LogFilterType.all_ranks:
            return True
        if self.filter_type == LogFilterType.local_rank0_only:
            return get_local_rank() == 0
        return get_rank() == 0


_HANDLER_NAME = "olmolike"


def setup_logging(
    log_filter_type: LogFilterType | str | None = None, level: int = logging.INFO
) -> None:
    """Send log records to stderr, rank-prefixed when distributed, filtered by rank.

    In a terminal, records are rendered by rich: aligned times, colored levels, highlighted
    numbers. Anywhere else (a batch job's log file, a pipe, CI) each record is one plain line,
    ``time level logger: message``, that grep and log collectors read as it is.
    The filter type comes from the argument, else ``$LOG_FILTER_TYPE``, else ``rank0_only``.
    Calling it again replaces the previous olmolike handler rather than adding another.
    The storage clients' own loggers (:data:`_QUIET_LIBRARIES`) are silenced unless set.
    """
    if log_filter_type is not None:
        filter_type = check_choice(log_filter_type, LogFilterType, "log_filter_type")
    else:
        from_env = os.environ.get(LOG_FILTER_ENV) or LogFilterType.rank0_only
        filter_type = check_choice(from_env, LogFilterType, f"${LOG_FILTER_ENV}")
    root = logging.getLogger()
    for handler in list(root.handlers):
        if handler.get_name() == _HANDLER_NAME:
            root.removeHandler(handler)
    rank_tag = f"[rank{get_rank()}] " if get_world_size() > 1 else ""
    handler = _terminal_handler(rank_tag) if sys.stderr.isatty() else _plain_handler(rank_tag)
    handler.set_name(_HANDLER_NAME)
    handler.addFilter(_RankFilter(filter_type))
    root.addHandler(handler)
    root.setLevel(level)
    for name in _QUIET_LIBRARIES:
        library = logging.getLogger(name)
        if library.level == logging.NOTSET:  # unless the user configured it
            library.setLevel(logging.CRITICAL)


_QUIET_LIBRARIES = ("gcsfs", "google.auth", "s3fs", "aiobotocore", "botocore")
"""Storage clients that log their retries and the tracebacks of errors they raise: olmolike
retries and reports those errors itself, in one line."""


def _plain_handler(rank_tag: str) -> logging.Handler:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(
            f"%(asctime)s {rank_tag}%(levelname)s %(name)s: %(message)s", "%Y-%m-%d %H:%M:%S"
        )
    )
    return handler


def _terminal_handler(rank_tag: str) -> logging.Handler:
    from rich.console import Console
    from rich.logging import RichHandler

    # ProgressCallback hands this handler its own console while its bar is up.
    handler = RichHandler(
        console=Console(stderr=True),
        show_path=False,
        log_time_format="%Y-%m-%d %H:%M:%S",
        markup=False,  # a message is text: "[step=5/30]" is not a style
    )
    handler.setFormatter(logging.Formatter(f"{rank_tag}%(name)s: %(message)s"))
    return handler


def seed_all(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices)."""
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be in [0, 2**32), got {seed}")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def get_default_device() -> torch.device:
    """This rank's GPU if there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", get_local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def move_to_device(obj: T, device: torch.device) -> T:
    """Move every tensor in a (nested) batch to ``device``; non-blocking from pinned memory."""
    if isinstance(obj, torch.Tensor):
        if obj.device == device:
            return obj
        return obj.to(device, non_blocking=obj.is_pinned())  # type: ignore[return-value]
    if isinstance(obj, dict):
        for value in obj.values():
            if type(value) is not torch.Tensor or value.device != device:
                break
        else:
            # A batch of tensors already there (every step on the CPU), without a call per
            # tensor; still a new dict, as below: hooks edit the step's batch, not the loader's.
            return dict(obj)  # type: ignore[return-value]
    if isinstance(obj, Mapping):
        return {k: move_to_device(v, device) for k, v in obj.items()}  # type: ignore[return-value]
    if isinstance(obj, (list, tuple)):
        return type(obj)(move_to_device(v, device) for v in obj)
    return obj


def get_rng_state() -> dict[str, Any]:
    """Every RNG state of this process, as tensors and plain values (loadable with weights_only)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": _python_rng_state(),
        "numpy": [kind, torch.from_numpy(np.asarray(keys, dtype=np.int64)), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`get_rng_state` returned."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _python_rng_state() -> list[Any]:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


# -- human-readable numbers ----------------------------------------------------------------


def format_int(count: int) -> str:
    """``1234567`` -> ``1.2M``: a count with a K/M/B/T suffix and at most one decimal."""
    for suffix, factor in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if count >= factor:
            return f"{count / factor:.1f}".removesuffix(".0") + suffix
    return str(count)


def format_float(value: float) -> str:
    """A float in a width that suits its size: ``1.2346``, ``12.35``, ``123.5``, ``1,235``,
    ``1.235B`` (B/T/P/E from a billion up), ``1.00E-05`` (tiny values)."""
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    size = abs(value)
    if size == 0.0:
        return "0.0"
    if size >= 1e9:
        for suffix, factor in (("E", 1e18), ("P", 1e15), ("T", 1e12), ("B", 1e9)):
            if size >= factor:
                return f"{value / factor:,.{_decimals(size / factor)}f}{suffix}"
    if size < 1e-4:
        return f"{value:.2E}"
    if size >= 1000:
        return f"{int(value):,d}"
    return f"{value:.{_decimals(size)}f}"


def _decimals(size: float) -> int:
    return 1 if size > 100 else 2 if size > 10 else 3 if size > 1 else 4


def format_timedelta(td: datetime.timedelta) -> str:
    """``1d, 2h, 3m, 4s`` (zero parts left out; ``0s`` for nothing)."""
    parts = [
        f"{amount}{unit}"
        for amount, unit in (
            (td.days, "d"),
            (td.seconds // 3600, "h"),
            (td.seconds % 3600 // 60, "m"),
            (td.seconds % 60, "s"),
        )
        if amount > 0
    ]
    return ", ".join(parts) or "0s"
