"""Tracker sinks that take every message and discard it: ``trainer_overhead.py
--discard-tracker-metrics`` runs the W&B and Aim callbacks with these in their sink processes.

Everything olmolike does for a tracker still happens (the callbacks' hooks, pickling each
collection's metrics, the feeder thread, the child process reading them); only the tracker
SDK's own work (W&B's records and its service process, Aim's database writes) is left out. The
difference between a run with these and one with the real sinks is what the SDKs cost; the
difference between these and a run without the two callbacks is what olmolike costs.

A module of its own: the sink process imports the class by name, which a class defined in a
script run as ``__main__`` would not allow.
"""

from __future__ import annotations

from typing import Any


class DiscardingWandBSink:
    """Answers like :class:`olmolike.train.callbacks.wandb.WandBSink`; logs nothing."""

    def __init__(self, init_kwargs: dict[str, Any]) -> None:
        self.dir = str(init_kwargs.get("dir") or ".")

    def info(self) -> dict[str, str]:
        return {"id": "discarded", "dir": self.dir, "entity": "none", "project": "none"}

    def log(self, values: dict[str, float], step: int) -> None:
        del values, step

    def finish(self, exit_code: int) -> None:
        del exit_code


class DiscardingAimSink:
    """Answers like :class:`olmolike.train.callbacks.aim.AimSink`; tracks nothing."""

    def __init__(self, *args: Any) -> None:
        del args

    def start(self) -> tuple[str, bool]:
        return "discarded", False

    def track(self, values: dict[str, float], step: int) -> None:
        del values, step

    def close(self) -> None:
        pass
