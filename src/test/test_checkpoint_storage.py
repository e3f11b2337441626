"""How checkpoint files meet the disk (``checkpoint_save``'s writer, ``checkpoint_storage``'s
readers): every byte of a shard is fsynced before the save ends, the disk is handed each file's
bytes as they are written, and a load checks every record's CRC-32 from the bytes it reads
anyway (one read of each shard, not two).
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from olmolike.distributed import checkpoint_save
from olmolike.distributed.checkpoint import load_state_dict, save_state_dict
from olmolike.distributed.checkpoint_storage import (
    _CheckingWindow,
    _stored_records,
    _Window,
)

PROC_IO = Path("/proc/self/io")


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


@pytest.mark.skipif(not PROC_IO.exists(), reason="reads /proc/self/io (Linux)")
def test_a_load_reads_each_shard_once_and_checks_it(tmp_path: Path) -> None:
    state = _state(megabytes=16)
    save_state_dict(tmp_path, state, thread_count=1)
    shard_bytes = sum(p.stat().st_size for p in tmp_path.glob("*.distcp"))
    target = {"big": torch.zeros_like(state["big"]), "small": torch.zeros(7), "step": 0}

    def bytes_read() -> int:
        fields = dict(line.split(": ") for line in PROC_IO.read_text().splitlines())
        return int(fields["rchar"])

    before = bytes_read()
    load_state_dict(tmp_path, target, thread_count=1)
    read = bytes_read() - before
    assert torch.equal(target["big"], state["big"]) and target["step"] == 3
    assert shard_bytes <= read < 1.25 * shard_bytes, (read, shard_bytes)


def _archive(path: Path) -> tuple[int, int]:
    """A ``torch.save`` archive of 1 MB of data at ``path``; where its data record is."""
    torch.save(torch.arange(1 << 18, dtype=torch.float32), path)
    with open(path, "rb") as f:
        (data,) = [r for r in _stored_records(f) if r.size == 1 << 20]
    return data.start, data.size


@pytest.mark.parametrize("damaged", [False, True])
def test_a_record_torch_does_not_read_in_order_is_checked_from_the_file(
    tmp_path: Path, damaged: bool
) -> None:
    path = tmp_path / "archive.pt"
    start, size = _archive(path)
    if damaged:  # a byte in the half that is never read through the window
        with open(path, "r+b") as f:
            f.seek(start + size * 3 // 4)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
    length = path.stat().st_size
    with open(path, "rb") as f:
        records = _stored_records(_Window(f, 0, length))  # type: ignore[arg-type]
        window = _CheckingWindow(f, 0, length, records, path)
        window.seek(start)
        window.read(size // 2)
    problem = window.problem()  # its stream is closed: the rest is read from the path
    if damaged:
        assert problem is not None and "does not match its CRC-32" in problem
    else:
        assert problem is None


def test_a_garbled_record_read_through_the_window_is_found(tmp_path: Path) -> None:
    path = tmp_path / "archive.pt"
    start, _ = _archive(path)
    with open(path, "r+b") as f:
        f.seek(start + 12345)
        f.write(b"\x00\x01\x02")
    length = path.stat().st_size
    with open(path, "rb") as f:
        records = _stored_records(_Window(f, 0, length))  # type: ignore[arg-type]
        window = _CheckingWindow(f, 0, length, records, path)
        torch.load(window, weights_only=True)  # reads every record, as DCP's reader does
        assert all(r.checked == r.size for r in records)  # checked from torch's own reads
        problem = window.problem()
    assert problem is not None and "does not match its CRC-32" in problem
