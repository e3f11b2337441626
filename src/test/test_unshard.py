"""Unsharding DCP checkpoints into plain torch / safetensors files, one tensor at a time."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import preloaded_python
import pytest
import testutils
import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import load_file
from testutils import patient
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from olmolike.cli import main
from olmolike.distributed.checkpoint import save_model_and_optim_state, save_state_dict
from olmolike.distributed.unshard import UnshardStrategy, UnshardStrategyType, unshard_checkpoint
from olmolike.exceptions import CheckpointError, ConfigurationError, DistributedContextError
from olmolike.testing import TinyCausalLM
from olmolike.train import BasicTrainModule, Duration

CHUNK = 10_000  # bytes: between the tiny model's tensor sizes, so chunks hold 1 to 8 tensors
STRATEGIES = [
    UnshardStrategy.one_file(),
    UnshardStrategy.one_file_per_tensor(),
    UnshardStrategy.chunks(CHUNK),
]


@dataclass
class Trained:
    checkpoint: Path
    model: nn.Module
    optim: torch.optim.Optimizer


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    """A trained tiny model and its final checkpoint (saved at the end of ``fit``)."""
    save_folder = tmp_path_factory.mktemp("run")
    trainer = testutils.build_trainer(save_folder, max_duration=Duration.steps(2))
    trainer.fit()
    module = trainer.train_module
    assert isinstance(module, BasicTrainModule)
    return Trained(save_folder / "step2", module.model, module.optim)


def fresh_model(like: nn.Module) -> TinyCausalLM:
    """A new, untrained TinyCausalLM of the same shape as ``like``."""
    assert isinstance(like, TinyCausalLM)
    block = like.blocks[0]
    assert isinstance(block, nn.TransformerEncoderLayer)
    return TinyCausalLM(
        vocab_size=like.embed.num_embeddings,
        d_model=like.embed.embedding_dim,
        n_layers=len(like.blocks),
        n_heads=block.self_attn.num_heads,
        max_seq_len=like.pos.num_embeddings,
    )


def load_model_output(path: str) -> dict[str, torch.Tensor]:
    """Merge every file of an unsharded model: each holds a ``{fqn: tensor}`` dict."""
    root = Path(path)
    files = sorted(root.iterdir()) if root.is_dir() else [root]
    state: dict[str, torch.Tensor] = {}
    for file in files:
        if file.suffix == ".safetensors":
            state.update(load_file(file))
        elif file.suffix == ".pt":
            state.update(torch.load(file, weights_only=True))
    return state


def assert_same(actual: Any, expected: Any, where: str = "") -> None:
    """Equal nested state: same structure, tensors equal in dtype, shape and values."""
    if isinstance(expected, dict):  # in any order, and an OrderedDict equals a plain dict
        assert isinstance(actual, dict) and sorted(actual) == sorted(expected), where
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}.{key}")
        return
    assert type(actual) is type(expected), where
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and torch.equal(actual, expected), where
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, where


# -- the model weights -------------------------------------------------------------------------


@pytest.mark.parametrize("use_safetensors", [False, True], ids=["torch", "safetensors"])
@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: str(s.name))
def test_model_loads_strictly_into_a_plain_model_and_equals_the_trained_one(
    trained: Trained,
    tmp_path: Path,
    strategy: UnshardStrategy,
    use_safetensors: bool,
) -> None:
    checkpoint = trained.checkpoint
    model_path, optim_path = unshard_checkpoint(
        checkpoint,
        tmp_path,
        optim=False,
        use_safetensors=use_safetensors,
        unshard_strategy=strategy,
    )
    assert optim_path is None
    suffix = ".safetensors" if use_safetensors else ".pt"
    expected = trained.model.state_dict()
    if strategy.name == UnshardStrategyType.one_file:
        assert model_path == tmp_path / f"model{suffix}"
    else:
        assert model_path == tmp_path / "model"
    if strategy.name == UnshardStrategyType.one_file_per_tensor:
        # OLMo-core's names: the saved key with dashes for dots
        assert sorted(p.name for p in model_path.iterdir()) == sorted(
            f"model-{name.replace('.', '-')}{suffix}" for name in expected
        )
    if strategy.name != UnshardStrategyType.one_file:  # nothing but the model's files
        assert all(p.suffix == suffix for p in model_path.iterdir())
    model = fresh_model(trained.model)
    model.load_state_dict(load_model_output(model_path), strict=True)
    assert_same(model.state_dict(), expected)
    assert [p.name for p in tmp_path.iterdir()] == [model_path.name]  # no temporary left


def test_optim_none_unshards_it_too_for_one_torch_file_only(
    trained: Trained, tmp_path: Path
) -> None:
    model_path, optim_path = unshard_checkpoint(trained.checkpoint, tmp_path / "a", quiet=True)
    assert (model_path, optim_path) == (tmp_path / "a" / "model.pt", tmp_path / "a" / "optim.pt")
    assert_same(
        torch.load(optim_path, weights_only=True),
        get_optimizer_state_dict(trained.model, trained.optim),
    )
    for options in (
        {"use_safetensors": True},
        {"unshard_strategy": UnshardStrategy.one_file_per_tensor()},
        {"unshard_strategy": UnshardStrategy.chunks(CHUNK)},
    ):
        out = tmp_path / str(len(list(tmp_path.iterdir())))
        _, optim_path = unshard_checkpoint(trained.checkpoint, out, **options)  # type: ignore[arg-type]
        assert optim_path is None and not (out / "optim.pt").exists()
    # A checkpoint without optimizer state: the model alone, no error.
    save_model_and_optim_state(tmp_path / "weights", nn.Linear(2, 2))
    assert unshard_checkpoint(tmp_path / "weights", tmp_path / "w")[1] is None


def test_a_dcp_directory_works_like_the_train_checkpoint_holding_it(
    trained: Trained, tmp_path: Path
) -> None:
    checkpoint = trained.checkpoint
    from_dcp, _ = unshard_checkpoint(checkpoint / "model_and_optim", tmp_path / "a")
    from_train, _ = unshard_checkpoint(checkpoint, tmp_path / "b")
    assert_same(load_model_output(from_dcp), load_model_output(from_train))


def test_safetensors_header_is_what_hf_tools_expect(trained: Trained, tmp_path: Path) -> None:
    model_path, _ = unshard_checkpoint(trained.checkpoint, tmp_path, use_safetensors=True)
    raw = Path(model_path).read_bytes()
    header_size = int.from_bytes(raw[:8], "little")
    assert header_size % 8 == 0  # the data starts 8-byte aligned
    with safe_open(model_path, framework="pt") as f:
        assert f.metadata() == {"format": "pt"}  # transformers refuses files without it


def test_every_dtype_and_odd_shapes_round_trip(tmp_path: Path) -> None:
    weights = {
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "half.weight": torch.randn(7).to(torch.float16),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "ids": torch.arange(6, dtype=torch.int64).view(2, 3),
        "mask": torch.tensor([True, False, True]),
        "bytes": torch.arange(5, dtype=torch.uint8),
        "empty": torch.empty(0, 4),
    }
    save_state_dict(tmp_path / "dcp", {"model": weights})
    for use_safetensors in (False, True):
        for strategy in STRATEGIES:
            out = tmp_path / f"{strategy.name}-{use_safetensors}"
            model_path, _ = unshard_checkpoint(
                tmp_path / "dcp", out, use_safetensors=use_safetensors, unshard_strategy=strategy
            )
            assert_same(
                dict(sorted(load_model_output(model_path).items())), dict(sorted(weights.items()))
            )


def test_torch_files_also_load_memory_mapped(trained: Trained, tmp_path: Path) -> None:
    model_path, _ = unshard_checkpoint(trained.checkpoint, tmp_path)
    mapped = torch.load(model_path, weights_only=True, mmap=True)
    assert_same(mapped, trained.model.state_dict())


def test_chunks_respect_the_size_limit_and_hold_every_tensor_once(
    trained: Trained, tmp_path: Path
) -> None:
    model_path, _ = unshard_checkpoint(
        trained.checkpoint, tmp_path, use_safetensors=True, unshard_strategy=STRATEGIES[2]
    )
    expected = trained.model.state_dict()
    chunks = sorted(model_path.iterdir())
    assert [c.name for c in chunks] == [f"chunk-{i:05d}.safetensors" for i in range(len(chunks))]
    sizes = []
    seen: list[str] = []
    for chunk in chunks:
        tensors = load_file(chunk)
        seen += tensors
        size = sum(t.nbytes for t in tensors.values())
        assert size <= CHUNK or len(tensors) == 1, f"{chunk.name}: {size} bytes"
        sizes.append((len(tensors), size))
    # Both cases happened: several tensors sharing a chunk, and one too big sitting alone.
    assert any(n > 1 for n, _ in sizes) and any(size > CHUNK for _, size in sizes)
    assert sorted(seen) == sorted(expected)


def _train_sharded(save_folder: str) -> dict[str, Any] | None:
    """On each rank: train an FSDP2-sharded model, whose final checkpoint every rank writes a
    part of; rank 0 returns the gathered full model and optimizer state."""
    trainer = testutils.build_trainer(save_folder, fsdp=True, max_duration=Duration.steps(2))
    trainer.fit()
    module = trainer.train_module
    assert isinstance(module, BasicTrainModule)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = {
        "model": get_model_state_dict(module.model, options=options),
        "optim": get_optimizer_state_dict(module.model, module.optim, options=options),
    }
    return state if dist.get_rank() == 0 else None


@pytest.mark.slow
def test_a_checkpoint_sharded_by_fsdp_on_two_ranks_unshards_whole(tmp_path: Path) -> None:
    full = testutils.run_distributed_test(_train_sharded, 2, args=(str(tmp_path / "run"),))[0]
    checkpoint = tmp_path / "run" / "step2"
    shards = sorted(p.name for p in (checkpoint / "model_and_optim").glob("*.distcp"))
    assert shards == testutils.dcp_shards(ranks=2)  # both ranks wrote their part
    model_path, optim_path = unshard_checkpoint(
        checkpoint, tmp_path / "out", optim=True, use_safetensors=True
    )
    assert optim_path is not None
    assert_same(load_model_output(model_path), full["model"])
    assert_same(torch.load(optim_path, weights_only=True), full["optim"])


def _unshard_on_every_rank(checkpoint: str, out: str) -> str:
    with pytest.raises(RuntimeError) as raised:  # OLMo-core's type for the same mistake
        unshard_checkpoint(checkpoint, Path(out) / f"rank{dist.get_rank()}")
    assert isinstance(raised.value, DistributedContextError)
    return str(raised.value)


def test_a_process_of_a_distributed_run_is_refused_before_writing(
    trained: Trained, tmp_path: Path
) -> None:
    messages = testutils.run_distributed_test(
        _unshard_on_every_rank, 2, args=(str(trained.checkpoint), str(tmp_path))
    )
    assert "rank 1 of a distributed run of 2" in messages[1]
    assert "olmolike unshard" in messages[0]
    assert not list(tmp_path.iterdir())  # nothing written


# -- the optimizer state -----------------------------------------------------------------------


@pytest.mark.parametrize("use_safetensors", [False, True], ids=["torch", "safetensors"])
def test_optim_matches_the_optimizer_state_dict(
    trained: Trained, tmp_path: Path, use_safetensors: bool
) -> None:
    checkpoint = trained.checkpoint
    model_path, optim_path = unshard_checkpoint(
        checkpoint, tmp_path, optim=True, use_safetensors=use_safetensors
    )
    assert optim_path == tmp_path / "optim.pt"
    expected = get_optimizer_state_dict(trained.model, trained.optim)
    assert_same(torch.load(optim_path, weights_only=True), expected)
    assert model_path.exists()


def test_optim_of_a_checkpoint_without_one_is_an_error(tmp_path: Path) -> None:
    save_model_and_optim_state(tmp_path / "dcp", nn.Linear(2, 2))
    with pytest.raises(CheckpointError, match="holds no optim state"):
        unshard_checkpoint(tmp_path / "dcp", tmp_path / "out", optim=True)
    assert not (tmp_path / "out").exists()


# -- refusals ----------------------------------------------------------------------------------


def test_existing_outputs_are_kept_unless_overwrite(trained: Trained, tmp_path: Path) -> None:
    checkpoint = trained.checkpoint
    unshard_checkpoint(checkpoint, tmp_path, optim=True)
    (tmp_path / "model.pt").unlink()  # only optim.pt is left, and is enough to refuse
    with pytest.raises(FileExistsError, match=r"optim\.pt exists.*save_overwrite"):
        unshard_checkpoint(checkpoint, tmp_path, optim=True)
    assert not (tmp_path / "model.pt").exists()  # refused before writing anything
    (tmp_path / "optim.pt").write_bytes(b"stale")
    model_path, optim_path = unshard_checkpoint(
        checkpoint, tmp_path, optim=True, save_overwrite=True
    )
    assert optim_path is not None and torch.load(optim_path, weights_only=True)["state"]
    assert model_path.exists()


def test_overwriting_a_directory_output_leaves_no_stale_files(
    trained: Trained, tmp_path: Path
) -> None:
    per_tensor = STRATEGIES[1]
    model_path, _ = unshard_checkpoint(trained.checkpoint, tmp_path, unshard_strategy=per_tensor)
    (model_path / "stale.pt").write_bytes(b"")
    with pytest.raises(FileExistsError, match="model exists"):
        unshard_checkpoint(trained.checkpoint, tmp_path, unshard_strategy=per_tensor)
    unshard_checkpoint(
        trained.checkpoint, tmp_path, unshard_strategy=per_tensor, save_overwrite=True
    )
    assert not (model_path / "stale.pt").exists()


def test_a_folder_that_is_not_a_checkpoint_is_an_error(trained: Trained, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="is not a checkpoint"):
        unshard_checkpoint(tmp_path, tmp_path / "out")
    with pytest.raises(CheckpointError, match="is not a checkpoint"):
        unshard_checkpoint(trained.checkpoint.parent, tmp_path / "out")  # holds one, but is none
    with pytest.raises(CheckpointError, match="local paths only"):
        unshard_checkpoint(trained.checkpoint, "gs://bucket/out")
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_without_its_marker_is_incomplete(trained: Trained, tmp_path: Path) -> None:
    copy = shutil.copytree(trained.checkpoint, tmp_path / "step2")
    (copy / ".olmolike-checkpoint.json").unlink()
    with pytest.raises(CheckpointError, match="incomplete checkpoint"):
        unshard_checkpoint(copy, tmp_path / "out")


def test_safetensors_refuses_a_dtype_it_cannot_store_before_writing(tmp_path: Path) -> None:
    save_state_dict(tmp_path / "dcp", {"model": {"z": torch.zeros(2, dtype=torch.complex64)}})
    with pytest.raises(CheckpointError, match=r"cannot store z \(torch.complex64\)"):
        unshard_checkpoint(tmp_path / "dcp", tmp_path / "out", use_safetensors=True)
    assert not (tmp_path / "out").exists()
    model_path, _ = unshard_checkpoint(tmp_path / "dcp", tmp_path / "out")  # torch can
    assert_same(
        torch.load(model_path, weights_only=True), {"z": torch.zeros(2, dtype=torch.complex64)}
    )


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        ({"name": "chunks"}, "is required"),
        ({"name": "chunks", "chunk_size_bytes": 0}, "must be > 0"),
        ({"name": "one_file", "chunk_size_bytes": 100}, "only to the chunks strategy"),
    ],
)
def test_strategy_validation_names_the_field(data: dict[str, Any], reason: str) -> None:
    with pytest.raises(ConfigurationError, match=reason) as info:
        UnshardStrategy.from_dict(data, path="unshard")
    assert info.value.path == "unshard.chunk_size_bytes"


# -- the command line --------------------------------------------------------------------------


def test_cli_unshards_end_to_end(
    trained: Trained, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = trained.checkpoint
    args = ["unshard", str(checkpoint), str(tmp_path), "--safetensors", "--optim"]
    args += ["--strategy", "chunks", "--chunk-size", str(CHUNK)]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert re.search(r"(\d+)/\1 tensors", captured.err)  # the progress bar, at its end
    out = captured.out.split()
    assert out == [str(tmp_path / "model"), str(tmp_path / "optim.pt")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "optim.pt"]
    model = fresh_model(trained.model)
    model.load_state_dict(load_model_output(out[0]), strict=True)
    assert_same(model.state_dict(), trained.model.state_dict())

    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "exists" in err and "--overwrite" in err
    assert main([*args, "--overwrite"]) == 0


def test_cli_reports_errors_with_exit_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["unshard", str(tmp_path), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {tmp_path} is not a checkpoint")
    assert main(["unshard", str(tmp_path), str(tmp_path / "out"), "--chunk-size", "5"]) == 2
    assert "chunk_size_bytes: applies only to the chunks strategy" in capsys.readouterr().err


# -- memory ------------------------------------------------------------------------------------

# Runs in a process of its own (a preloaded command: forked from a server that imported torch
# and olmolike and ran no test), so that nothing the tests above allocated counts. It measures
# the peak RSS (VmHWM) one unshard adds. Not ``getrusage().ru_maxrss``: a child inherits its
# parent's peak through fork and exec, so in a child of pytest it starts at pytest's peak
# (hundreds of MiB) and can't see a 32 MiB model. The peak is reset through clear_refs after
# a warm-up unshard of a tiny checkpoint, whose first-use costs (lazy imports: FakeTensorMode
# alone adds ~28 MiB the first time) are no data. glibc's mmap threshold is fixed with
# mallopt (M_MMAP_THRESHOLD = -3), as MALLOC_MMAP_THRESHOLD_ fixes it in a process that glibc
# starts (a forked one keeps its server's allocator).
CHILD = """
import ctypes, json, sys
libc = ctypes.CDLL(None)
libc.mallopt(-3, 65536)
from olmolike.distributed.unshard import UnshardStrategy, unshard_checkpoint
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

