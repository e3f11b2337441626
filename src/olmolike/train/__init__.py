"""The trainer: a loop over a train module and a data loader, with callbacks on the side.

Call :func:`prepare_training_environment` at the top of the training script, build a
:class:`TrainerConfig` into a :class:`Trainer`, call :meth:`Trainer.fit`, and finish with
:func:`teardown_training_environment`.
"""

from __future__ import annotations

import datetime
import logging
import sys

import torch.distributed as dist

from ..config import check_choice
from ..distributed.failure import (
    install_error_hook,
    install_exit_on_error,
    rank_failed,
    report_rank_failure,
    start_failure_monitor,
)
from ..distributed.teardown import teardown_at_exit, teardown_distributed
from ..distributed.utils import (
    get_rank,
    init_distributed,
    is_distributed,
    launched_distributed,
    set_shared_filesystem,
)
from ..utils import LogFilterType, seed_all, setup_logging
from .callbacks import Callback
from .checkpoint import Checkpointer, CheckpointerConfig
from .common import (
    Duration,
    DurationUnit,
    LoadStrategy,
    MetricMergeStrategy,
    ReduceType,
    StepSkipRange,
)
from .config import TrainerConfig
from .train_module import BasicTrainModule, TrainModule
from .trainer import Trainer, TrainerStateDict

__all__ = [
    "BasicTrainModule",
    "Callback",
    "Checkpointer",
    "CheckpointerConfig",
    "Duration",
    "DurationUnit",
    "LoadStrategy",
    "LogFilterType",
    "MetricMergeStrategy",
    "ReduceType",
    "StepSkipRange",
    "TrainModule",
    "Trainer",
    "TrainerConfig",
    "TrainerStateDict",
    "prepare_training_environment",
    "teardown_training_environment",
]

log = logging.getLogger(__name__)


def prepare_training_environment(
    *,
    seed: int | None = None,
    backend: str | None = "cpu:gloo,cuda:nccl",
    timeout: datetime.timedelta = datetime.timedelta(minutes=15),
    log_filter_type: LogFilterType | None = None,
    shared_filesystem: bool | None = None,
    frozen_rank_timeout: datetime.timedelta | None = None,
) -> None:
    """Set up logging, the process group (under a launcher such as torchrun) and RNG seeds.

    Call it first thing in the ``if __name__ == "__main__":`` block. Without a launcher (no
    ``RANK``/``WORLD_SIZE`` in the environment) it sets up a single process and no group.
    It also registers :func:`teardown_training_environment`'s work to run at interpreter exit,
    so a process never exits with its process groups alive (which can abort it with SIGABRT),
    whether or not the script reaches its own teardown.

    :param backend: ``None`` for no process group. Keep a CPU backend (gloo) in it even on GPUs:
        bookkeeping collectives then run on a separate gloo group without blocking training.
    :param timeout: for initializing the process group and for its collectives.
    :param log_filter_type: which ranks log below WARNING (default: ``$LOG_FILTER_TYPE`` or
        ``rank0_only``).
    :param shared_filesystem: whether local checkpoint/work directories are on a drive shared by
        all nodes (e.g. NFS). Ranks of a single node always share their local filesystem.
    :param frozen_rank_timeout: how long a rank's heartbeat may be silent before the others
        name it frozen (stopped, or stuck in uninterruptible I/O) and the job ends, instead of
        waiting in their collectives for ``timeout`` (default: ``$OLMOLIKE_FROZEN_RANK_TIMEOUT``
        seconds, else 120 s; zero or infinite: never; negative: refused). The heartbeat comes
        from a thread that keeps beating while the training thread computes, saves, compiles
        or sits in a debugger.
        See docs/failures.md.
    """
    if log_filter_type is not None:  # before anything is set up
        log_filter_type = check_choice(log_filter_type, LogFilterType, "log_filter_type")
    # An OLMoLikeError escaping the script is one line (once per job), not a traceback.
    install_error_hook()
    if backend is not None and launched_distributed():
        init_distributed(backend, timeout)
        install_exit_on_error()  # first: the monitor refuses a bad timeout once per job
        frozen = frozen_rank_timeout.total_seconds() if frozen_rank_timeout is not None else None
        start_failure_monitor(get_rank(), frozen)
    teardown_at_exit()  # any process group: also when the script never reaches its teardown
    set_shared_filesystem(shared_filesystem)
    setup_logging(log_filter_type)  # after the process group: records carry the rank
    if is_distributed():
        log.info(
            "Process group ready: backend %s, rank %d of %d",
            dist.get_backend(),
            get_rank(),
            dist.get_world_size(),
        )
    if seed is not None:
        seed_all(seed)


def teardown_training_environment() -> None:
    """End of the training script: tear down all process groups, in a fixed order.

    A barrier on every group (no collective of this rank is still running), then the
    rank-failure monitor's thread is stopped and joined (a peer exiting is no longer a
    failure), then every process group is shut down and destroyed. Last, it waits for the
    worker threads of groups still referenced (by the trainer, a DDP model, the script) to
    finish releasing their last ops: one that does so while the interpreter exits aborts the
    process (see :mod:`olmolike.distributed.quiesce`). Nothing that uses a group is left
    running at exit. After this rank failed (a ``finally:`` on the way out of an error), no
    barrier: the other ranks may be gone; the error is reported to the other ranks first,
    while the job's store still runs (it may end with this rank's group), so that the job's
    first failing rank alone prints it.

    :func:`prepare_training_environment` also registers this to run when the interpreter
    exits, so a script that skips it (``fit()`` raised ``SystemExit(143)`` after a SIGTERM,
    an early ``sys.exit``) still exits with its own status; calling it is still the clean
    way to end a script that goes on without the process groups.
    """
    failing = sys.exc_info()[1]  # the error a `finally:` around the run is on the way out of
    if failing is not None and not isinstance(failing, SystemExit):
        report_rank_failure(failing)
    teardown_distributed(every_rank=not rank_failed())
