"""Checkpoint speed and memory: parallel writes and reads, staging memory freed between async
saves, and shard uploads that overlap writing (``checkpoint_save``, ``Checkpointer``)."""

from __future__ import annotations

import gc
import threading
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from remote_servers import RemoteStore
from testutils import build_trainer
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager

import olmolike.io
from olmolike.distributed import checkpoint_loading, checkpoint_save
from olmolike.distributed.checkpoint import load_state_dict, save_state_dict
from olmolike.distributed.checkpoint_save import MAX_DEFAULT_THREADS, default_thread_count
from olmolike.testing import TinyCausalLM
from olmolike.train import BasicTrainModule, Duration
from olmolike.train.callbacks import CheckpointerCallback
from olmolike.train.checkpoint import MARKER, Checkpointer, CheckpointerConfig
from olmolike.train.checkpoint.checkpointer import stagers_are_reusable


def module(seed: int = 0) -> BasicTrainModule:
    """A small model with AdamW state (after one step)."""
    torch.manual_seed(seed)
    model = TinyCausalLM(vocab_size=64, d_model=16, n_layers=2, n_heads=2, max_seq_len=8)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optim.step()
    return BasicTrainModule(model, optim, rank_microbatch_size=8)


def flat_state(m: BasicTrainModule) -> dict[str, torch.Tensor]:
    state = {f"model.{k}": v for k, v in m.model.state_dict().items()}
    for i, per_param in m.optim.state_dict()["state"].items():
        state.update({f"optim.{i}.{k}": v for k, v in per_param.items()})
    return state


def assert_same(a: BasicTrainModule, b: BasicTrainModule) -> None:
    sa, sb = flat_state(a), flat_state(b)
    assert sa.keys() == sb.keys()
    for key, value in sa.items():
        assert torch.equal(value, sb[key]), key


def shard_files(dcp_dir: Path) -> list[str]:
    return sorted(p.name for p in dcp_dir.glob("*.distcp"))


# -- thread counts, parallel writes and reads ------------------------------------------------


@pytest.mark.parametrize(("cpus", "expected"), [(1, 2), (2, 2), (5, 5), (64, MAX_DEFAULT_THREADS)])
def test_default_thread_count_follows_the_cpus_within_bounds(
    monkeypatch: pytest.MonkeyPatch, cpus: int, expected: int
) -> None:
    monkeypatch.setattr(checkpoint_save.os, "sched_getaffinity", lambda _: set(range(cpus)))
    assert default_thread_count() == expected


@pytest.mark.parametrize("save_threads", [None, 3])
def test_each_write_thread_writes_a_file_and_every_read_gives_the_saved_values(
    tmp_path: Path, save_threads: int | None
) -> None:
    saved = module(seed=0)
    checkpointer = Checkpointer(work_dir=tmp_path / "work", save_thread_count=save_threads)
    checkpointer.save(str(tmp_path / "step1"), saved, {"step": 1})
    threads = save_threads or default_thread_count()
    assert shard_files(tmp_path / "step1" / "model_and_optim") == [
        f"__0_{i}.distcp" for i in range(threads)
    ]
    for load_threads in (1, 4):
        loaded = module(seed=1)
        Checkpointer(work_dir=tmp_path / "work", load_thread_count=load_threads).load(
            str(tmp_path / "step1"), loaded
        )
        assert_same(saved, loaded)


