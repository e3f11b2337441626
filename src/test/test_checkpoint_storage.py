"""How checkpoint files meet the disk (``checkpoint_save``'s writer): every byte of a shard is
fsynced before the save ends, and the disk is handed each file's bytes as they are written.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from olmolike.distributed import checkpoint_save
from olmolike.distributed.checkpoint import save_state_dict


def _state(megabytes: int = 1) -> dict[str, Any]:
    torch.manual_seed(0)
    return {"big": torch.randn(megabytes << 18), "small": torch.randn(7), "step": 3}


def test_every_byte_of_a_shard_is_on_disk_when_it_is_fsynced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # DCP fsyncs a file's descriptor before closing the stream: nothing may wait in a buffer.
    synced: dict[str, int] = {}
    fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        name = os.readlink(f"/proc/self/fd/{fd}")
        synced[name] = os.fstat(fd).st_size
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    save_state_dict(tmp_path, _state(), thread_count=2)
    shards = sorted(tmp_path.glob("*.distcp"))
    assert len(shards) == 2
    for shard in shards:
        assert synced[str(shard.resolve())] == shard.stat().st_size, shard


def test_the_disk_is_handed_each_16_mb_as_it_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if checkpoint_save._SYNC_FILE_RANGE is None:
        pytest.skip("no sync_file_range in this C library")
    ranges: list[tuple[int, int]] = []
    real = checkpoint_save._SYNC_FILE_RANGE

    def recording(fd: int, offset: int, length: int, flags: int) -> int:
        ranges.append((offset, length))
        return real(fd, offset, length, flags)

    monkeypatch.setattr(checkpoint_save, "_SYNC_FILE_RANGE", recording)
    save_state_dict(tmp_path, _state(megabytes=40), thread_count=1)
    (shard,) = tmp_path.glob("*.distcp")
    assert ranges and ranges[0][0] == 0
    for (offset, length), (after, _) in itertools.pairwise(ranges):
        assert offset + length == after  # contiguous: every byte, once
    end = ranges[-1][0] + ranges[-1][1]
    assert shard.stat().st_size - end < 16 << 20  # only the tail waits for the fsync
