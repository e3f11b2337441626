"""A newcomer's data mistakes are caught when the run is built or the data prepared, as one
clear error: token ids beyond the model's vocabulary, an empty training split, empty inputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from testutils import patient

from olmolike.data import NumpyDataLoaderConfig, NumpyDatasetConfig, prepare_data
from olmolike.data.numpy_dataset import METADATA_FILE
from olmolike.exceptions import DataError
from olmolike.testing import TinyCausalLM
from olmolike.train import Duration, TrainerConfig
from olmolike.train.train_module import BasicTrainModule

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
        [sys.executable, "-m", "olmolike", *args],
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
    assert not (out / METADATA_FILE).exists()
    assert not out.exists() or not any(out.iterdir()), list(out.iterdir())
    if text:  # the corrected rerun is not refused as "prepared with different arguments"
        again = run_cli("prepare-data", str(tmp_path / "in.txt"), "-o", str(out))
        assert again.returncode == 0, again.stderr
        assert (out / METADATA_FILE).is_file()
