"""The one line a user needs when training dies for a reason outside this rank's code.

Two failures arrive as errors that hide their cause: another rank's death (gloo's "Connection
closed by peer", naming no rank) and a full disk during a save (DCP's ranks-and-threads report
with ``[Errno 28]`` deep inside). :func:`explain_failure` turns them into one
:class:`~olmolike.exceptions.OLMoLikeError` whose message names what happened and the last
complete checkpoint to resume from; the exception hook prints it as one line and keeps the
full traceback in a file.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import traceback
from pathlib import Path

from .. import io
from ..distributed.checkpoint_format import latest_checkpoint
from ..distributed.checkpoint_save import SaveFailedError
from ..distributed.failure import find_lost_ranks
from ..distributed.utils import get_rank
from ..exceptions import DiskFullError, RankLostError

__all__ = ["describe_interrupt", "explain_failure", "last_checkpoint", "stopped_at"]

_RESUME = "run the same command again to resume"


def last_checkpoint(save_folder: str) -> str:
    """Which checkpoint a resume starts from, as a phrase."""
    try:
        return f"the last complete checkpoint is {latest_checkpoint(save_folder)}"
    except (FileNotFoundError, OSError):
        return f"the last complete checkpoint is none ({save_folder} holds none)"


def explain_failure(
    exc: BaseException, step: int, save_folder: str, *, interrupted: bool = False
) -> BaseException:
    """``exc`` as the error that says what happened, if it is a lost rank's or a full disk's
    (see the module's docstring), or comes from a second Ctrl-C (``interrupted``); any other
    error as it is."""
    if interrupted:
        return KeyboardInterrupt(describe_interrupt(exc, step, save_folder))
    if not isinstance(exc, Exception) or isinstance(exc, (RankLostError, DiskFullError)):
        return exc
    if isinstance(exc, SaveFailedError) and _disk_full(exc):
        return _disk_full_error(exc, save_folder)
    lost = find_lost_ranks(exc)
    if lost is None:
        return exc
    return RankLostError(f"{lost}; {stopped_at(step, save_folder)}")


def stopped_at(step: int, save_folder: str) -> str:
    """Where this rank stopped, and what a resume starts from, as a phrase."""
    return f"rank {get_rank()} stopped at step {step}; {last_checkpoint(save_folder)}: {_RESUME}"


def describe_interrupt(exc: BaseException, step: int, save_folder: str) -> str:
    """What a second Ctrl-C cut short, and what is safe to resume from. A Ctrl-C inside DCP's
    save reaches the trainer as the save's failure."""
    frames = {frame.name for frame in traceback.extract_tb(exc.__traceback__)}
    saving = isinstance(exc, SaveFailedError) or bool(
        frames & {"save", "save_async", "save_checkpoint", "save_checkpoint_async", "_save"}
    )
    last = last_checkpoint(save_folder)
    what = f"step {step}"
    if saving:  # another rank may have committed it before the SIGINT reached this one
        done = last.endswith(f"/step{step}")
        what = f"a checkpoint save at step {step}" + ("" if done else " (left incomplete)")
    return f"second SIGINT during {what}; {last}: {_RESUME}"


def _disk_full(exc: SaveFailedError) -> bool:
    text = str(exc)
    return f"[Errno {errno.ENOSPC}]" in text or os.strerror(errno.ENOSPC) in text


def _disk_full_error(exc: SaveFailedError, save_folder: str) -> DiskFullError:
    """Names the folder, about how much a checkpoint needs (the size of the last complete one:
    the failed save wrote the same state) and how much is free."""
    need = ""
    try:
        latest = latest_checkpoint(save_folder)
        if not io.is_url(latest):
            size = sum(f.stat().st_size for f in Path(latest).rglob("*") if f.is_file())
            need = f" a checkpoint needs about {_size(size)} (the size of {latest}) and"
    except (FileNotFoundError, OSError):
        pass
    try:
        free = f"{_size(shutil.disk_usage(save_folder).free)} are free"
    except OSError:  # a remote save folder: the full disk is the local staging one
        free = "the disk is full"
    where = re.search(r"on rank \d+: [^;]*", str(exc))  # the rank that hit it, and the OS's words
    failed = f"failed {where.group(0)}," if where else "failed,"
    return DiskFullError(
        f"no space left on the disk of {save_folder}: {exc.what} {failed} left incomplete "
        f"(no marker);{need} {free}; {last_checkpoint(save_folder)}: free space (or point "
        f"--trainer.save_folder elsewhere) and {_RESUME}"
    )


def _size(n: float) -> str:
    units = ("bytes", "KiB", "MiB", "GiB", "TiB")
    i = 0
    while n >= 1024 and i < len(units) - 1:
        n, i = n / 1024, i + 1
    return f"{n:.0f} bytes" if i == 0 else f"{n:.1f} {units[i]}"
