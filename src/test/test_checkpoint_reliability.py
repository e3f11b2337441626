"""Checkpoints stay atomic when things go wrong: failed saves, pruning with async saves,
killed removals, corrupt checkpoints, model-shape mismatches, backends without CPU
collectives, and file permissions and fsyncs of the commit protocol."""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import subprocess
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import preloaded_python
import pytest
import torch
from testutils import SEQ_LEN, VOCAB, build_trainer, patient, run_distributed

from olmolike import io
from olmolike.data import TokenTensorDataLoader
from olmolike.distributed.checkpoint import check_checkpoint_backend
from olmolike.exceptions import CheckpointError, ConfigurationError
from olmolike.testing import TinyCausalLM, random_token_instances
from olmolike.train import BasicTrainModule, Duration, TrainerConfig
from olmolike.train.callbacks import CheckpointerCallback, ConfigSaverCallback
from olmolike.train.checkpoint import MARKER, Checkpointer

pytestmark = pytest.mark.timeout(300)


def checkpointer(**kwargs: Any) -> dict[str, Any]:
    return {"callbacks": {"checkpointer": CheckpointerCallback(**kwargs)}}


# -- a failed save --------------------------------------------------------------------------


def _fail_on_rank1(save: str, save_async: bool, failure: str) -> dict[str, Any]:
    """Train 3 steps saving at step 2, where rank 1 alone fails: its disk is full, or (the
    async save's copy to CPU memory) it runs out of memory."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.staging import DefaultStager

    from olmolike.distributed.utils import get_rank

    trainer = build_trainer(
        save, max_duration=Duration.steps(3), **checkpointer(save_interval=2, save_async=save_async)
    )
    owner, name = (
        (FileSystemWriter, "write_data") if failure == "disk" else (DefaultStager, "stage")
    )
    original = getattr(owner, name)

    def failing(self: Any, *args: Any, **kwargs: Any) -> Any:
        if failure == "disk" and "step2" in str(self.path):
            raise OSError(errno.ENOSPC, "No space left on device")
        if failure == "memory" and trainer.global_step >= 2:  # the copy is made at step 2
            raise MemoryError("cannot allocate the staging copy")
        return original(self, *args, **kwargs)

    if get_rank() == 1:
        setattr(owner, name, failing)
    try:
        trainer.fit()
    except BaseException as e:
        return {"checkpoint_error": isinstance(e, CheckpointError), "msg": str(e)}
    return {"checkpoint_error": False}


@pytest.mark.parametrize(
    ("save_async", "failure", "expected"),
    [
        (False, "disk", "OSError: [Errno 28] No space left"),
        (True, "disk", "OSError: [Errno 28] No space left"),
        (True, "memory", "MemoryError: cannot allocate the staging copy"),
    ],
    ids=["sync", "async", "async-copy"],
)
def test_a_failed_save_raises_checkpoint_error_on_every_rank_and_removes_its_staging(
    tmp_path: Path, save_async: bool, failure: str, expected: str
) -> None:
    outcomes = run_distributed(_fail_on_rank1, 2, args=(str(tmp_path), save_async, failure))
    for outcome in outcomes:
        assert outcome.error is None, outcome.error
        result = outcome.result
        # never torch's CheckpointException, a BaseException
        assert result["checkpoint_error"], result
        # on every rank, not only the failed one: the failed rank and its original error
        assert f"step2 failed on rank 1: {expected}" in result["msg"], result["msg"]
    leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith((".step", "step")))
    assert leftovers == ["step0"], leftovers  # the pre-train checkpoint only: no .step2.tmp


# -- pruning ----------------------------------------------------------------------------------


def test_two_async_ephemeral_saves_collected_together_keep_the_newest(tmp_path: Path) -> None:
    callback = CheckpointerCallback(save_interval=100, ephemeral_save_interval=2, save_async=True)
    trainer = build_trainer(tmp_path, max_duration=Duration.steps(8), callbacks={"c": callback})
    trainer.checkpointer.acquire_lease(str(tmp_path))
    for step in (2, 4):
        trainer.global_step = step
        callback._save(ephemeral=True)
    trainer._step_results.deliver_saves(wait=True)  # both finished: delivered in one go
    trainer.checkpointer.release_lease()
    assert [s for s, _ in Checkpointer.find_checkpoints(tmp_path)] == [4]


KILLED_REMOVAL = """
import os, signal, sys
sys.path.insert(0, {test_dir!r})
from testutils import build_trainer
from olmolike.train import Duration
from olmolike.distributed import checkpoint_format
from olmolike.train.callbacks import CheckpointerCallback

