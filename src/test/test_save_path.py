"""The rooms a save passes through, counted on a real save (docs/contributing-layers.md, "A save,
from the callback to the files and back").

A profiler watches one async save through ``CheckpointerCallback`` in one process, from the
callback's decision until the checkpoint is complete, and then the delivery of its
completion (``StepResults.deliver_saves``) until the callback's retention is done, on every
thread (the writer, DCP's, the purge). A room is a module of ``src/olmolike`` in which a
function runs. Not counted: what the checkpoint holds (whatever ``Trainer.state_dict`` and the
train module's ``state_dict_to_save`` call: data loader, RNG, model and optimizer state, the
same for any way of saving) and the helpers every module uses (files, threads, configs,
ranks, the dispatch of callback hooks), listed in ``HELPERS``.

``pytest src/test/test_save_path.py -q -s`` prints the path it saw.
"""

from __future__ import annotations

import logging
import sys
import threading
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

from testutils import build_trainer

import olmolike
from olmolike.train import Duration
from olmolike.train.callbacks import CheckpointerCallback
from olmolike.train.trainer import Trainer

PACKAGE = str(Path(olmolike.__file__).parent) + "/"

HELPERS = frozenset(
    {
        "io.py",
        "threads.py",
        "config.py",
        "exceptions.py",
        "distributed/utils.py",
        "train/callbacks/callback.py",
        "train/callbacks/hooks.py",
    }
)
"""Used by every room alike: files and URLs, thread pools, config fields, the error classes,
ranks and collectives, the callback base class, the dispatch of every hook."""

SAVE_PATH = [
    "train/callbacks/checkpointer.py",
    "train/trainer.py",
    "train/checkpoint/checkpointer.py",
    "train/checkpoint/save.py",
    "train/checkpoint/lease.py",
    "distributed/checkpoint_save.py",
    "distributed/checkpoint_format.py",
    "train/step_results.py",
]
"""The rooms (the docs' list, in the order of the save's steps)."""

AGREEMENT = "train/cancellation.py"
"""In a distributed run, how many saves every rank has seen finish is agreed by the periodic
cancel check, which ``deliver_saves`` is given: the ninth room (one process needs none)."""


class _Watch:
    """Records the rooms in which functions run while it is on (all threads)."""

    def __init__(self, content: set[CodeType]) -> None:
        self.content = content
        self.rooms: dict[str, str] = {}  # room -> the first function run there
        self.on = False

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or not self.on or not frame.f_code.co_filename.startswith(PACKAGE):
            return
        room = frame.f_code.co_filename[len(PACKAGE) :]
        if room in self.rooms or room in HELPERS or self._is_content(frame):
            return
        if frame.f_back is not None and frame.f_back.f_code.co_filename == logging.__file__:
            return  # a log record through a filter that setup_logging installed: not the save's
        self.rooms[room] = frame.f_code.co_qualname

    def _is_content(self, frame: FrameType | None) -> bool:
        while frame is not None:
            if frame.f_code in self.content:
                return True
            frame = frame.f_back
        return False


def test_a_save_passes_through_at_most_eight_rooms_and_back(tmp_path: Path) -> None:
    callback = CheckpointerCallback(save_interval=1, save_async=True, ephemeral_save_interval=None)
    trainer = build_trainer(
        tmp_path, max_duration=Duration.steps(2), callbacks={"checkpointer": callback}
    )
    content = {Trainer.state_dict.__code__}
    content.add(type(trainer.train_module).state_dict_to_save.__code__)
    watch = _Watch(content)
    trainer.checkpointer.acquire_lease(str(tmp_path))  # a save checks it: as in fit()
    trainer.global_step = 1
    sys.setprofile(watch)
    threading.setprofile(watch)
    try:
        watch.on = True
        callback._save(ephemeral=False)
        trainer.checkpointer.wait_for_pending_save()
        trainer._step_results.deliver_saves(wait=True)
    finally:
        watch.on = False
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
        trainer.checkpointer.release_lease()
        trainer.checkpointer.close()
    assert not callback.checkpoint_pending  # delivered: the callback's retention ran
    print("\n".join(f"{room}: {first}" for room, first in watch.rooms.items()))
    assert set(watch.rooms) == set(SAVE_PATH), watch.rooms
    assert len([*SAVE_PATH, AGREEMENT]) <= 9
