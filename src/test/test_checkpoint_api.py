"""``olmolike.distributed.checkpoint``: OLMo-core's functions, signatures and meaning."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import fsspec
import pytest
import testutils
import torch
import torch.nn as nn
from remote_servers import RemoteStore
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

import olmolike.distributed.checkpoint as api
from olmolike.distributed.checkpoint import (
    UnshardStrategy,
    async_save_model_and_optim_state,
    get_checkpoint_metadata,
    load_keys,
    load_model_and_optim_state,
    merge_state_dicts,
    prune_state_dict,
    save_model_and_optim_state,
    swap_param_keys,
    unshard_checkpoint,
)
from olmolike.distributed.checkpoint_format import MARKER, MODEL_AND_OPTIM
from olmolike.exceptions import CheckpointError

OLMO_CORE_NAMES = {
    "save_state_dict",
    "async_save_state_dict",
    "load_state_dict",
    "save_model_and_optim_state",
    "async_save_model_and_optim_state",
    "load_model_and_optim_state",
    "unshard_checkpoint",
    "load_keys",
    "get_checkpoint_metadata",
    "UnshardStrategy",
    "UnshardStrategyType",
    "swap_param_keys",
    "prune_state_dict",
    "merge_state_dicts",
}


class FF(nn.Module):
    def __init__(self, names: tuple[str, ...] = ("w1", "w2", "w3"), dim: int = 8) -> None:
        super().__init__()
        for name in names:
            setattr(self, name, nn.Linear(dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.children():
            x = layer(x)
        return x


def stepped(
    names: tuple[str, ...] = ("w1", "w2", "w3"), seed: int = 0
) -> tuple[FF, torch.optim.Optimizer]:
    """A model and an AdamW optimizer after one step (so it has state)."""
    torch.manual_seed(seed)
    model = FF(names)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 8)).sum().backward()
    optim.step()
    return model, optim


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    assert a.state_dict().keys() == b.state_dict().keys()
    for key, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[key]), key


def test_every_olmo_core_name_is_exported() -> None:
    assert set(api.__all__) >= OLMO_CORE_NAMES
    assert all(hasattr(api, name) for name in api.__all__)


def test_save_refuses_a_non_empty_folder_unless_overwrite(tmp_path: Path) -> None:
    model, optim = stepped()
    save_model_and_optim_state(tmp_path / "c", model, optim)
    with pytest.raises(FileExistsError, match="save_overwrite=True"):
        save_model_and_optim_state(tmp_path / "c", model, optim)
    (tmp_path / "c" / "stale.txt").write_text("from an older save")
    other, other_optim = stepped(seed=1)
    save_model_and_optim_state(tmp_path / "c", other, other_optim, save_overwrite=True)
    assert not (tmp_path / "c" / "stale.txt").exists()
    fresh, fresh_optim = stepped(seed=2)
    load_model_and_optim_state(tmp_path / "c", fresh, fresh_optim)
    assert_same_state(fresh, other)


@pytest.mark.parametrize("run_async", [False, True], ids=["sync", "async"])
def test_saving_to_a_url_uploads_and_refuses_a_non_empty_prefix(
    tmp_path: Path, run_async: bool
) -> None:
    url = f"memory://saves-{run_async}/c"
    model, optim = stepped()
    if run_async:
        async_save_model_and_optim_state(url, model, optim, throttle_uploads=True).result()
    else:
        save_model_and_optim_state(url, model, optim, throttle_uploads=True)
    fs = fsspec.filesystem("memory")
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.find(f"/saves-{run_async}/c")) == [
        ".metadata",
        *testutils.dcp_shards(),
    ]
    fresh, fresh_optim = stepped(seed=1)
    load_model_and_optim_state(url, fresh, fresh_optim)
    assert_same_state(fresh, model)
    with pytest.raises(FileExistsError, match="save_overwrite=True"):
        save_model_and_optim_state(url, fresh, fresh_optim)
    save_model_and_optim_state(url, fresh, save_overwrite=True)  # the model alone now
    assert "optim" not in {
        k.split(".")[0] for k in get_checkpoint_metadata(url).state_dict_metadata
    }


def _save_to_store(url: str, settings: dict[str, Any], throttle: bool) -> None:
    fsspec.config.conf.update(settings)
    model, optim = stepped(seed=0)
    save_model_and_optim_state(url, model, optim, throttle_uploads=throttle)


@pytest.mark.parametrize("throttle", [False, True], ids=["together", "throttled"])
def test_two_ranks_save_to_an_object_store(request: pytest.FixtureRequest, throttle: bool) -> None:
    store: RemoteStore = request.getfixturevalue("gcs_bucket")
    url = store.url("c")
    settings = {key: dict(value) for key, value in fsspec.config.conf.items()}
    testutils.run_distributed_test(_save_to_store, 2, args=(url, settings, throttle), timeout=120)
    assert store.objects("c") == [".metadata", *testutils.dcp_shards(ranks=2)]
    model, _ = stepped(seed=0)
    fresh, fresh_optim = stepped(seed=1)
    load_model_and_optim_state(url, fresh, fresh_optim)
    assert_same_state(fresh, model)


def _save_and_load_sharded(dir: str, run_async: bool) -> dict[str, Any]:
    """On each of 2 ranks: FSDP2-shard a model, save it, refuse a second save, load it into
    another sharded model; return the full state of the saved one."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,))

    def sharded(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = fully_shard(FF(), mesh=mesh)
        optim = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(torch.randn(2, 8)).sum().backward()
        optim.step()
        return model, optim

    model, optim = sharded(0)
    if run_async:
        async_save_model_and_optim_state(dir, model, optim).result()
    else:
        save_model_and_optim_state(dir, model, optim)
    with pytest.raises(FileExistsError):  # on every rank, after agreeing
        save_model_and_optim_state(dir, model, optim)
    other, other_optim = sharded(1)
    load_model_and_optim_state(dir, other, other_optim)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    saved, loaded = (get_model_state_dict(m, options=full) for m in (model, other))
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    return {
        "model": saved,
        "optim": get_optimizer_state_dict(model, optim, options=full),
    }


@pytest.mark.parametrize("run_async", [False, True], ids=["sync", "async"])
def test_two_ranks_save_sharded_and_one_process_loads_whole(
    tmp_path: Path, run_async: bool
) -> None:
    results = testutils.run_distributed_test(
        _save_and_load_sharded, 2, args=(str(tmp_path / "c"), run_async), timeout=120
    )
    plain, plain_optim = stepped(seed=5)
    load_model_and_optim_state(tmp_path / "c", plain, plain_optim)
    saved = results[0]
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in saved["model"].items())
    state = get_optimizer_state_dict(plain, plain_optim)["state"]
    for fqn, values in saved["optim"]["state"].items():
        assert torch.equal(state[fqn]["exp_avg"], values["exp_avg"]), fqn


