"""A rank's failure monitor: it reports this rank's failure into the job's key-value store and
ends this rank when another failed, or froze.

:class:`RankFailureMonitor` runs one daemon thread per rank, the rank's heartbeat. It polls
the store: another rank's failure report ends this rank after a grace period (it usually
fails on its own first, and says so); a rank whose heartbeat went silent
(:class:`~.lost_ranks.SilenceWatch`) is named frozen in one line, by the rank that found it,
and every rank ends at once. :mod:`.failure` starts it and prints the lines of the errors
that reach the exception hook.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from .lost_ranks import (
    BoundedStore,
    Roster,
    SilenceWatch,
    StoreUnresponsive,
    StuckThreads,
    describe_frozen,
    describe_lost_ranks,
    process_exiting,
)

__all__ = [
    "DEFAULT_FROZEN_SECONDS",
    "DEFAULT_GRACE_SECONDS",
    "EXIT_CODE",
    "FROZEN_ENV",
    "GRACE_ENV",
    "RankFailureMonitor",
    "set_failure_context",
    "tell_torchrun",
]

log = logging.getLogger(__name__)

GRACE_ENV = "OLMOLIKE_RANK_FAILURE_GRACE_SECONDS"
DEFAULT_GRACE_SECONDS = 15.0
EXIT_CODE = 3
FROZEN_ENV = "OLMOLIKE_FROZEN_RANK_TIMEOUT"
"""Seconds without a heartbeat after which a rank is named frozen and the job ends (0: never);
``prepare_training_environment(frozen_rank_timeout=...)`` sets it for a script."""
DEFAULT_FROZEN_SECONDS = 120.0
"""Well under the process groups' timeout (15 minutes), well over anything that stops a
heartbeat thread in a healthy process (a call that holds Python's lock): the kernel's own
default for naming a task hung (``hung_task_timeout_secs``)."""


class RankFailureMonitor:
    """Reports this rank's failure and watches for the failures of other ranks, and for a
    rank that froze (see :mod:`.lost_ranks`): ``frozen_timeout`` seconds without a heartbeat
    (``None`` or 0: never), which also bounds every call to the store."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        *,
        attempt: str = "0",
        world_size: int = 1,
        store_rank: int | None = None,
        poll_interval: float = 0.5,
        grace_period: float = DEFAULT_GRACE_SECONDS,
        frozen_timeout: float | None = DEFAULT_FROZEN_SECONDS,
    ) -> None:
        self.rank = rank
        self.poll_interval = poll_interval
        self.grace_period = grace_period
        self.frozen_timeout = frozen_timeout or None
        self._store = BoundedStore(store, self.frozen_timeout)
        self._key = f"olmolike/rank_failure/{attempt}"
        self.roster = Roster(self._store, f"olmolike/ranks/{attempt}", rank, world_size, store_rank)
        self._silence = (
            SilenceWatch(self.roster, self.frozen_timeout, poll_interval)
            if self.frozen_timeout
            else None
        )
        self._stuck = StuckThreads(self.frozen_timeout) if self.frozen_timeout else None
        self._polls = 0
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._reported = False
        self._first = True
        self._following = False
        self.line_said = False
        """Whether the job's line is said by a monitor (this rank's or another's) that found
        its cause (a frozen rank): this rank's own error, a consequence, is not printed."""
        self._thread = threading.Thread(
            target=self._watch, name="rank-failure-monitor", daemon=True
        )

    def start(self) -> None:
        try:
            self.roster.enter()
            # The first beat before this rank runs anything: silence counts only after one,
            # and a rank that froze before its thread's first beat was never named.
            self.roster.beat()
        except Exception as e:  # the job can run without it: a lost rank is then unnamed
            log.debug("Could not enter this rank's process into the job's store: %s", e)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (normal shutdown: a peer that exits is no longer a failure).

        Waits for the thread to end: left inside a store call at interpreter exit, it would
        race the C++ runtime's teardown, which aborts the process now and then.
        """
        self._stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.poll_interval + 30)
        if not self._reported and not self.roster.store_gone():
            with contextlib.suppress(Exception):  # the ranks watching this one: no news
                self.roster.mark_done()

    def wait_for_others(self, timeout: float) -> None:
        """Up to ``timeout`` seconds until every rank has ended its run, reported its failure
        or seen another's: for the rank whose process holds the store, before it ends the
        store with its process group (a rank still reporting would find it gone, and each
        call to a dead store prints a C++ stack trace)."""
        deadline = time.monotonic() + timeout
        others = [r for r in range(self.roster.world_size) if r != self.rank]
        with contextlib.suppress(Exception):
            while others and time.monotonic() < deadline:
                others = [
                    r
                    for r in others
                    if not (
                        r in self.roster.processes and process_exiting(self.roster.processes[r])
                    )
                    and not self.roster.ended(r, following=True)
                ]
                time.sleep(0.05 if others else 0)

    @property
    def reported(self) -> bool:
        """Whether this rank reported its failure."""
        return self._reported

    def report(self, exc: BaseException) -> bool:
        """Tell every other rank that this one failed with ``exc``. Idempotent.

        Returns whether this rank's failure was the job's first (the one to show the user).
        A rank that saw another's report first fails because of it: nothing to tell.
        """
        with self._lock:
            if self._reported or self._following:
                self._reported = True
                return self._first
            self._reported = True
            return self._record(f"rank {self.rank} failed with {type(exc).__name__}: {exc}")

    def _record(self, summary: str, *, said: bool = False) -> bool:
        """Enter this rank's failure into the store; whether it is the job's first. ``said``:
        this rank prints the job's line, and the others end without one."""
        if self.roster.store_gone():  # its holder ended: the failure before ours ended it
            self._first = False
            return False
        try:
            # The first failure is the cause; later ones are usually its consequences.
            self.roster.mark_failed()
            self._first = self._store.add(f"{self._key}/count", 1) == 1
            if self._first:
                self._store.set(f"{self._key}/by", str(self.rank))
                if said:
                    self._store.set(f"{self._key}/said", "1")
                self._store.set(self._key, summary[:2000])
            else:
                self.line_said = self._store.check([f"{self._key}/said"])
        except StoreUnresponsive:
            self._first = self._speaks_for_silent_store()
            self.line_said = not self._first
        except Exception as store_error:  # the job is already failing; do not mask exc
            # Better said twice than not at all: the line stays this rank's to print.
            log.info("Could not report this rank's failure to the other ranks: %s", store_error)
        return self._first

    def _speaks_for_silent_store(self) -> bool:
        """Whether this rank says why, when the store stopped answering (no rank can ask the
        others then): the one that watches the store holder's heartbeat, else rank 0."""
        holder = self.roster.store_rank
        return self.rank == ((holder - 1) % self.roster.world_size if holder is not None else 0)

    def _watch(self) -> None:
        while not self._stopped.wait(self.poll_interval):
            if self._reported:
                return  # this rank failed itself and is on its way out: let it finish
            try:
                with self._lock:
                    if self.roster.store_gone():
                        raise ConnectionError("its process ended")
                    self.roster.beat()
                    failed = self._store.check([self._key])
                    by = int(self._store.get(f"{self._key}/by")) if failed else self.rank
                    said = failed and self._store.check([f"{self._key}/said"])
                    silent = self._silence.look(time.monotonic()) if self._silence else None
            except StoreUnresponsive as e:
                self._store_froze(str(e))
                return
            except Exception as e:
                # The store lives on rank 0 (or the launcher): losing it means they are gone.
                lost = describe_lost_ranks(self.roster)
                self._terminate(lost or f"the job's key-value store is unreachable ({e})")
                return
            if by != self.rank:
                self._follow(said)
                if said:  # the rank that found it printed the line; nobody ends on its own
                    self._end(None)
                    return
                self._terminate(self._store.get(self._key).decode())
                return
            if silent is not None and self._silence is not None:
                self._frozen(describe_frozen(self.roster, self._silence.rank, silent))
                return
            self._polls += 1
            if self._stuck is not None and self._polls % 4 == 0:  # every ~2 s: it reads /proc
                self._check_own_threads(self._stuck)

    def _check_own_threads(self, stuck: StuckThreads) -> None:
        """A thread of this rank stuck in uninterruptible I/O (an async save's writer on a
        dead mount, say) holds the others up as a frozen rank would, while the rest of this
        process, heartbeat included, runs on: this rank says so itself."""
        found = stuck.look(time.monotonic())
        if found is None:
            return
        me = self.roster.processes.get(self.rank)
        where = f" (pid {me.pid} on {me.host})" if me is not None else ""
        self._frozen(f"rank {self.rank}{where} is frozen: its {found} (a dead mount?)")

    def _follow(self, said: bool) -> None:
        """Another rank failed first: this rank's own failure, when it comes, follows from it
        (it is not reported, and not printed if a monitor printed the job's line). Entered
        in the store, so that the rank holding it need not wait for this one's report."""
        with self._lock:
            if self._reported:
                return
            self._following, self._first, self.line_said = True, False, said
            with contextlib.suppress(Exception):
                self.roster.mark_following()

    def _frozen(self, why: str) -> None:
        """A rank froze: the others wait for it in their collectives until the groups'
        timeout. The first rank to say so prints the job's line; every rank ends now."""
        with self._lock:
            if self._reported:  # this rank is failing on its own: its line says why
                return
            self._reported = True
            first = self._record(why, said=True)
            self.line_said = True
        self._end(f"error: {why}; {_stopping_context(self.rank)}" if first else None)

    def _store_froze(self, why: str) -> None:
        """The store stopped answering: its holder is frozen (or its machine unreachable)."""
        holder = self.roster.store_rank
        if holder is not None and holder != self.rank:
            why = describe_frozen(self.roster, holder, self._store.deadline or 0, what="answer")
            why += " from the job's key-value store, which it holds"
        else:
            why = f"{'the launcher' if holder is None else f'rank {holder}'}: {why}"
        with self._lock:
            if self._reported:  # this rank is failing on its own: its line says why
                return
            self._reported = True
            self._first = self._speaks_for_silent_store()
            self.line_said = True
        self._end(f"error: {why}; {_stopping_context(self.rank)}" if self._first else None)

    def _end(self, line: str | None) -> None:
        """End this process now, printing ``line`` if there is one (once per process)."""
        if line is not None:
            sys.stderr.write(f"{line}\n")
            tell_torchrun(line)
        else:
            log.info("Rank %d is stopping: another rank's line says why", self.rank)
        sys.stderr.flush()
        logging.shutdown()
        os._exit(EXIT_CODE)

    def _terminate(self, why: str) -> None:
        log.info(
            "Rank %d is stopping because %s. Waiting %.0fs for it to exit on its own.",
            self.rank,
            why,
            self.grace_period,
        )
        if self._stopped.wait(self.grace_period):
            return
        sys.stderr.write(f"[rank {self.rank}] exiting: {why}\n")
        sys.stderr.flush()
        logging.shutdown()
        os._exit(EXIT_CODE)


_context: Callable[[], str] | None = None


def set_failure_context(context: Callable[[], str] | None) -> None:
    """What this rank was doing, for the line the failure monitor prints when it ends the
    process itself (a frozen rank): e.g. ``rank 0 stopped at step 5; the last complete
    checkpoint is ...`` (the trainer sets it during a run; ``None`` clears it)."""
    global _context
    _context = context


def _stopping_context(rank: int, timeout: float = 10.0) -> str:
    """The context's phrase, given ``timeout`` seconds (it may read a save folder on a mount
    that froze too), else ``rank N stopped``."""
    context = _context
    if context is not None:
        answer: list[str] = []
        worker = threading.Thread(target=lambda: answer.append(context()), daemon=True)
        worker.start()
        worker.join(timeout)
        if answer:
            return answer[0]
    return f"rank {rank} stopped"


def tell_torchrun(line: str) -> None:
    """Give torchrun's failure summary this rank's line, instead of its "To enable traceback
    see ..." (the file its ``@record`` decorator would write, with the line as the
    traceback: the full one is in the file the line names)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {
        "message": line,
        "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))},
    }
    with contextlib.suppress(OSError):
        Path(path).write_text(json.dumps({"message": data}))
