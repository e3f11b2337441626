"""Process-group set-up and rank helpers that also work when torch.distributed is not in use."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..exceptions import ConfigurationError, OLMoLikeError

__all__ = [
    "DEBUG_GROUPS_ENV",
    "AgreedCounts",
    "GroupMisuseError",
    "adopt_group",
    "agree_counts",
    "all_agree",
    "backend_supports_cpu",
    "barrier",
    "barrier_every_group",
    "broadcast_object",
    "destroy_group",
    "gather_objects",
    "get_local_rank",
    "get_local_world_size",
    "get_rank",
    "get_world_size",
    "group_timeout",
    "init_distributed",
    "is_distributed",
    "is_shared_filesystem",
    "launched_distributed",
    "new_group",
    "set_group_timeouts",
    "set_shared_filesystem",
    "using_group",
]

log = logging.getLogger(__name__)

_SHARED_FS_ENV = "OLMOLIKE_SHARED_FILESYSTEM"


def is_distributed() -> bool:
    """Whether a default process group is initialized (under a launcher, after
    ``prepare_training_environment``)."""
    return dist.is_available() and dist.is_initialized()


def get_rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (default: all ranks); 0 without a process group."""
    return dist.get_rank(group) if is_distributed() else 0


def get_world_size(group: dist.ProcessGroup | None = None) -> int:
    """The number of ranks in ``group`` (default: all ranks); 1 without a process group."""
    return dist.get_world_size(group) if is_distributed() else 1


def get_local_rank() -> int:
    """This process's rank on its node (``$LOCAL_RANK``, set by the launcher; else 0)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_local_world_size() -> int:
    """The number of ranks on this node (``$LOCAL_WORLD_SIZE``; else the world size)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", str(get_world_size())))


def launched_distributed() -> bool:
    """Whether a launcher (torchrun, srun wrappers, ...) set up rank environment variables."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def backend_supports_cpu(group: dist.ProcessGroup | None = None) -> bool:
    """Whether collectives on CPU tensors work on ``group`` (e.g. gloo is part of the backend)."""
    if not is_distributed():
        return False
    return "gloo" in str(dist.get_backend(group))


def _resolve_backend(backend: str) -> str:
    """Drop the CUDA half of a ``cpu:X,cuda:Y`` backend when there is no GPU."""
    if torch.cuda.is_available() or "cuda" not in backend:
        return backend
    cpu_parts = [p.strip() for p in backend.split(",") if p.strip().startswith("cpu:")]
    if not cpu_parts:
        raise ConfigurationError(
            f"backend {backend!r} needs CUDA, which is not available; use 'gloo' on CPU",
            path="backend",
        )
    return cpu_parts[0].split(":", 1)[1]


def init_distributed(backend: str, timeout: datetime.timedelta) -> None:
    """Initialize the default process group from the launcher's environment variables."""
    global _run_timeout
    if is_distributed():
        return
    resolved = _resolve_backend(backend)
    if torch.cuda.is_available() and "nccl" in resolved:
        torch.cuda.set_device(get_local_rank())
    store = _store_of_this_start(timeout)
    if store is None:
        dist.init_process_group(backend=resolved, timeout=timeout)
    else:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(
            backend=resolved, timeout=timeout, store=store, rank=rank, world_size=world_size
        )
    _run_timeout = timeout
    _made.clear()  # those of an earlier process group, destroyed with it