@pytest.mark.parametrize("flatten", [False, True], ids=["nested-optim", "flat-optim"])
def test_key_mapping_loads_a_renamed_parameter_and_its_optimizer_state(
    tmp_path: Path, flatten: bool
) -> None:
    old, old_optim = stepped(("w1", "w2", "w3"))
    save_model_and_optim_state(tmp_path / "c", old, old_optim, flatten_optimizer_state=flatten)
    new, new_optim = stepped(("w1", "fc_out", "w3"), seed=1)
    load_model_and_optim_state(
        tmp_path / "c",
        new,
        new_optim,
        key_mapping={"fc_out.weight": "w2.weight", "fc_out.bias": "w2.bias"},
        flatten_optimizer_state=flatten,
    )
    assert torch.equal(new.fc_out.weight, old.w2.weight)
    assert torch.equal(new.w1.weight, old.w1.weight)
    assert torch.equal(
        new_optim.state[new.fc_out.weight]["exp_avg"], old_optim.state[old.w2.weight]["exp_avg"]
    )


def test_strict_false_keeps_what_the_checkpoint_lacks(tmp_path: Path) -> None:
    old, _ = stepped(("w1", "w2"))
    save_model_and_optim_state(tmp_path / "c", old)
    bigger, _ = stepped(("w1", "w2", "w4"), seed=1)
    with pytest.raises(BaseException, match=r"model\.w4\.weight"):  # DCP's own error
        load_model_and_optim_state(tmp_path / "c", bigger)
    w4 = bigger.w4.weight.detach().clone()
    load_model_and_optim_state(tmp_path / "c", bigger, strict=False)
    assert torch.equal(bigger.w1.weight, old.w1.weight)
    assert torch.equal(bigger.w4.weight, w4)


