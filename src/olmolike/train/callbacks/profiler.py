"""Profiles a window of training steps with ``torch.profiler`` and saves Chrome traces."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from torch.profiler import ProfilerActivity, _ExperimentalConfig, profile, schedule

from ...distributed.utils import get_rank
from ...exceptions import ConfigurationError
from .callback import Callback

__all__ = ["ProfilerCallback"]

log = logging.getLogger(__name__)

_RANK_SHORTCUTS = frozenset({"all", "dp", "tp", "cp", "pp", "ep"})


@dataclass
class ProfilerCallback(Callback, name="profiler"):
    """Records ``active`` steps after ``skip_first + wait + warmup`` steps, ``repeat`` times.

    The early steps of a run are not representative (allocator warm-up, compilation, cold
    caches), hence ``skip_first`` and ``warmup``: the profiler runs but discards those steps.
    Each finished cycle is written as a Chrome trace (open it in ``chrome://tracing`` or
    Perfetto) to ``{save_folder}/profiler/rank{R}/step{S}.chrome_trace.json``, where ``S`` is
    the last step of the cycle. Traces are first written to the trainer's ``work_dir`` and then
    copied, so a remote save folder works too.

    Only ``ranks`` profile: a trace per rank is large, and ranks usually behave alike.
    """

    skip_first: int = 0
    """Steps ignored entirely at the start of profiling."""
    wait: int = 1
    """Idle steps at the start of each cycle."""
    warmup: int = 1
    """Steps traced but discarded at the start of each cycle (profiler start-up costs)."""
    active: int = 3
    """Steps recorded in each cycle."""
    repeat: int = 1
    """Cycles to record; ``0`` records cycles until training ends."""
    ranks: list[int] | str | None = None
    """The global ranks that profile: a list, ``None`` (rank 0), ``"all"``, or one of
    OLMo-core's group shortcuts ``"dp"``, ``"tp"``, ``"cp"``, ``"pp"``, ``"ep"`` (one rank per
    group). olmolike parallelizes over data only, so the shortcuts mean rank 0."""
    profile_memory: bool = False
    """Track tensor allocations and frees (bigger traces, slower steps)."""
    with_stack: bool = False
    """Record Python stacks for each op (much bigger traces)."""
    record_shapes: bool = False
    """Record the input shapes of each op."""
    enable_cuda_sync_events: bool = False
    """Record CUDA synchronization events, for critical-path analysis of the trace."""
    enabled: bool = True
    """``False`` turns the callback off while keeping it in the config (an override can turn it back
    on)."""

    _profiler: profile | None = field(default=None, init=False, repr=False)
    _traces: list[str] = field(default_factory=list, init=False, repr=False)

    def validate(self) -> None:
        for name in ("skip_first", "wait", "warmup", "repeat"):
            if getattr(self, name) < 0:
                raise ConfigurationError(f"must be >= 0, got {getattr(self, name)}", path=name)
        if self.active < 1:
            raise ConfigurationError(
                f"must be >= 1 (steps recorded per cycle), got {self.active}", path="active"
            )
        if isinstance(self.ranks, str):
            if self.ranks not in _RANK_SHORTCUTS:
                raise ConfigurationError(
                    f"must be a list of ranks, null, or one of {sorted(_RANK_SHORTCUTS)}, got "
                    f"{self.ranks!r}",
                    path="ranks",
                )
        elif self.ranks is not None and (not self.ranks or any(r < 0 for r in self.ranks)):
            raise ConfigurationError(
                f"must list at least one rank, each >= 0, got {self.ranks}", path="ranks"
            )

    def _profiles_this_rank(self) -> bool:
        if self.ranks == "all":
            return True
        if isinstance(self.ranks, list):
            return get_rank() in self.ranks
        return get_rank() == 0

    @property
    def traces(self) -> list[str]:
        """Paths of the traces saved so far (on this rank)."""
        return list(self._traces)

    @property
    def _trace_dir(self) -> str:
        return f"profiler/rank{get_rank()}"

    def pre_train(self) -> None:
        if not self.enabled or not self._profiles_this_rank():
            return
        activities = [ProfilerActivity.CPU]
        if self.trainer.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        (self.trainer.work_dir / self._trace_dir).mkdir(parents=True, exist_ok=True)
        self._profiler = profile(
            activities=activities,
            schedule=schedule(
                skip_first=self.skip_first,
                wait=self.wait,
                warmup=self.warmup,
                active=self.active,
                repeat=self.repeat,
            ),
            on_trace_ready=self._save_trace,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
            record_shapes=self.record_shapes,
            experimental_config=_ExperimentalConfig(enable_cuda_sync_events=True)
            if self.enable_cuda_sync_events
            else None,
        )
        self._profiler.start()
        log.info("Profiling steps on rank %d; traces go to %s", get_rank(), self._trace_dir)

    def post_step(self) -> None:
        if self._profiler is not None:
            self._profiler.step()

    def _save_trace(self, prof: profile) -> None:
        name = Path(self._trace_dir) / f"step{self.trainer.global_step}.chrome_trace.json"
        prof.export_chrome_trace(str(self.trainer.work_dir / name))
        saved = self.trainer.persist_working_file(name)
        self._traces.append(str(saved))
        log.info("Saved a profiler trace to %s", saved)

    def post_train(self) -> None:
        self._stop()

    def close(self) -> None:
        self._stop()

    def _stop(self) -> None:
        profiler, self._profiler = self._profiler, None
        if profiler is None:
            return
        # Stopping mid-cycle flushes the partial cycle through on_trace_ready: keep it, a run
        # that ends early is often the one worth looking at.
        profiler.stop()