save, kill = sys.argv[1], sys.argv[2] == "kill"
original = checkpoint_format.io.remove
def remove(path, recursive=False):
    # step2's folder, or the name a background purge renamed it to (.purging-step2-...)
    if kill and recursive and "step2" in os.path.basename(str(path).rstrip("/")):
        os.kill(os.getpid(), signal.SIGKILL)  # its marker is gone, its files are not
    original(path, recursive=recursive)
checkpoint_format.io.remove = remove

if __name__ == "__main__":
    steps = int(sys.argv[3])
    cb = CheckpointerCallback(save_interval=2, max_checkpoints=1, pre_train_checkpoint=False)
    build_trainer(save, max_duration=Duration.steps(steps), callbacks={{"checkpointer": cb}}).fit()
"""


def test_a_removal_killed_half_way_is_cleaned_up_by_the_next_save(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(KILLED_REMOVAL.format(test_dir=str(Path(__file__).parent))))
    save = tmp_path / "run"

    def launch(mode: str, steps: int) -> int:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        cmd = [*preloaded_python.command(), str(script), str(save), mode, str(steps)]
        return subprocess.run(cmd, timeout=patient(240), env=env).returncode

    # Removing step 2 (max_checkpoints=1, once step 4 is complete) is killed after its marker.
    assert launch("kill", 6) == -9
    (left,) = [p for p in save.iterdir() if "step2" in p.name]
    assert (left / "model_and_optim").is_dir()
    assert not Checkpointer.dir_is_checkpoint(left)
    assert launch("none", 6) == 0  # resumes from step 4, saves step 6
    names = sorted(p.name for p in save.iterdir() if "step" in p.name)
    assert names == ["step6"], names


# -- corrupt checkpoints ----------------------------------------------------------------------


def _delete_shard(step: Path) -> str:
    (step / "model_and_optim" / "__0_0.distcp").unlink()
    return "__0_0.distcp is missing"


def _truncate_shard(step: Path) -> str:
    shard = step / "model_and_optim" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    return "__0_0.distcp is truncated"


def _garbage_metadata(step: Path) -> str:
    (step / "model_and_optim" / ".metadata").write_bytes(b"\x00garbage" * 10)
    return ".metadata is unreadable"


def _truncate_rank0(step: Path) -> str:
    state = step / "train" / "rank0.pt"
    state.write_bytes(state.read_bytes()[:50])
    return "rank0.pt is truncated or unreadable"


def _malformed_marker(step: Path) -> str:
    (step / MARKER).write_text('{"format_version": 1, "step": ')
    return "marker"


CORRUPTIONS: dict[str, Callable[[Path], str]] = {
    "deleted shard": _delete_shard,
    "truncated shard": _truncate_shard,
    "garbage .metadata": _garbage_metadata,
    "truncated rank0.pt": _truncate_rank0,
    "malformed marker": _malformed_marker,
}


@pytest.mark.parametrize("corrupt", list(CORRUPTIONS.values()), ids=list(CORRUPTIONS))
def test_a_corrupt_checkpoint_is_named_and_resume_falls_back_to_the_previous_one(
    tmp_path: Path, corrupt: Callable[[Path], str], caplog: pytest.LogCaptureFixture
) -> None:
    build_trainer(tmp_path, max_duration=Duration.steps(4), **checkpointer(save_interval=2)).fit()
    problem = corrupt(tmp_path / "step4")

    fresh = build_trainer(
        tmp_path, max_duration=Duration.steps(6), load_strategy="never", save_overwrite=True
    )
    with pytest.raises(CheckpointError) as error:
        fresh.load_checkpoint(tmp_path / "step4")
    assert str(tmp_path / "step4") in str(error.value) and problem in str(error.value)

    caplog.set_level(logging.WARNING)
    resumed = build_trainer(
        tmp_path, max_duration=Duration.steps(6), **checkpointer(save_interval=2)
    )
    resumed.fit()  # if_available: resumes from step 2, with a warning naming step 4
    assert "Cannot resume from" in caplog.text and "step4" in caplog.text
    assert resumed.global_step == 6
    # Later saves work: the damaged checkpoint did not break pruning or saving.
    assert Checkpointer.dir_is_checkpoint(tmp_path / "step6")


def _trainer_of_width(save: Path, d_model: int, **config: Any) -> Any:
    torch.manual_seed(0)
    model = TinyCausalLM(
        vocab_size=VOCAB, d_model=d_model, n_layers=2, n_heads=2, max_seq_len=SEQ_LEN
    )
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = TokenTensorDataLoader(
        random_token_instances(32, SEQ_LEN, VOCAB, seed=1), global_batch_size=8 * SEQ_LEN
    )
    experiment = {"model": {"d_model": d_model, "n_layers": 2}, "run_name": f"w{d_model}"}
    callbacks = {"config_saver": ConfigSaverCallback(config=experiment)}
    config = TrainerConfig(save_folder=str(save), callbacks=callbacks, **config)
    return config.build(BasicTrainModule(model, optim, rank_microbatch_size=8 * SEQ_LEN), loader)


def test_a_model_shape_mismatch_names_the_differing_config_fields(tmp_path: Path) -> None:
    _trainer_of_width(tmp_path / "a", 32, max_duration=Duration.steps(2)).fit()
    other = _trainer_of_width(tmp_path / "b", 48, load_path=str(tmp_path / "a"))
    with pytest.raises(CheckpointError) as error:
        other.fit()
    message = str(error.value)
    assert "step2" in message and "another shape" in message
    assert "model.d_model: 32 -> 48" in message
    assert "run_name" not in message  # only the fields that decide shapes


# -- backends -----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["nccl", "cuda:nccl", "xccl", "NCCL"])
def test_a_backend_without_cpu_collectives_is_refused_with_the_fix(backend: str) -> None:
    with pytest.raises(ConfigurationError) as error:
        check_checkpoint_backend(backend)
    assert "cpu:gloo,cuda:nccl" in str(error.value) and backend in str(error.value)


@pytest.mark.parametrize("backend", ["gloo", "cpu:gloo,cuda:nccl", "cuda:nccl,cpu:gloo", "mpi"])
def test_a_backend_with_cpu_collectives_is_accepted(backend: str) -> None:
    check_checkpoint_backend(backend)


# -- permissions and fsync ----------------------------------------------------------------------


@pytest.fixture
def group_writable_umask() -> Any:
    old = os.umask(0o002)
    yield
    os.umask(old)


def test_checkpoint_files_follow_the_umask(tmp_path: Path, group_writable_umask: None) -> None:
    trainer = build_trainer(
        tmp_path, max_duration=Duration.steps(2), **checkpointer(save_interval=2)
    )
    trainer.add_checkpoint_file("config.json", "{}")
    trainer.fit()
    (trainer.work_dir / "metrics.jsonl").write_text("{}\n")
    io.persist(trainer.work_dir, tmp_path / "copy", "metrics.jsonl")
    io.write_file(tmp_path, "config.json", "{}")
    for path in (
        tmp_path / "step2" / MARKER,
        tmp_path / "step2" / "config.json",
        tmp_path / "step2" / "train" / "rank0.pt",
        tmp_path / "copy" / "metrics.jsonl",
        tmp_path / "config.json",
    ):
        assert stat.S_IMODE(path.stat().st_mode) == 0o664, path


def test_the_commit_fsyncs_the_marker_and_the_directories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    trainer = build_trainer(tmp_path, max_duration=Duration.steps(1))
    monkeypatch.setattr(os, "fsync", recording_fsync)
    trainer.save_checkpoint()
    staging = str(tmp_path / ".step0.tmp")
    for expected in (
        f"{staging}/train/rank0.pt",
        f"{staging}/train",
        f"{staging}/model_and_optim",
        staging,
        str(tmp_path),  # after the rename into place
    ):
        assert expected in synced, (expected, synced)
    # The marker's own file is synced (under its temporary name) before the rename into place.
    marker_syncs = [i for i, p in enumerate(synced) if p.startswith(f"{staging}/.{MARKER}.")]
    assert marker_syncs and max(marker_syncs) < len(synced) - 1 - synced[::-1].index(str(tmp_path))
    assert json.loads((tmp_path / "step0" / MARKER).read_text())["step"] == 0