def train_folder(tmp_path: Path, *, complete: bool = True) -> tuple[Path, FF, Any]:
    """A ``step1`` folder laid out as the trainer writes one (its DCP part and marker)."""
    model, optim = stepped()
    folder = tmp_path / "step1"
    save_model_and_optim_state(folder / MODEL_AND_OPTIM, model, optim)
    if complete:
        (folder / MARKER).write_text('{"format_version": 1, "world_size": 1, "ephemeral": false}')
    return folder, model, optim


def test_checkpoint_metadata_of_a_dcp_folder_and_of_a_train_checkpoint(tmp_path: Path) -> None:
    folder, _, _ = train_folder(tmp_path)
    for dir in (folder, folder / MODEL_AND_OPTIM):
        metadata = get_checkpoint_metadata(dir)
        assert tuple(metadata.state_dict_metadata["model.w1.weight"].size) == (8, 8)
        assert "optim.state.w1.weight.exp_avg" in metadata.state_dict_metadata
    (folder / MARKER).unlink()
    with pytest.raises(CheckpointError, match="incomplete checkpoint"):
        get_checkpoint_metadata(folder)
    with pytest.raises(CheckpointError, match="is not a checkpoint"):
        get_checkpoint_metadata(tmp_path)


def test_load_keys_returns_values_and_whole_subtrees_in_order(tmp_path: Path) -> None:
    folder, model, optim = train_folder(tmp_path)
    bias, weight, whole, adam, groups = load_keys(
        folder,
        [
            "model.w2.bias",
            "model.w1.weight",
            "model",
            "optim.state.w3.weight",
            "optim.param_groups",
        ],
    )
    assert torch.equal(bias, model.w2.bias) and torch.equal(weight, model.w1.weight)
    assert whole.keys() == model.state_dict().keys()
    assert all(torch.equal(whole[k], v) for k, v in model.state_dict().items())
    assert torch.equal(adam["exp_avg"], optim.state[model.w3.weight]["exp_avg"])
    assert isinstance(groups, list) and groups[0]["lr"] == 0.1
    with pytest.raises(KeyError, match=r"model\.w1\.wei"):
        list(load_keys(folder, ["model.w1.wei"]))  # a part of a name is no key


def remote_copy(local: Path, name: str) -> str:
    """``local`` uploaded to fsspec's in-memory store, as a remote checkpoint stands in one."""
    fs = fsspec.filesystem("memory")
    fs.put(str(local), f"/{name}", recursive=True)
    return f"memory://{name}"


