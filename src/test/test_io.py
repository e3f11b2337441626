"""io: atomic local writes, remote writes through fsspec, retries."""

from __future__ import annotations

from pathlib import Path

import fsspec
import pytest

from olmolike import io
from olmolike.exceptions import NetworkError


def test_local_write_is_atomic_and_refuses_to_overwrite(tmp_path: Path) -> None:
    path = io.write_file(tmp_path / "a", "b/c.txt", "hello")
    assert Path(path).read_text() == "hello"
    with pytest.raises(FileExistsError):
        io.write_file(tmp_path / "a", "b/c.txt", "bye")
    io.write_file(tmp_path / "a", "b/c.txt", b"bye", overwrite=True)
    assert Path(path).read_bytes() == b"bye"
    assert [p.name for p in (tmp_path / "a" / "b").iterdir()] == ["c.txt"]  # no temp files left


def test_remote_write_and_persist() -> None:
    assert io.write_file("memory://io-test", "x.txt", "remote") == "memory://io-test/x.txt"
    assert fsspec.filesystem("memory").cat("/io-test/x.txt") == b"remote"
    with pytest.raises(FileExistsError):
        io.write_file("memory://io-test", "x.txt", "again")


def test_retry_recovers_from_transient_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(io.time, "sleep", lambda _: None)
    attempts: list[int] = []

    def flaky() -> str:
        attempts.append(1)
        if len(attempts) < 3:
            raise ConnectionResetError("reset by peer")
        return "ok"

    assert io.retry_network(flaky, "flaky op") == "ok" and len(attempts) == 3


def test_retry_gives_up_with_network_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(io.time, "sleep", lambda _: None)

    def down() -> None:
        raise TimeoutError("timed out")

    with pytest.raises(NetworkError, match="flaky upload failed after 3 attempts"):
        io.retry_network(down, "flaky upload", attempts=3)


def test_permanent_errors_are_not_retried() -> None:
    calls: list[int] = []

    def missing() -> None:
        calls.append(1)
        raise FileNotFoundError("gone")

    with pytest.raises(FileNotFoundError):
        io.retry_network(missing, "read")
    assert calls == [1]