def peak_rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

warm, big, out, options = sys.argv[1:]
options = json.loads(options)
if options is None:  # the control: DCP's own converter, which loads the whole model
    run = lambda source, target: dcp_to_torch_save(source, target + ".pt")
else:
    strategy = UnshardStrategy.from_dict(options.pop("strategy"))
    run = lambda source, target: unshard_checkpoint(
        source, target, unshard_strategy=strategy, quiet=True, **options
    )
run(warm, out + "-warm")
libc.malloc_trim(0)  # free heap pages (the server's among them) leave RSS: reuse shows
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS
before = peak_rss()
run(big, out)
print(peak_rss() - before)
"""
LAYERS, SIZE = 8, 1024  # 8 tensors of 4 MiB
MODEL_BYTES = LAYERS * SIZE * SIZE * 4


@pytest.fixture(scope="module")
def big_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("big")
    save_model_and_optim_state(root / "warm", nn.Linear(4, 4))
    torch.manual_seed(0)
    layers = [nn.Linear(SIZE, SIZE, bias=False) for _ in range(LAYERS)]
    save_model_and_optim_state(root / "big", nn.Sequential(*layers))
    return root / "warm", root / "big"


def peak_growth(checkpoints: tuple[Path, Path], out: Path, options: Any) -> int:
    """Bytes the peak RSS of a fresh process rose by while unsharding the big checkpoint.

    ``MALLOC_MMAP_THRESHOLD_`` fixes glibc's threshold for serving allocations with mmap, which
    it otherwise raises to the size of the last freed big block: then 4 MiB tensors come from the
    heap, which keeps freed blocks, and the measured peak varied from 8 to 23 MiB between runs
    of the same code. With it, freed tensors go back to the system at once, and the figure is
    what the code holds (it varied by 0.2 MiB).
    """
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    warm, big = checkpoints
    result = subprocess.run(
        [
            *preloaded_python.command(),
            "-c",
            CHILD,
            str(warm),
            str(big),
            str(out),
            json.dumps(options),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=patient(240),
    )
    assert result.returncode == 0, result.stderr
    growth = int(result.stdout.strip())
    print(
        f"{options}: peak RSS +{growth / 2**20:.1f} MiB for a {MODEL_BYTES / 2**20:.0f} MiB model"
    )
    return growth


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize(
    "options",
    [
        {"use_safetensors": True, "strategy": {"name": "one_file"}},
        {"use_safetensors": True, "strategy": {"name": "chunks", "chunk_size_bytes": 8 * 2**20}},
        {"use_safetensors": False, "strategy": {"name": "one_file"}},
    ],
    ids=["safetensors-one_file", "safetensors-chunks", "torch-one_file"],
)
def test_unsharding_streams_one_tensor_at_a_time(
    big_checkpoints: tuple[Path, Path], tmp_path: Path, options: dict[str, Any]
) -> None:
    # Streaming holds at most two copies of the largest tensor (DCP reads a stored tensor, then
    # copies it into the one we asked for): up to 8 MiB (measured 4.2-4.4 MiB, in a fresh
    # interpreter as under the preloaded stand-in). Holding the model would
    # add at least its 32 MiB (the control below measures that); half of it divides the two.
    growth = peak_growth(big_checkpoints, tmp_path / "out", options)
    assert growth < MODEL_BYTES // 2


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_the_memory_measurement_sees_a_whole_model(
    big_checkpoints: tuple[Path, Path], tmp_path: Path
) -> None:
    """The control: DCP's own converter loads the whole model, and the measurement shows it."""
    assert peak_growth(big_checkpoints, tmp_path / "out", None) >= MODEL_BYTES