def test_a_single_file_is_read_by_several_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint written as before (torch's writer, one thread: one file) loads exactly,
    its items split over the reading threads."""
    state = {f"t{i}": torch.randn(100 + i) for i in range(6)}
    torch.distributed.checkpoint.save(
        state, storage_writer=FileSystemWriter(str(tmp_path), thread_count=1, sync_files=True)
    )
    assert shard_files(tmp_path) == ["__0_0.distcp"]
    parts: list[tuple[str, set[str]]] = []
    # Each thread's part of the plan, whichever way its items are then read.
    real_read = checkpoint_loading._CheckedRecords._read_checked

    def recording_read(self: Any, plan: Any, planner: Any) -> Any:
        names = {item.dest_index.fqn for item in plan.items}
        parts.append((threading.current_thread().name, names))
        return real_read(self, plan, planner)

    monkeypatch.setattr(checkpoint_loading._CheckedRecords, "_read_checked", recording_read)
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    load_state_dict(tmp_path, loaded, thread_count=3)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    assert len(parts) == 3
    assert all(name.startswith("checkpoint-read") for name, _ in parts)
    assert set().union(*(names for _, names in parts)) == set(state)
    assert sum(len(names) for _, names in parts) == len(state)  # each item read once


def test_thread_counts_can_be_set_and_must_be_positive() -> None:
    config = CheckpointerConfig(save_thread_count=5, load_thread_count=6)
    checkpointer = config.build(Path("work"), save_overwrite=False)
    assert (checkpointer.save_thread_count, checkpointer.load_thread_count) == (5, 6)
    with pytest.raises(Exception, match="load_thread_count"):
        CheckpointerConfig(load_thread_count=0).validate()


# -- staging memory -------------------------------------------------------------------------


Staged = tuple[int, weakref.ref[Any], weakref.ref[Any]]


def staged_copies(monkeypatch: pytest.MonkeyPatch) -> list[Staged]:
    """Every staging's CPU copy of the first model weight: its address, a weak reference to
    it, and one to the stager that holds the buffers."""
    staged: list[Staged] = []
    real_stage = DefaultStager.stage
    stagers_are_reusable()  # the once-per-process probe stages too: not here, uncounted

    def recording_stage(self: DefaultStager, state_dict: Any, **kwargs: Any) -> Any:
        copy = real_stage(self, state_dict, **kwargs)
        tensor = next(iter(copy["model"].values()))
        staged.append((tensor.data_ptr(), weakref.ref(tensor), weakref.ref(self)))
        return copy

    monkeypatch.setattr(DefaultStager, "stage", recording_stage)
    return staged


@pytest.mark.parametrize("prepared", [False, True])
def test_staging_copy_is_freed_once_an_async_save_is_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prepared: bool
) -> None:
    staged = staged_copies(monkeypatch)
    saved = module()
    checkpointer = Checkpointer(work_dir=tmp_path / "work")
    if prepared:  # as the callback does a step before the save
        checkpointer.prepare_async_staging(saved)
        checkpointer.wait_for_pending_save()
    checkpointer.save_async(str(tmp_path / "step1"), saved, {"step": 1}).result()
    assert len(staged) == 1 + prepared
    if prepared:  # the save filled the buffers prepared for it
        assert staged[0][0] == staged[1][0]
    gc.collect()
    assert all(copy() is None and stager() is None for _, copy, stager in staged)
    loaded = module(seed=1)
    checkpointer.load(str(tmp_path / "step1"), loaded)
    assert_same(saved, loaded)


def test_staging_buffers_are_kept_and_reused_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    staged = staged_copies(monkeypatch)
    saved = module()
    checkpointer = Checkpointer(work_dir=tmp_path / "work", keep_staging_buffers=True)
    for step in (1, 2):
        checkpointer.prepare_async_staging(saved)  # allocates once, then nothing to do
        checkpointer.save_async(str(tmp_path / f"step{step}"), saved, {"step": step}).result()
    assert len(staged) == 3
    assert len({address for address, _, _ in staged}) == 1  # one buffer, filled by every save
    gc.collect()
    assert {stager() for _, _, stager in staged} == {checkpointer._stager}  # held all along
    assert checkpointer._stager is not None


@pytest.mark.parametrize("keep", [False, True])
def test_buffers_prepared_for_a_save_that_does_not_happen_are_freed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keep: bool
) -> None:
    """Discarding frees buffers prepared for a save that will not come (kept ones stay);
    closing the checkpointer frees every buffer and ends its threads."""
    staged = staged_copies(monkeypatch)
    threads_before = set(threading.enumerate())
    checkpointer = Checkpointer(work_dir=tmp_path / "work", keep_staging_buffers=keep)
    checkpointer.prepare_async_staging(module())
    checkpointer.wait_for_pending_save()
    checkpointer.discard_prepared_staging()
    gc.collect()
    assert len(staged) == 1
    assert (staged[0][2]() is None) is not keep  # the stager holds the buffers
    checkpointer.close()
    gc.collect()
    assert all(copy() is None and stager() is None for _, copy, stager in staged)
    assert set(threading.enumerate()) <= threads_before


def test_the_callback_prepares_the_buffers_a_step_before_each_async_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prepared_at: list[int] = []
    real_prepare = Checkpointer.prepare_async_staging

    def recording_prepare(self: Checkpointer, train_module: Any) -> None:
        prepared_at.append(trainer.global_step)
        real_prepare(self, train_module)

    monkeypatch.setattr(Checkpointer, "prepare_async_staging", recording_prepare)
    trainer = build_trainer(
        tmp_path / "save",
        work_dir=str(tmp_path / "work"),
        max_duration=Duration.steps(6),
        callbacks={"checkpointer": CheckpointerCallback(save_interval=3, save_async=True)},
    )
    trainer.fit()
    assert prepared_at == [2, 5]  # before step 3 and the final step 6
    assert Checkpointer.dir_is_checkpoint(str(tmp_path / "save" / "step6"))


# -- uploads overlapping writes --------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("via", ["checkpointer", "save_state_dict"])
@pytest.mark.parametrize("bucket", ["gcs_bucket", "s3_bucket"])
def test_a_shard_is_uploaded_while_the_others_are_still_written(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    bucket: str,
    via: str,
) -> None:
    """DCP writes its ``.metadata`` after every shard; it waits here until a shard upload has
    begun, which happens only if uploads start before the write is over."""
    store: RemoteStore = request.getfixturevalue(bucket)
    upload_started = threading.Event()
    waited: list[bool] = []
    uploaded: list[str] = []
    real_persist, real_finish = olmolike.io.persist, FileSystemWriter.finish

    def recording_persist(src_dir: Any, dst_dir: Any, name: Any, **kwargs: Any) -> str:
        uploaded.append(str(name))
        if str(name).endswith(".distcp"):
            upload_started.set()
        return real_persist(src_dir, dst_dir, name, **kwargs)

    def finish_after_an_upload_began(self: Any, *args: Any, **kwargs: Any) -> Any:
        waited.append(upload_started.wait(timeout=60))
        return real_finish(self, *args, **kwargs)

    monkeypatch.setattr(olmolike.io, "persist", recording_persist)
    monkeypatch.setattr(FileSystemWriter, "finish", finish_after_an_upload_began)
    saved = module()
    loaded = module(seed=1)
    if via == "checkpointer":
        checkpointer = Checkpointer(work_dir=tmp_path / "work", save_thread_count=2)
        checkpointer.save(store.url("run", "step1"), saved, {"step": 1})
        shards = ["model_and_optim/__0_0.distcp", "model_and_optim/__0_1.distcp"]
        expected = [MARKER, "model_and_optim/.metadata", *shards, "train/rank0.pt"]
        checkpointer.load(store.url("run", "step1"), loaded)
    else:
        save_state_dict(store.url("run", "step1"), saved.state_dict_to_save(), thread_count=2)
        shards = ["__0_0.distcp", "__0_1.distcp"]
        expected = [".metadata", *shards]
        state = loaded.state_dict_to_load()
        load_state_dict(store.url("run", "step1"), state)
        loaded.load_state_dict(state)
    assert waited == [True]
    assert sorted(uploaded[:2]) == shards
    assert store.objects("run", "step1") == sorted(expected)
    assert_same(saved, loaded)
