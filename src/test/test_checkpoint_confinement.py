"""A checkpoint is read only from its own files, and what it says is bounded by them.

Shard names in ``.metadata`` are plain file names inside the checkpoint, for every reader
(training's load, ``load_model_and_optim_state`` under ``generate`` and ``export-hf``,
``load_keys``, unshard, reading the metadata); a symbolic link in a checkpoint is not
followed; the list indices, chunk sizes and record sizes it gives are checked against what
it holds before anything is allocated. Each case is one clear ``CheckpointError``. Every
crafted checkpoint here would load under DCP's own reader: the file it names is there.
"""

from __future__ import annotations

import json
import logging
import pickle
import shutil
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch
from test_checkpoint_unpickle import complete, readers, remote_copy, saved, trained

from olmolike.cli import main as cli_main
from olmolike.distributed.checkpoint import (
    load_keys,
    model_and_optim_state_dict,
    save_state_dict,
    unshard_checkpoint,
)
from olmolike.distributed.checkpoint_download import local_copy
from olmolike.distributed.checkpoint_format import (
    DCP_METADATA,
    MODEL_AND_OPTIM,
    TRAIN_STATE,
    load_train_state,
    verify_checkpoint,
)
from olmolike.distributed.checkpoint_reader import nest
from olmolike.exceptions import CheckpointError, DamagedCheckpointError
from olmolike.nn import TransformerConfig


def rewrite_metadata(dcp_dir: Path, change: Any) -> None:
    """Apply ``change`` to the (test's own) metadata of ``dcp_dir`` and write it back."""
    metadata = pickle.loads((dcp_dir / DCP_METADATA).read_bytes())
    change(metadata)
    (dcp_dir / DCP_METADATA).write_bytes(pickle.dumps(metadata))


def outside(folder: Path, how: str) -> None:
    """Make the checkpoint ``folder`` read its shards from outside itself, ``how``: by a
    ``../`` name, by an absolute name, or through a symbolic link. The shards are there,
    whole: DCP's own reader would read them."""
    dcp_dir = folder / MODEL_AND_OPTIM
    moved = {}
    for shard in sorted(dcp_dir.glob("*.distcp")):
        elsewhere = folder.parent / f"elsewhere-{folder.name}-{shard.name}"
        shutil.copy(shard, elsewhere)
        if how == "symbolic link":
            shard.unlink()
            shard.symlink_to(elsewhere)
        moved[shard.name] = f"../../{elsewhere.name}" if how == "../ name" else str(elsewhere)

    def renamed(metadata: Any) -> None:
        for info in metadata.storage_data.values():
            info.relative_path = moved[info.relative_path]

    if how != "symbolic link":
        rewrite_metadata(dcp_dir, renamed)


REFUSALS = {
    "../ name": r"names a shard file '\.\./\.\./elsewhere.*not a plain file name inside",
    # (a long name is cut short in the line: the tmp path's length decides where)
    "absolute name": r"names a shard file '/.*not a plain file name inside",
    "symbolic link": r"symbolic link",
}


@pytest.mark.parametrize("how", REFUSALS)
def test_every_reader_refuses_a_shard_outside_the_checkpoint(tmp_path: Path, how: str) -> None:
    folder = saved(tmp_path / "step1")
    outside(folder, how)
    for name, attempt in readers(str(folder), tmp_path / "out").items():
        if how == "symbolic link" and name in ("get_checkpoint_metadata", "read_metadata"):
            continue  # (the metadata alone names no link)
        with pytest.raises(CheckpointError, match=REFUSALS[how]):
            attempt()


@pytest.mark.parametrize("how", ["../ name", "absolute name"])
def test_a_remote_checkpoint_refuses_a_name_outside_it(tmp_path: Path, how: str) -> None:
    folder = saved(tmp_path / "step1")
    outside(folder, how)
    source = remote_copy(folder, f"names-{how[:3]}/step1")
    for pre_download in (False, True):
        options = {"pre_download": pre_download, "work_dir": tmp_path / "w"}
        for attempt in readers(source, tmp_path / "out", **options).values():
            with pytest.raises(CheckpointError, match=REFUSALS[how]):
                attempt()


def test_a_symbolic_link_in_place_of_a_trainer_state_is_refused(tmp_path: Path) -> None:
    folder = saved(tmp_path / "step1")
    state = folder / TRAIN_STATE / "rank0.pt"
    shutil.move(state, tmp_path / "elsewhere.pt")
    state.symlink_to(tmp_path / "elsewhere.pt")
    with pytest.raises(CheckpointError, match="symbolic link"):
        load_train_state(str(folder), 0)


def test_a_symbolic_link_is_found_before_anything_is_read(tmp_path: Path) -> None:
    folder = saved(tmp_path / "step1")
    outside(folder, "symbolic link")
    with pytest.raises(CheckpointError, match=r"__0_\d\.distcp is a symbolic link"):
        verify_checkpoint(str(folder))


