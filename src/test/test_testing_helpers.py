"""olmolike.testing.run_distributed_test and BACKENDS, with OLMo-core's signature."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import conftest
import pytest
import torch
import torch.distributed as dist
from testutils import patient
from torch.multiprocessing import ProcessRaisedException

from olmolike import testing
from olmolike.distributed.utils import get_rank, get_world_size
from olmolike.testing import BACKENDS, run_distributed_test


def _sum_of_ranks(expected: float, *, scale: float = 1.0) -> None:
    value = torch.tensor(float(get_rank()) * scale)
    dist.all_reduce(value)
    assert get_world_size() == 2 and value.item() == expected


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_runs_on_every_rank_with_args(backend: str) -> None:
    run_distributed_test(
        _sum_of_ranks, backend=backend, func_args=(2.0,), func_kwargs={"scale": 2.0}, timeout=90
    )


def _fail_on_rank_1() -> None:
    if get_rank() == 1:
        raise ValueError("rank 1 fails")


@pytest.mark.timeout(120)
def test_a_failing_rank_fails_the_test() -> None:
    with pytest.raises(ProcessRaisedException, match="rank 1 fails"):
        run_distributed_test(_fail_on_rank_1, start_method="spawn", timeout=90)


def _waits_forever() -> None:
    threading.Event().wait()  # as a rank stuck on a dead peer would


@pytest.mark.timeout(120)
def test_a_hang_is_a_timeout_not_a_hang() -> None:
    with pytest.raises(TimeoutError, match=r"did not finish within \d+s"):
        # Any timeout proves the point (the ranks hang forever); run_distributed_test
        # stretches it on a busy machine (busy_machine_factor), as every timeout there.
        run_distributed_test(_waits_forever, timeout=2)


def test_backends_param_ids() -> None:
    assert [p.id for p in BACKENDS] == ["backend=GLOO", "backend=NCCL"]


@pytest.mark.parametrize(
    ("load", "cpus", "factor"),
    [(0.3, 2, 1.0), (2.0, 2, 1.0), (10.0, 2, 5.0), (100.0, 2, 8.0), (12.0, 4, 3.0)],
)
def test_timeouts_stretch_with_the_load_per_cpu_within_bounds(
    monkeypatch: pytest.MonkeyPatch, load: float, cpus: int, factor: float
) -> None:
    monkeypatch.setattr(testing.os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(testing.os, "cpu_count", lambda: cpus)
    assert testing.busy_machine_factor() == factor
    assert patient(60) == 60 * factor


@dataclass
class _Item:
    """What conftest's timeout hook reads of a test item."""

    marker: Any
    added: list[Any] = field(default_factory=list)
    config: Any = field(default_factory=lambda: SimpleNamespace(getini=lambda name: "300"))

    def get_closest_marker(self, name: str) -> Any:
        return self.marker

    def add_marker(self, marker: Any, append: bool) -> None:
        assert not append  # first, so it is the closest one
        self.added.append(marker.mark)


@pytest.mark.parametrize(
    ("marker", "stretched"),
    [
        (None, 1200.0),
        (pytest.mark.timeout(120).mark, 480.0),
        (pytest.mark.timeout(timeout=50).mark, 200.0),
    ],
)
def test_the_conftest_hook_stretches_each_tests_timeout(
    monkeypatch: pytest.MonkeyPatch, marker: Any, stretched: float
) -> None:
    monkeypatch.setattr(conftest, "busy_machine_factor", lambda: 4.0)
    item = _Item(marker)
    next(conftest.pytest_runtest_protocol(item))  # type: ignore[arg-type]
    assert [m.args[0] for m in item.added] == [stretched]
    monkeypatch.setattr(conftest, "busy_machine_factor", lambda: 1.0)
    quiet = _Item(marker)
    next(conftest.pytest_runtest_protocol(quiet))  # type: ignore[arg-type]
    assert quiet.added == []
