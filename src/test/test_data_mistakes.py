"""A newcomer's data mistakes are caught when the run is built or the data prepared, as one
clear error: token ids beyond the model's vocabulary or the experiment's tokenizer, an empty
training split, empty inputs; binary files are not tokenized as text."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import preloaded_python
import pytest
import torch
from testutils import patient

from olmolike.data import NumpyDataLoaderConfig, NumpyDatasetConfig, prepare_data
from olmolike.data.numpy_dataset import METADATA_FILE
from olmolike.data.prepare import _text_sources
from olmolike.data.sources import resolve_inputs, stdlib_python_files
from olmolike.exceptions import DataError
from olmolike.experiment import ExperimentConfig, train
from olmolike.nn import TransformerConfig
from olmolike.testing import TinyCausalLM
from olmolike.train import Duration, TrainerConfig
from olmolike.train.train_module import BasicTrainModule, TransformerTrainModuleConfig

SEQ = 16
EOS = 256  # the byte tokenizer's; the largest id prepare-data writes for byte text


def prepared(tmp_path: Path) -> Path:
    (tmp_path / "doc.txt").write_text("some text to train on, " * 40)
    prepare_data([tmp_path / "doc.txt"], tmp_path / "data")
    return tmp_path / "data"


def trainer_over(paths: list[str], tmp_path: Path, vocab: int) -> TrainerConfig:
    dataset = NumpyDatasetConfig(paths=paths, sequence_length=SEQ).build()
    loader = NumpyDataLoaderConfig(global_batch_size=4 * SEQ, seed=0).build(
        dataset, dp_rank=0, dp_world_size=1
    )
    model = TinyCausalLM(vocab_size=vocab, d_model=16, n_layers=1, n_heads=2, max_seq_len=SEQ)
    module = BasicTrainModule(model, torch.optim.AdamW(model.parameters()), 4 * SEQ)
    config = TrainerConfig(save_folder=str(tmp_path / "run"), max_duration=Duration.steps(2))
    return config.build(module, loader)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*preloaded_python.command(), "-m", "olmolike", *args],
        capture_output=True,
        text=True,
        timeout=patient(120),
    )


def test_prepare_data_records_the_largest_token_id(tmp_path: Path) -> None:
    metadata = json.loads((prepared(tmp_path) / METADATA_FILE).read_text())
    assert metadata["max_token_id"] == EOS
    assert [s["max_token_id"] for s in metadata["splits"]["train"]] == [EOS]


def test_data_beyond_the_models_vocabulary_is_refused_when_the_run_is_built(
    tmp_path: Path,
) -> None:
    data = prepared(tmp_path)
    with pytest.raises(
        DataError,
        match=rf"token id {EOS} \(max_token_id .*\), not below the model's vocabulary size=200",
    ):
        trainer_over([str(data / "train")], tmp_path, vocab=200)


def test_metadata_that_understates_the_vocabulary_is_refused_when_the_dataset_is_built(
    tmp_path: Path,
) -> None:
    data = prepared(tmp_path)
    metadata = json.loads((data / METADATA_FILE).read_text())
    (data / METADATA_FILE).write_text(json.dumps({**metadata, "vocab_size": 100}))
    with pytest.raises(DataError, match=rf"token id {EOS} .*not below vocab_size=100"):
        NumpyDatasetConfig(paths=[str(data / "train")], sequence_length=SEQ).build()


def test_an_id_beyond_the_vocabulary_in_a_file_without_metadata_fails_before_the_forward_pass(
    tmp_path: Path,
) -> None:
    tokens = np.arange(64 * SEQ, dtype=np.uint16) % 200
    tokens[3::SEQ] = 300  # in every instance, so in the first batch
    np.save(tmp_path / "tokens.npy", tokens)
    trainer = trainer_over([str(tmp_path / "tokens.npy")], tmp_path, vocab=256)
    with pytest.raises(DataError) as failure:
        trainer.fit()
    message = str(failure.value)
    assert "tokens.npy holds token id 300" in message
    assert "not below the model's vocabulary size=256" in message


@pytest.mark.parametrize(
    ("text", "flags", "says"),
    [
        (
            "one document",
            ["--val-fraction", "0.999"],
            "error: the training split is empty: val_fraction 0.999 (--val-fraction) held out "
            "all 1 document(s); give more documents or a smaller val_fraction",
        ),
        ("", [], "error: no tokens to write: the 1 input file(s) hold no text"),
    ],
)
def test_nothing_to_train_on_is_an_error_at_prepare_time_that_leaves_no_output(
    tmp_path: Path, text: str, flags: list[str], says: str
) -> None:
    (tmp_path / "in.txt").write_text(text)
    out = tmp_path / "out"
    result = run_cli("prepare-data", str(tmp_path / "in.txt"), "-o", str(out), *flags)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [result.stderr.strip()], result.stderr
    assert result.stderr.startswith(says), result.stderr
    assert not out.exists()  # a refused preparation leaves no folder behind
    if text:  # the corrected rerun is not refused as "prepared with different arguments"
        again = run_cli("prepare-data", str(tmp_path / "in.txt"), "-o", str(out))
        assert again.returncode == 0, again.stderr
        assert (out / METADATA_FILE).is_file()


def _experiment(tmp_path: Path, paths: list[str]) -> ExperimentConfig:
    return ExperimentConfig(
        run_name="ids",
        model=TransformerConfig(
            vocab_size=384, d_model=16, n_layers=1, n_heads=2, max_sequence_length=SEQ
        ),
        dataset=NumpyDatasetConfig(paths=paths, sequence_length=SEQ),
        data_loader=NumpyDataLoaderConfig(global_batch_size=4 * SEQ, seed=0),
        train_module=TransformerTrainModuleConfig(rank_microbatch_size=4 * SEQ),
        trainer=TrainerConfig(save_folder=str(tmp_path / "run"), max_duration=Duration.steps(2)),
    )


def test_ids_beyond_the_experiments_tokenizer_are_refused_at_build(tmp_path: Path) -> None:
    """The byte tokenizer has 258 ids; the model 384 rows: 300 fits the model, not the
    tokenizer. Where the metadata records the largest id, the run is refused before it
    starts; without metadata, when the first instance holding it is read."""
    data = prepared(tmp_path)
    metadata = json.loads((data / METADATA_FILE).read_text())
    shard = data / metadata["splits"]["train"][0]["path"]
    tokens = np.load(shard)
    tokens[5] = 300
    np.save(shard, tokens)
    metadata["splits"]["train"][0]["max_token_id"] = metadata["max_token_id"] = 300
    (data / METADATA_FILE).write_text(json.dumps({**metadata, "vocab_size": 512}))
    with pytest.raises(
        DataError,
        match=r"token id 300 .*not below the tokenizer's vocabulary size=258; the data was prepared with another tokenizer than this experiment's \('byte'\)",
    ):
        train(_experiment(tmp_path, [str(data / "train")]))
    assert not list((tmp_path / "run").glob("step*"))
    raw = np.arange(64 * SEQ, dtype=np.uint16) % 200
    raw[3::SEQ] = 300
    np.save(tmp_path / "tokens.npy", raw)
    with pytest.raises(DataError, match=r"tokens.npy holds token id 300 .*tokenizer's vocabulary"):
        train(_experiment(tmp_path, [str(tmp_path / "tokens.npy")]))


def _binaries(folder: Path) -> list[Path]:
    folder.mkdir()
    (folder / "random.bin").write_bytes(np.random.default_rng(0).bytes(20_000))
    (folder / "program").write_bytes(Path(sys.executable).resolve().read_bytes()[:30_000])
    (folder / "__0_0.distcp").write_bytes(b"PK\x03\x04" + bytes(5000))
    return sorted(folder.iterdir())


def test_files_that_are_not_text_are_skipped_with_a_line_each_and_a_count(tmp_path: Path) -> None:
    inputs = tmp_path / "in"
    _binaries(inputs)
    (inputs / "code.py").write_text("def f(x):\n    return x  # café\n" * 50)
    result = run_cli("prepare-data", str(inputs), "-o", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    skipped = [line for line in result.stderr.splitlines() if line.startswith("skipping ")]
    assert len(skipped) == 3, result.stderr
    assert any("random.bin: not UTF-8 text" in line for line in skipped)
    assert "warning: skipped 3 of 4 input file(s) that are not UTF-8 text" in result.stderr
    metadata = json.loads((tmp_path / "out" / METADATA_FILE).read_text())
    assert [s["path"] for s in metadata["sources"]] == [f"{inputs}/code.py"]
    assert len(metadata["skipped"]) == 3
    assert "train: 1,601 tokens" in result.stdout  # the text and its EOS only


def test_only_binaries_is_an_error_and_keep_binary_tokenizes_them(tmp_path: Path) -> None:
    files = _binaries(tmp_path / "in")
    refused = run_cli("prepare-data", str(tmp_path / "in"), "-o", str(tmp_path / "out"))
    assert refused.returncode == 2
    assert "error: none of the 3 input file(s) is UTF-8 text" in refused.stderr
    assert "--keep-binary" in refused.stderr.splitlines()[-1]
    kept = prepare_data([tmp_path / "in"], tmp_path / "kept", keep_binary=True)
    assert len(kept.metadata["sources"]) == len(files) and kept.metadata["skipped"] == []


def test_the_standard_library_corpus_is_kept_whole() -> None:
    """``--stdlib`` is the embedded default corpus: the same files on every run (one, a test
    module in KOI8-R, is not UTF-8), so that the documented numbers hold."""
    sources = resolve_inputs(stdlib_python_files())
    assert _text_sources(sources, keep_binary=False) == (sources, [])


@pytest.mark.parametrize("kind", ["--sft", "--dpo"])
def test_fine_tuning_data_from_an_empty_file_is_refused_leaving_nothing_behind(
    tmp_path: Path, kind: str
) -> None:
    """And the corrected rerun is not refused as another preparation's (its work folder,
    which recorded the empty file's size, is gone too)."""
    data, out = tmp_path / "chat.jsonl", tmp_path / "out"
    data.write_text("")
    result = run_cli("prepare-data", str(data), "-o", str(out), kind, "--sequence-length", "128")
    assert result.returncode == 2 and "error: no " in result.stderr, result.stderr
    assert not out.exists()
    record = (
        {"prompt": "hi", "completion": "hello"}
        if kind == "--sft"
        else {"prompt": "hi", "chosen": "hello", "rejected": "go away"}
    )
    data.write_text(json.dumps(record) + "\n")
    again = run_cli("prepare-data", str(data), "-o", str(out), kind, "--sequence-length", "128")
    assert again.returncode == 0, again.stderr
