"""The one named device mesh: degrees that must multiply to the world size, and the mesh itself."""

from __future__ import annotations

import pytest
from testutils import run_distributed_test

from olmolike.distributed.mesh import (
    MESH_DIMS,
    ParallelDegrees,
    build_device_mesh,
    data_parallel_mesh,
)
from olmolike.exceptions import ConfigurationError


def test_dp_shard_takes_what_the_other_degrees_leave() -> None:
    degrees = ParallelDegrees.resolve(16, pp=2, tp=2)
    assert degrees.as_dict() == {"pp": 2, "dp_replicate": 1, "dp_shard": 4, "cp": 1, "tp": 2}
    assert degrees.dp == 4
    assert degrees.world_size == 16


def test_degrees_that_do_not_multiply_to_the_world_size_say_the_product() -> None:
    with pytest.raises(ConfigurationError) as err:
        ParallelDegrees.resolve(8, pp=1, dp_shard=3, tp=2)
    message = str(err.value)
    assert "dp_shard (3) x cp (1) x tp (2) = 6" in message
    assert "world size is 8" in message


def test_degrees_that_do_not_divide_the_world_size_are_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"tp \(3\) = 3 does not divide the world size"):
        ParallelDegrees.resolve(8, tp=3)


def test_a_degree_below_one_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="the tp degree must be >= 1, got 0"):
        ParallelDegrees.resolve(8, tp=0)


def _mesh_worker() -> tuple[tuple[str, ...], tuple[int, ...], int, int]:
    import torch.distributed as dist

    mesh = build_device_mesh(ParallelDegrees.resolve(dist.get_world_size(), tp=2), "cpu")
    data = data_parallel_mesh(mesh)
    return (
        tuple(mesh.mesh_dim_names or ()),
        tuple(mesh.shape),
        mesh["tp"].get_local_rank(),
        data.size(),
    )


@pytest.mark.slow
def test_the_mesh_has_every_dimension_with_tensor_parallelism_innermost() -> None:
    results = run_distributed_test(_mesh_worker)
    for rank, (names, shape, tp_rank, data_size) in enumerate(results):
        assert names == MESH_DIMS
        assert shape == (1, 1, 1, 1, 2)
        assert tp_rank == rank  # adjacent ranks share a tensor-parallel group
        assert data_size == 1
