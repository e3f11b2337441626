"""One rank's failure during a save, known to every rank with its error, at once.

A save is a sequence of collectives (agreements, DCP's planning and writing). A rank that
fails on its own (copying its state to CPU memory, writing a file, uploading) and then skips
to a later collective leaves the others waiting in an earlier one until the group's timeout,
and its error reaches nobody. So a failing rank never skips: it keeps its error and hands it
to the next collective that every rank runs anyway, :func:`agree_on_failures`, where each
rank tells the others which ranks failed and why. Every rank then raises the same
:class:`SaveFailedError`, naming the failed ranks and their original errors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ..exceptions import CheckpointError
from .checkpoint_format import describe_error
from .utils import get_rank, get_world_size, is_distributed

__all__ = ["SaveFailedError", "agree_on_failures", "failures_of"]


class SaveFailedError(CheckpointError):
    """A save failed on some ranks; every rank raises it, with the same message.

    ``failures`` maps each rank that failed (its rank in the save's process group) to one line
    naming its error.
    """

    def __init__(self, what: str, failures: Mapping[int, str], consequence: str = "") -> None:
        self.what = what
        self.failures = dict(sorted(failures.items()))
        self.consequence = consequence
        described = "; ".join(f"rank {rank}: {error}" for rank, error in self.failures.items())
        super().__init__(
            f"{what} failed on {described}" + (f"; {consequence}" if consequence else "")
        )

    def __reduce__(self) -> tuple[Any, ...]:  # pickles with its fields, not only its message
        return (type(self), (self.what, self.failures, self.consequence))


def failures_of(error: BaseException | None, group: dist.ProcessGroup | None) -> dict[int, str]:
    """The failures ``error`` tells of: an agreed :class:`SaveFailedError`'s or DCP's
    ``CheckpointException``'s (rank by rank), or else this rank's own error."""
    if error is None:
        return {}
    if isinstance(error, SaveFailedError):
        return dict(error.failures)
    if isinstance(error, CheckpointException):
        return {
            rank: describe_error(failure[0] if isinstance(failure, tuple) else failure)
            for rank, failure in error.failures.items()
        }
    return {get_rank(group): describe_error(error)}


def agree_on_failures(
    what: str,
    error: BaseException | None,
    group: dist.ProcessGroup | None,
    consequence: str = "",
) -> None:
    """Raise :class:`SaveFailedError` on every rank if ``what`` failed on any rank.

    A collective: every rank calls it at the same point with its own ``error`` (``None`` if
    its part succeeded), so its count never depends on what failed where. Where ranks tell of
    the same rank's failure, the failed rank's own account is kept (it has the original
    error; DCP may carry a copy that lost detail).
    """
    known = failures_of(error, group)
    reports: list[Any] = [known]
    if is_distributed():
        reports = [None] * get_world_size(group)
        dist.all_gather_object(reports, known, group=group)
    failures: dict[int, str] = {}
    for report in reports:
        failures.update(report)
    for rank, report in enumerate(reports):
        if rank in report:
            failures[rank] = report[rank]
    if failures:  # this rank's own error's traceback goes with it
        raise SaveFailedError(what, failures, consequence) from error
