"""A save that fails on one rank fails on every rank, at once, naming that rank and its error.

Real 2-rank gloo runs, local and on the GCS emulator, sync and async: one rank fails at each
stage of a save in turn (copying its state, DCP's planning, writing, uploading, committing).
Every rank must raise :class:`CheckpointError` with the failed rank and its original error,
long before the group's timeout; the failed checkpoint has no marker, the previous one stays
intact, and the next save works.
"""

from __future__ import annotations

import contextlib
import errno
import time
from pathlib import Path
from typing import Any
from unittest import mock

import fsspec
import pytest
from remote_servers import RemoteStore
from testutils import build_trainer, patient, run_distributed

from olmolike import io
from olmolike.distributed.checkpoint_format import verify_checkpoint
from olmolike.exceptions import CheckpointError
from olmolike.train.checkpoint import MARKER, Checkpointer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STAGES = ("staging", "planning", "writing", "uploading", "committing")
PROMPT_S = 30.0
"""A failed save must end within this (stretched on a busy machine), far below the group
timeout (15 min here): a rank left waiting in a collective would take that long."""


def failing_rank(stage: str) -> int:
    return 0 if stage == "committing" else 1  # only rank 0 commits


def _raise(error: BaseException) -> Any:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise error

    return fail


def _injection(stage: str, save_async: bool, trainer: Any) -> Any:
    """Patch the step of ``stage`` to fail with an error naming it."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.staging import DefaultStager

    from olmolike.train.checkpoint.save import CheckpointSave

    text = f"injected {stage} failure"
    if stage == "staging":  # a sync save copies nothing: its state dict fails to build
        if save_async:
            return mock.patch.object(DefaultStager, "stage", _raise(MemoryError(text)))
        return mock.patch.object(
            trainer.train_module, "state_dict_to_save", _raise(MemoryError(text))
        )
    if stage == "planning":
        return mock.patch.object(
            DefaultSavePlanner, "create_local_plan", _raise(RuntimeError(text))
        )
    if stage == "writing":
        error = OSError(errno.ENOSPC, text)
        return mock.patch.object(FileSystemWriter, "write_data", _raise(error))
    if stage == "uploading":
        return mock.patch.object(io, "persist", _raise(ConnectionError(text)))
    return mock.patch.object(CheckpointSave, "_commit", _raise(OSError(text)))


def _fail_each_stage(
    folder: str,
    settings: dict[str, Any],
    save_async: bool,
    stages: tuple[str, ...],
    work: str | None = None,
) -> dict[str, Any]:
    fsspec.config.conf.update(settings)
    from olmolike.distributed.utils import get_rank

    # Ranks on "nodes" of their own stage uploads in work dirs of their own.
    work_dir = {"work_dir": f"{work}/node{get_rank()}"} if work else {}
    trainer = build_trainer(folder, **work_dir)

    def save(step: int) -> None:
        trainer.global_step = step
        if save_async:
            trainer.save_checkpoint_async()
            trainer.checkpointer.wait_for_pending_save()  # raises a failure once, taking it
        else:
            trainer.save_checkpoint()

    save(1)  # the previous checkpoint, which must stay intact
    outcomes: dict[str, Any] = {}
    for step, stage in enumerate(stages, start=2):
        injected = (
            _injection(stage, save_async, trainer)
            if get_rank() == failing_rank(stage)
            else contextlib.nullcontext()
        )
        start = time.monotonic()
        try:
            with injected:
                save(step)
            outcomes[stage] = {"error": None}
        except BaseException as e:
            outcomes[stage] = {
                "checkpoint_error": isinstance(e, CheckpointError),
                "error": f"{type(e).__name__}: {e}",
                "seconds": time.monotonic() - start,
            }
    save(len(stages) + 2)  # the checkpointer is fine after all that
    return outcomes


def _check(outcomes: list[Any], stages: tuple[str, ...], folder: str) -> None:
    hung = [o for o in outcomes if o.error is not None or o.exitcode != 0]
    assert not hung, "\n".join(f"rank {o.rank} (exit {o.exitcode}): {o.error}" for o in hung)
    for step, stage in enumerate(stages, start=2):
        for outcome in outcomes:
            result = outcome.result[stage]
            message = result["error"]
            assert message is not None, f"{stage}: rank {outcome.rank} saved"
            assert result["checkpoint_error"], message
            assert f"step{step}" in message and f"failed on rank {failing_rank(stage)}: " in message
            assert f"injected {stage} failure" in message, message
            assert "\n" not in message
            assert result["seconds"] < patient(PROMPT_S), (stage, result["seconds"])
        assert not Checkpointer.dir_is_checkpoint(io.join_path(folder, f"step{step}"))
    verify_checkpoint(io.join_path(folder, "step1"))
    last = len(stages) + 2
    assert [s for s, _ in Checkpointer.find_checkpoints(folder)] == [1, last]


def _local_stages() -> tuple[str, ...]:
    return tuple(s for s in STAGES if s != "uploading")


@pytest.mark.parametrize("save_async", [False, True], ids=["sync", "async"])
def test_a_failure_on_one_rank_fails_every_rank_at_once_locally(
    tmp_path: Path, save_async: bool
) -> None:
    folder = str(tmp_path / "run")
    stages = _local_stages()
    outcomes = run_distributed(
        _fail_each_stage, 2, args=(folder, {}, save_async, stages), timeout=300
    )
    _check(outcomes, stages, folder)
    leftovers = sorted(p.name for p in tmp_path.joinpath("run").iterdir())
    assert leftovers == ["step1", "step6"], leftovers  # no staging folders left behind


@pytest.mark.parametrize("save_async", [False, True], ids=["sync", "async"])
def test_a_failure_on_one_rank_fails_every_rank_at_once_on_gcs(
    gcs_bucket: RemoteStore, tmp_path: Path, save_async: bool
) -> None:
    folder = gcs_bucket.url("run")
    settings = {key: dict(value) for key, value in fsspec.config.conf.items()}
    outcomes = run_distributed(
        _fail_each_stage,
        2,
        args=(folder, settings, save_async, STAGES, str(tmp_path)),
        timeout=300,
    )
    _check(outcomes, STAGES, folder)
    for step in range(2, len(STAGES) + 2):
        assert MARKER not in gcs_bucket.objects("run", f"step{step}")


def _public_async_save_with_staging_failure(folder: str) -> str:
    import torch
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.staging import DefaultStager

    from olmolike.distributed.checkpoint import async_save_model_and_optim_state
    from olmolike.distributed.utils import get_rank

    model = torch.nn.Linear(4, 4)
    with contextlib.ExitStack() as patches:
        if get_rank() == 1:  # whichever stager copies (DCP's default is the writer itself)
            for stager in (DefaultStager, FileSystemWriter):
                no_room = _raise(MemoryError("no room for the copy"))
                patches.enter_context(mock.patch.object(stager, "stage", no_room))
        future = async_save_model_and_optim_state(folder, model)
    try:
        future.result(timeout=patient(PROMPT_S))
    except CheckpointError as e:
        return str(e)
    return "saved"


def test_the_async_save_function_fails_on_every_rank_when_one_cannot_copy(
    tmp_path: Path,
) -> None:
    folder = str(tmp_path / "c")
    outcomes = run_distributed(_public_async_save_with_staging_failure, 2, args=(folder,))
    for outcome in outcomes:
        assert outcome.error is None, outcome.error
        assert f"saving {folder} failed on rank 1: MemoryError: no room" in outcome.result
    assert not (tmp_path / "c" / ".metadata").exists()