@pytest.fixture(scope="module")
def exportable(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint ``generate`` and ``export-hf`` read: a model and its config."""
    folder = tmp_path_factory.mktemp("exportable") / "step1"
    model_config = TransformerConfig(vocab_size=384, d_model=16, n_layers=1, n_heads=2)
    save_state_dict(
        folder / MODEL_AND_OPTIM, model_and_optim_state_dict(model_config.build(seed=0))
    )
    complete(folder)
    from olmolike.data.tokenizer import TokenizerConfig

    config = {
        "model": model_config.as_config_dict(),
        "tokenizer": TokenizerConfig().as_config_dict(),
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("how", REFUSALS)
def test_generate_and_export_refuse_a_shard_outside_the_checkpoint(
    exportable: Path, tmp_path: Path, how: str, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "step1"
    shutil.copytree(exportable, folder)
    generate = ["generate", str(folder), "--prompt", "a", "--max-new-tokens", "1"]
    assert cli_main(generate) == 0  # (it reads, as it is)
    capsys.readouterr()
    outside(folder, how)
    for command in (generate, ["export-hf", str(folder), str(tmp_path / "hf")]):
        assert cli_main(command) != 0, command
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err  # one line, no traceback
        assert "symbolic link" in err or "not a plain file name inside" in err, err


def test_a_resume_never_reads_a_shard_outside_the_checkpoint(tmp_path: Path) -> None:
    trained(tmp_path / "run")
    for step in sorted((tmp_path / "run").glob("step*")):
        outside(step, "../ name")
    with pytest.raises(CheckpointError, match="not a plain file name inside"):
        trained(tmp_path / "run", steps=2)


# -- what the metadata says is bounded by what the checkpoint holds ------------------------------


def test_a_list_index_beyond_the_values_is_refused_before_a_list_grows(tmp_path: Path) -> None:
    """``load_keys`` and unshard rebuild lists from the metadata's paths: an index of 10**9
    would make a list of a billion entries."""
    folder = tmp_path / "step1"
    state = {"model": {"w": torch.zeros(2)}, "optim": {"param_groups": [{"lr": 0.1}]}}
    save_state_dict(folder / MODEL_AND_OPTIM, state)

    def far(metadata: Any) -> None:
        metadata.planner_data["optim.param_groups.0.lr"] = ("optim", "param_groups", 10**9, "lr")

    rewrite_metadata(folder / MODEL_AND_OPTIM, far)
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match="not a place in its state"):
            list(load_keys(folder / MODEL_AND_OPTIM, ["optim"]))
        with pytest.raises(CheckpointError, match="not a place in its state"):
            unshard_checkpoint(folder / MODEL_AND_OPTIM, tmp_path / "out", optim=True, quiet=True)
        assert tracemalloc.get_traced_memory()[1] < 64 << 20
    finally:
        tracemalloc.stop()


def test_lists_grow_no_further_than_the_values_they_hold() -> None:
    """Many lists, each with an index below the number of values, made a quadratic amount
    (a 400 KB metadata and 3 MB of shards: 70 MB; 10 times that: 7 GB)."""
    count = 2000
    with pytest.raises(CheckpointError, match="not a place in its state of 2000 values"):
        nest(((f"k{i}", count - 1), None) for i in range(count))
    # Holes where DCP dropped an empty dict are allowed: [{}, {}, {"x": 1}] saves only x.
    assert nest([(("a", 2, "x"), 1), (("b", 1), 2)]) == {
        "a": [None, None, {"x": 1}],
        "b": [None, 2],
    }


def test_two_values_at_one_place_are_refused(tmp_path: Path) -> None:
    """unshard wrote both tensors' bytes at the one storage of their place, the larger over
    the records after it (a broken file, no error); load_keys kept one of them."""
    folder = saved(tmp_path / "step1")

    def same(metadata: Any) -> None:
        metadata.planner_data["model.w1.bias"] = ("model", "w1.weight")

    rewrite_metadata(folder / MODEL_AND_OPTIM, same)
    for attempt in (
        lambda: unshard_checkpoint(folder, tmp_path / "out", quiet=True),
        lambda: list(load_keys(folder, ["model"])),
    ):
        with pytest.raises(CheckpointError, match=r"places two values at \[.*'w1\.weight'\]"):
            attempt()


def test_a_path_deeper_than_a_state_is_refused_by_every_reader(tmp_path: Path) -> None:
    """A value 5,000 keys deep nests fine, then exhausts the stack of the pickler that writes
    it (unshard): refused when the checkpoint is opened, one CheckpointError."""
    folder = tmp_path / "c"
    save_state_dict(folder, {"model": {"w": torch.zeros(2)}, "optim": {"x": torch.ones(2)}})

    def deep(metadata: Any) -> None:
        metadata.planner_data["optim.x"] = ("optim", *["a"] * 5000)

    rewrite_metadata(folder, deep)
    for attempt in (
        lambda: unshard_checkpoint(folder, tmp_path / "out", optim=True, quiet=True),
        lambda: list(load_keys(folder, ["optim"])),
    ):
        with pytest.raises(CheckpointError, match="no place in a nested state"):
            attempt()
    with pytest.raises(CheckpointError, match="not a place in its state"):
        nest([(("a",) * 65, 1)])


def _tensor_metadata(metadata: Any) -> Any:
    return metadata.state_dict_metadata["model.w1.weight"]


SIZES = {
    # A tensor a million times larger than its chunks: unshard would allocate it.
    "a size beyond its chunks": (
        lambda m: setattr(_tensor_metadata(m), "size", torch.Size([4000, 4000])),
        "do not tile its size",
    ),
    "a chunk beyond its tensor": (
        lambda m: setattr(_tensor_metadata(m).chunks[0], "sizes", torch.Size([4, 400])),
        "lies outside its size",
    ),
    "a chunk beyond its record": (
        lambda m: [
            setattr(_tensor_metadata(m), "size", torch.Size([4, 40000])),
            setattr(_tensor_metadata(m).chunks[0], "sizes", torch.Size([4, 40000])),
        ],
        "larger than its record",
    ),
    "records that overlap": (
        lambda m: [setattr(i, "offset", 0) for i in m.storage_data.values()],
        "overlap",
    ),
}


@pytest.mark.parametrize("case", SIZES)
def test_sizes_beyond_what_the_checkpoint_holds_are_refused(tmp_path: Path, case: str) -> None:
    folder = saved(tmp_path / "step1")
    change, refusal = SIZES[case]
    rewrite_metadata(folder / MODEL_AND_OPTIM, change)
    for attempt in readers(str(folder), tmp_path / "out").values():
        with pytest.raises(CheckpointError, match=refusal):
            attempt()


@pytest.mark.parametrize("dtype", [torch.qint8, torch.uint4, torch.bits8])
def test_a_tensor_of_a_dtype_no_reader_makes_is_refused(
    tmp_path: Path, dtype: torch.dtype, caplog: pytest.LogCaptureFixture
) -> None:
    """Quantized, sub-byte and bit-packed dtypes: torch.zeros or torch.save of one raised
    torch's own error (NotImplementedError, KeyError) from load_keys and unshard."""
    folder = saved(tmp_path / "step1")
    rewrite_metadata(
        folder / MODEL_AND_OPTIM,
        lambda m: setattr(_tensor_metadata(m).properties, "dtype", dtype),
    )
    for name, attempt in readers(str(folder), tmp_path / "out").items():
        with pytest.raises(CheckpointError, match=f"a tensor of {dtype}, which a checkpoint"):
            attempt()
        assert not [r for r in caplog.records if r.exc_info], name  # (no logged traceback)


def test_records_beyond_the_end_of_their_shard_are_refused_before_a_tensor_is_made(
    tmp_path: Path,
) -> None:
    folder = saved(tmp_path / "step1")
    shard = folder / MODEL_AND_OPTIM / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    for reader in (
        lambda: list(load_keys(folder, ["model.w1.weight"])),
        lambda: unshard_checkpoint(folder, tmp_path / "out", quiet=True),
        lambda: verify_checkpoint(str(folder)),
    ):
        with pytest.raises(CheckpointError, match="is truncated"):
            reader()


def test_a_missing_shard_is_damage_for_every_reader(tmp_path: Path) -> None:
    """load_state_dict and load_model_and_optim_state gave DCP's CheckpointException, with
    a traceback of the FileNotFoundError, not one line."""
    folder = saved(tmp_path / "step1")
    (folder / MODEL_AND_OPTIM / "__0_0.distcp").unlink()
    for name, attempt in readers(str(folder), tmp_path / "out").items():
        if name in ("get_checkpoint_metadata", "read_metadata"):
            continue  # (the metadata alone reads no shard)
        with pytest.raises(DamagedCheckpointError, match=r"__0_0\.distcp.* is missing") as error:
            attempt()
        assert "\n" not in str(error.value), name


def test_a_remote_file_named_outside_the_checkpoint_is_not_downloaded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``pre_download`` copies a remote folder by its listing: a key with ``../`` in it would
    land outside the copy (fsspec refuses it, with a ValueError: one CheckpointError here)."""
    import fsspec

    folder = saved(tmp_path / "step1")
    source = remote_copy(folder, "escape/step1")
    fsspec.filesystem("memory").pipe(f"/escape/step1/{MODEL_AND_OPTIM}/../../../../x", b"x")
    work = tmp_path / "work"
    for attempt in (
        lambda: list(load_keys(source, ["model.w1.weight"], pre_download=True, work_dir=work)),
        lambda: unshard_checkpoint(
            source, tmp_path / "out", quiet=True, pre_download=True, work_dir=work
        ),
    ):
        with pytest.raises(CheckpointError, match=r"refusing to download .* outside the copy"):
            attempt()
    assert not (tmp_path / "x").exists() and not list(work.rglob("x"))
    # A resume's download (every rank agrees on it) logs why in one line, no traceback.
    with (
        caplog.at_level(logging.ERROR),
        pytest.raises(CheckpointError, match="downloading"),
        local_copy(source, work),
    ):
        pass
    (record,) = [r for r in caplog.records if "refusing to download" in r.getMessage()]
    assert record.exc_info is None
