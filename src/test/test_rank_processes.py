"""The ranks of ``testutils.run_distributed`` are forked from a fork server (fast), yet each
has what a spawned process has: the starting test's environment and captured output, a clean
failure report, and its ``atexit`` handlers run when it ends."""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path

import pytest
from testutils import run_distributed, run_distributed_test

pytestmark = pytest.mark.timeout(300)


def _environment_and_output() -> tuple[str | None, str]:
    print(f"stdout of rank {os.environ['RANK']}", flush=True)
    print(f"stderr of rank {os.environ['RANK']}", file=sys.stderr, flush=True)
    return os.environ.get("RANK_PROCESSES_PROBE"), os.environ["RANK"]


def test_a_rank_has_the_tests_environment_and_output(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    # Ranks started before the change, so that what the later ones get is not the state
    # the fork server happened to start with.
    assert run_distributed_test(_environment_and_output) == [(None, "0"), (None, "1")]
    capfd.readouterr()
    monkeypatch.setenv("RANK_PROCESSES_PROBE", "set by this test")
    assert run_distributed_test(_environment_and_output) == [
        ("set by this test", "0"),
        ("set by this test", "1"),
    ]
    out, err = capfd.readouterr()
    assert "stdout of rank 0" in out and "stdout of rank 1" in out, out
    assert "stderr of rank 0" in err and "stderr of rank 1" in err, err


def _register_exit_handler(folder: str) -> None:
    marker = Path(folder) / f"exited-{os.environ['RANK']}"
    atexit.register(marker.touch)
    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 fails on purpose")


def test_a_rank_runs_its_exit_handlers_and_reports_its_error(tmp_path: Path) -> None:
    outcomes = run_distributed(_register_exit_handler, args=(str(tmp_path),), timeout=120)
    assert outcomes[1].exitcode == 1
    assert outcomes[1].error is not None and "rank 1 fails on purpose" in outcomes[1].error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exited-0", "exited-1"]


def _finalize_at_exit(folder: str) -> None:
    import weakref

    class Held:
        pass

    held = Held()
    weakref.finalize(held, (Path(folder) / f"finalized-{os.environ['RANK']}").touch)
    _HELD.append(held)  # alive until the rank exits


_HELD: list[object] = []


def test_a_ranks_finalizers_run_at_exit_but_torchs_operator_libraries_are_left(
    tmp_path: Path,
) -> None:
    import weakref

    import torch
    from rank_processes import skip_torch_library_finalizers

    run_distributed_test(_finalize_at_exit, args=(str(tmp_path),))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["finalized-0", "finalized-1"]

    library = torch.library.Library("olmolike_rank_processes_probe", "DEF")
    ours = weakref.finalize(library, lambda: None)
    torch_ones = [
        f for f, info in weakref.finalize._registry.items()  # type: ignore[attr-defined]
        if getattr(info.func, "__module__", None) == "torch.library"
    ]  # fmt: skip
    assert torch_ones and all(f.atexit for f in torch_ones)
    try:
        skip_torch_library_finalizers()
        assert not any(f.atexit for f in torch_ones) and ours.atexit
    finally:
        for f in torch_ones:
            f.atexit = True
        ours.detach()
        del library