@pytest.mark.parametrize("pre_download", [False, True], ids=["in-place", "pre-download"])
def test_remote_checkpoints_load_unshard_and_give_keys(tmp_path: Path, pre_download: bool) -> None:
    folder, model, _ = train_folder(tmp_path)
    url = remote_copy(folder, f"run-{pre_download}/step1")
    work = tmp_path / "work"
    options: dict[str, Any] = {"pre_download": pre_download, "work_dir": work}
    (weight,) = load_keys(url, ["model.w1.weight"], **options)
    assert torch.equal(weight, model.w1.weight)
    fresh, fresh_optim = stepped(seed=3)
    load_model_and_optim_state(url, fresh, fresh_optim, **options)
    assert_same_state(fresh, model)
    model_path, optim_path = unshard_checkpoint(url, tmp_path / "out", quiet=True, **options)
    assert optim_path is not None
    assert torch.load(model_path, weights_only=True).keys() == model.state_dict().keys()
    assert not any(work.rglob("*.distcp"))  # downloads are removed afterwards


def test_unshard_strategy_constructors_use_olmo_core_fields() -> None:
    assert UnshardStrategy.one_file_per_tensor().name == "one_file_per_tensor"
    chunks = UnshardStrategy.chunks(1000)
    assert (chunks.name, chunks.chunk_size_bytes) == ("chunks", 1000)
    with pytest.raises(ValueError, match="chunk_size_bytes"):
        UnshardStrategy(name="chunks")  # type: ignore[arg-type]


# -- editing state dicts by dotted keys ----------------------------------------------------------


def test_prune_keeps_only_allowed_dotted_keys_at_any_depth() -> None:
    state = {
        "model": {"a.weight": 1, "b": 2},
        "optim": {"state": {"a.weight": {"exp_avg": 3, "step": 4}}},
    }
    pruned = prune_state_dict(state, {"model.a.weight", "optim.state.a.weight.step"})
    assert pruned == {"model.b", "optim.state.a.weight.exp_avg"}
    assert state == {"model": {"a.weight": 1}, "optim": {"state": {"a.weight": {"step": 4}}}}


def test_merge_adds_what_is_missing_and_keeps_what_is_there() -> None:
    state: dict[str, Any] = {"model": {"a": 1, "b": 2}}
    merge_state_dicts(state, {"model": {"a": 10, "e": 3}, "optim": {"state": {}}})
    assert state == {"model": {"a": 1, "b": 2, "e": 3}, "optim": {"state": {}}}


def test_swap_param_keys_renames_model_and_nested_or_flat_optimizer_state() -> None:
    nested = {
        "model": {"fc.weight": "W", "x": "X"},
        "optim": {
            "state": {"fc.weight": {"exp_avg": "E"}},
            "param_groups": [{"params": ["x", "fc.weight"], "lr": 1}],
        },
    }
    swap_param_keys(nested, {"fc.weight": "w2.weight"})
    assert nested["model"] == {"w2.weight": "W", "x": "X"}
    assert nested["optim"]["state"] == {"w2.weight": {"exp_avg": "E"}}
    assert nested["optim"]["param_groups"][0]["params"] == ["x", "w2.weight"]
    swap_param_keys(nested, {"fc.weight": "w2.weight"}, reverse=True)
    assert nested["model"] == {"fc.weight": "W", "x": "X"}

    flat: dict[str, Any] = {
        "model": {"fc.weight": "W"},
        "optim": {"state.fc.weight.exp_avg": "E", "param_groups.fc.weight.lr": 1},
    }
    swap_param_keys(flat, {"fc.weight": "w2.weight"})
    assert flat["optim"] == {"state.w2.weight.exp_avg": "E", "param_groups.w2.weight.lr": 1}


def test_swap_param_keys_skips_names_the_checkpoint_lacks(tmp_path: Path) -> None:
    save_model_and_optim_state(tmp_path / "c", FF(("w1",)))
    state: dict[str, Any] = {"model": {"fc.weight": "W"}}
    metadata = get_checkpoint_metadata(tmp_path / "c")
    swap_param_keys(state, {"fc.weight": "w9.weight"}, metadata=metadata)
    assert state == {"model": {"fc.weight": "W"}}
    swap_param_keys(state, {"fc.weight": "w1.weight"}, metadata=metadata)
    assert state == {"model": {"w1.weight": "W"}}