def _store_of_this_start(timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun on one node, the job's store with keys of this start of the job alone;
    ``None``: torch's own rendezvous.

    torch 2.13's torchrun lends its agent's store to the ranks and keeps it across restarts
    (``--max-restarts``): a restarted rank may read the keys of the start before (the gloo or
    NCCL address of a rank that is gone) before the new rank overwrites them, and fail to
    connect, "Connection refused" (pytorch#135712; seen here whenever rank 0 starts more slowly
    than the others). One agent counts the restarts of all its ranks
    (``TORCHELASTIC_RESTART_COUNT``), so on one node the count names the start; across nodes
    each agent counts only its own failures, so torchrun needs the c10d rendezvous with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` there (docs/failures.md, "Unattended runs").
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    if os.environ.get("GROUP_WORLD_SIZE", "1") != "1":
        restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
        if restarts > 0 and os.environ.get("RANK") == "0":
            log.warning(
                "torchrun --max-restarts=%d over several nodes shares one store across restarts, "
                "and a restarted rank may read the addresses of ranks that are gone and fail "
                "to connect (pytorch#135712): use --rdzv-backend=c10d with "
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment",
                restarts,
            )
        return None
    agent = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timeout,
        wait_for_workers=False,
    )
    start = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"olmolike/start-{start}", agent)


def init_single_process_group(
    backend: str = "cpu:gloo,cuda:nccl",
    timeout: datetime.timedelta = datetime.timedelta(minutes=15),
) -> None:
    """A default group of one rank for a process that no launcher started.

    FSDP2 shards over a device mesh, and a mesh needs a process group even on one device. This
    one rendezvouses through an in-memory store (no port, no environment variables), so a
    single-process FSDP run works as it does under ``torchrun --nproc-per-node=1``;
    ``teardown_training_environment()`` destroys it like any other. Under a launcher the group
    must come from :func:`init_distributed` (``prepare_training_environment()``), which knows the
    other ranks.
    """
    global _run_timeout
    if is_distributed():
        return
    if launched_distributed():
        raise ConfigurationError(
            "this process was started by a launcher (RANK and WORLD_SIZE are set) but no process "
            "group exists yet; call prepare_training_environment() before building the model"
        )
    resolved = _resolve_backend(backend)
    if torch.cuda.is_available() and "nccl" in resolved:
        torch.cuda.set_device(0)
    dist.init_process_group(
        backend=resolved, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
    )
    _run_timeout = timeout
    _made.clear()
    log.info("Started a one-rank process group (backend %s) for FSDP in a single process", resolved)


# -- process groups: timeouts and one thread at a time ----------------------------------------

_run_timeout: datetime.timedelta | None = None
"""The timeout given to :func:`init_distributed`; every group made by :func:`new_group` gets it."""
_made: list[tuple[dist.ProcessGroup, bool]] = []
"""Every live group :func:`new_group` made, in the order it made them, with whether its timeout
is shortened, until :func:`destroy_group` or the end of the run. Held, not weakly referenced:
which groups a rank has freed may differ between ranks (garbage collection runs at different
times), and the barriers at the end must be the same on all; a group leaves the list only by
:func:`destroy_group`, which every rank calls for the same groups in the same order."""


def new_group(purpose: str, *, shorten_timeout: bool = True) -> dist.ProcessGroup | None:
    """A new group of all ranks, for one thread of collectives (``purpose`` names it in errors).

    It gets the run's timeout (``torch.distributed.new_group`` alone would give torch's
    30-minute default), and a CPU backend (gloo) whenever the run has one, so that it can
    serve threads that must not touch the device. All ranks must call it in the same order.
    ``shorten_timeout=False`` keeps the run's timeout when :func:`set_group_timeouts` lowers
    the others: for groups whose ops legitimately wait long (a checkpoint uploaded rank by
    rank).
    """
    if not is_distributed():
        return None
    kwargs: dict[str, Any] = {"group_desc": purpose}
    if _run_timeout is not None:
        kwargs["timeout"] = _run_timeout
    group = dist.new_group(backend="gloo" if backend_supports_cpu() else None, **kwargs)
    _made.append((group, shorten_timeout))
    return group


def adopt_group(group: dist.ProcessGroup) -> None:
    """Treat a group that torch made (a device mesh's) like one of :func:`new_group`'s: it
    gets the run's timeout (torch gives its own 30-minute default), :func:`set_group_timeouts`
    shortens it with the others, and teardown barriers on it. Every rank adopts the groups of
    its mesh in the same order."""
    if not is_distributed() or group is dist.group.WORLD or any(g is group for g, _ in _made):
        return
    if _run_timeout is not None:
        dist.distributed_c10d._set_pg_timeout(_run_timeout, group)
    _made.append((group, True))


def destroy_group(group: dist.ProcessGroup | None, *, barrier: bool) -> None:
    """Destroy a group :func:`new_group` made, once the code that made it is done with it.

    It leaves torch's registry and :func:`barrier_every_group`'s list; its gloo worker threads
    and connections end once nothing else references it either (a trainer that is dropped).
    Every rank calls it for the same groups in the same order, as for :func:`new_group`. ``barrier``
    first waits until every rank's last op on it is done, so no peer loses a connection it
    still reads from; without it (after an error, when a peer may be gone) it destroys at
    once. A group already destroyed, or made before the current default group, is left alone.
    """
    if group is None or not is_distributed() or all(g is not group for g, _ in _made):
        return
    _made[:] = [(g, shorten) for g, shorten in _made if g is not group]
    try:
        if barrier:
            dist.barrier(group)
    finally:
        dist.destroy_process_group(group)


def set_group_timeouts(timeout: datetime.timedelta) -> None:
    """Give the default group and the groups from :func:`new_group` a new timeout.

    The trainer shortens it after the first step (which may compile, allocate and load for a
    long time): from then on, a collective that one rank never joins fails within ``timeout``
    with an error naming the op, instead of hanging for the whole run's timeout.
    """
    if not is_distributed():
        return
    for group in [dist.group.WORLD, *(g for g, shorten in _made if shorten)]:
        if group is not None:
            dist.distributed_c10d._set_pg_timeout(timeout, group)


def group_timeout(group: dist.ProcessGroup | None = None) -> datetime.timedelta:
    """The timeout collectives on ``group`` (default: the default group) currently have."""
    pg = group if group is not None else dist.group.WORLD
    assert pg is not None
    backend = pg._get_backend(torch.device("cpu"))
    return backend.options._timeout


DEBUG_GROUPS_ENV = "OLMOLIKE_DEBUG_GROUPS"
"""Set to ``1`` to check that no process group is used by two threads at once (tests do)."""


class GroupMisuseError(OLMoLikeError):
    """A process group was used from a thread while another thread was in collectives on it."""


_in_use: dict[int, tuple[int, str, int]] = {}  # id(group) -> (thread id, thread name, depth)
_in_use_lock = threading.Lock()


@contextlib.contextmanager
def using_group(group: dist.ProcessGroup | None, purpose: str = "") -> Iterator[None]:
    """Mark the block as issuing collectives on ``group`` from the current thread.

    With ``OLMOLIKE_DEBUG_GROUPS=1``, entering it while another thread is inside such a block
    for the same group raises :class:`GroupMisuseError`: two threads' collectives on one group
    interleave differently on each rank and deadlock, usually only now and then. Otherwise it
    costs nothing.
    """
    if os.environ.get(DEBUG_GROUPS_ENV) != "1" or not is_distributed():
        yield
        return
    key = id(group if group is not None else dist.group.WORLD)
    me, name = threading.get_ident(), threading.current_thread().name
    with _in_use_lock:
        owner = _in_use.get(key)
        if owner is not None and owner[0] != me:
            raise GroupMisuseError(
                f"process group {purpose or key!r} is used by thread {name!r} while thread "
                f"{owner[1]!r} is running collectives on it: collectives from two threads on one "
                "group deadlock; give each thread its own group (distributed.utils.new_group)"
            )
        _in_use[key] = (me, name, 1 if owner is None else owner[2] + 1)
    try:
        yield
    finally:
        with _in_use_lock:
            _, _, depth = _in_use[key]
            if depth == 1:
                del _in_use[key]
            else:
                _in_use[key] = (me, name, depth - 1)


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """A barrier on ``group`` (default: all ranks); nothing to wait for in a single process."""
    if is_distributed():
        dist.barrier(group)


def barrier_every_group() -> None:
    """A barrier on the default group, then on each group that :func:`new_group` made, in the
    order it made them; then it lets go of them, also when a barrier fails (a peer is gone).
    A barrier waits for the ops queued on its group before it: after this, no collective that
    this process started is still running."""
    if not is_distributed():
        return
    try:
        dist.barrier()
        for group, _ in _made:
            dist.barrier(group)
    finally:
        _made.clear()


def all_agree(ok: bool, group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``ok`` holds on every rank of ``group`` (a collective; ``ok`` alone without one)."""
    if not is_distributed():
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


@dataclass(frozen=True)
class AgreedCounts:
    """What :func:`agree_counts` returns: each value's maximum and sum over the ranks."""

    max: list[int]
    """Each value's maximum over the ranks."""
    sum: list[int]
    """Each value's sum over the ranks."""


def agree_counts(values: Sequence[int], group: dist.ProcessGroup | None = None) -> AgreedCounts:
    """Each of this rank's ``values`` (a few small integers), maxed and summed over ``group``.

    This is how ranks whose data differ agree on how many collectives a step runs (micro-batches,
    decoding steps): each rank counts what its own data needs, and all run the largest count,
    padding where they have less. One all-gather of ``len(values)`` integers per call, whatever
    the data; every rank of ``group`` must call it at the same point. On one rank (or without
    torch.distributed) the values come back as they are, with no collective.
    """
    local = [int(v) for v in values]
    if not is_distributed() or get_world_size(group) == 1:
        return AgreedCounts(max=local, sum=local)
    # On the CPU where the group can (no device sync); an NCCL-only group needs the GPU.
    device = torch.device("cpu")
    if not backend_supports_cpu(group):
        device = torch.device("cuda", torch.cuda.current_device())
    mine = torch.tensor(local, dtype=torch.int64, device=device)
    parts = [torch.empty_like(mine) for _ in range(get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    every = torch.stack(parts)
    return AgreedCounts(max=every.amax(0).tolist(), sum=every.sum(0).tolist())


def gather_objects(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``obj``, by rank (one collective; ``[obj]`` without a process group).
    Only use on values this program produced: they are pickled."""
    if not is_distributed():
        return [obj]
    gathered: list[Any] = [None] * get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def broadcast_object(obj: Any, src: int = 0, group: dist.ProcessGroup | None = None) -> Any:
    """Broadcast a picklable object from ``src``. Only use on values this program produced."""
    if not is_distributed():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src, group=group)
    return holder[0]


def set_shared_filesystem(shared: bool | None) -> None:
    """Declare whether local paths are shared by all nodes (for this process and the ones it
    starts, through the environment); ``None`` leaves the current setting."""
    if shared is not None:
        os.environ[_SHARED_FS_ENV] = "1" if shared else "0"


def is_shared_filesystem() -> bool:
    """Whether local paths are visible to every rank.

    True when the user said so, or when every rank runs on this node.
    """
    explicit = os.environ.get(_SHARED_FS_ENV)
    if explicit is not None:
        return explicit == "1"
    return get_local_world_size() == get_world_size()
