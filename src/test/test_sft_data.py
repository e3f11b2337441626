"""prepare-data --sft: formats, assistant-only labels, packing and padding, bad inputs."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import preloaded_python
import pytest
from testutils import patient

from olmolike.data import ByteTokenizer, NumpyDataLoaderConfig, SFTDataset, prepare_sft_data
from olmolike.data.sft import _pack
from olmolike.exceptions import DataError

TOK = ByteTokenizer()


def write(path: Path, records: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def examples(count: int) -> list[dict[str, str]]:
    return [{"prompt": f"say {i}", "completion": "x" * (1 + i % 9)} for i in range(count)]


def trained_text(dataset: SFTDataset) -> list[str]:
    """The label tokens of every sequence, per document, decoded."""
    out = []
    for i in range(len(dataset)):
        item = dataset[i]
        labels, docs = item["labels"], item["doc_ids"]
        for doc in sorted(set(docs.tolist()) - {-1}):
            kept = labels[(docs == doc) & (labels != -100)]
            out.append(TOK.decode(kept.tolist()))
    return out


def test_labels_are_the_assistant_turns_only(tmp_path: Path) -> None:
    conversation = [
        {"role": "system", "content": "terse"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "ciao"},
    ]
    source = write(
        tmp_path / "chat.jsonl",
        [{"messages": conversation}, {"prompt": "2+2", "completion": "4"}],
    )
    meta = prepare_sft_data([source], tmp_path / "out", sequence_length=128, packing="padded")
    dataset = SFTDataset(tmp_path / "out")
    assert trained_text(dataset) == ["hello<|end|>\nciao<|end|>\n", "4<|end|>\n"]
    item = dataset[0]
    # Labels are next tokens: where a label is set, it is the following input token.
    where = np.flatnonzero(item["labels"].numpy() != -100)
    assert (item["labels"][where] == item["input_ids"][where + 1]).all()
    stats = meta["splits"]["train"]
    assert stats["trained_tokens"] == len("hello<|end|>\nciao<|end|>\n4<|end|>\n")
    assert (
        stats["padding_tokens"] == (item["doc_ids"] < 0).sum() + (dataset[1]["doc_ids"] < 0).sum()
    )


def test_packing_fills_sequences_and_keeps_examples_apart(tmp_path: Path) -> None:
    source = write(tmp_path / "a.jsonl", examples(60))
    packed = prepare_sft_data([source], tmp_path / "packed", sequence_length=256)
    padded = prepare_sft_data([source], tmp_path / "padded", sequence_length=256, packing="padded")
    p, q = packed["splits"]["train"], padded["splits"]["train"]
    assert p["examples"] == q["examples"] == 60 and q["sequences"] == 60
    # ~49 tokens each: 2,940 tokens need at least 12 sequences of 256; best fit uses 13.
    assert p["sequences"] <= 13 and p["padding_fraction"] < 0.15 and q["padding_fraction"] > 0.7
    assert p["trained_tokens"] == q["trained_tokens"]
    # The same examples, whichever layout: each completion exactly once.
    assert sorted(trained_text(SFTDataset(tmp_path / "packed"))) == sorted(
        trained_text(SFTDataset(tmp_path / "padded"))
    )
    docs = np.load(tmp_path / "packed" / "train" / "doc_ids.npy")
    assert p["padding_fraction"] == pytest.approx((docs < 0).mean())


def test_best_fit_decreasing() -> None:
    assert _pack([5, 3, 7, 2, 3], 10) == [[2, 1], [0, 4, 3]]  # 7+3 fill one exactly
    bins = _pack([1 + (i * 7) % 10 for i in range(200)], 16)
    assert sorted(i for b in bins for i in b) == list(range(200))
    assert all(sum(1 + (i * 7) % 10 for i in b) <= 16 for b in bins)


def test_validation_split_and_loader_batches(tmp_path: Path) -> None:
    source = write(tmp_path / "a.jsonl", examples(200))
    meta = prepare_sft_data([source], tmp_path / "out", sequence_length=64, val_fraction=0.2)
    assert 20 < meta["splits"]["val"]["examples"] < 60
    loader = NumpyDataLoaderConfig(global_batch_size=4 * 64, seed=0).build(
        SFTDataset(tmp_path / "out"), dp_rank=0, dp_world_size=1
    )
    loader.reshuffle(1)
    batch = next(iter(loader))
    assert set(batch) == {"input_ids", "labels", "doc_ids", "index"}
    assert batch["labels"].shape == batch["doc_ids"].shape == (4, 64)


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ('{"messages": [{"role": "user", "content": "hi"}', "line 2: not valid JSON"),
        ('{"messages": [{"role": "bot", "content": "hi"}]}', "unknown role 'bot'"),
        ('{"prompt": "hi", "completion": "  "}', "empty completion"),
        ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant turn"),
        ('{"text": "hi"}', "needs 'messages' or 'prompt' and 'completion'"),
        ('{"prompt": "hi", "completion": 3}', "string or a list"),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path: Path, line: str, match: str) -> None:
    source = tmp_path / "bad.jsonl"
    source.write_text(json.dumps(examples(1)[0]) + "\n" + line + "\n")
    with pytest.raises(DataError, match=match) as error:
        prepare_sft_data([source], tmp_path / "out", sequence_length=64)
    assert "bad.jsonl, line 2" in str(error.value)


def test_overlong_examples_error_truncate_or_drop(tmp_path: Path) -> None:
    records = [
        *examples(4),
        {"prompt": "p" * 100, "completion": "long prompt"},
        {"prompt": "short", "completion": "c" * 100},
    ]
    source = write(tmp_path / "a.jsonl", records)
    with pytest.raises(DataError, match=r"line 5: the example has \d+ tokens.*--overlong"):
        prepare_sft_data([source], tmp_path / "err", sequence_length=64)
    kept = prepare_sft_data([source], tmp_path / "trunc", sequence_length=64, overlong="truncate")
    # The long prompt leaves no completion token in 64: dropped; the long completion is cut.
    assert kept["splits"]["train"] | {} and kept["splits"]["train"]["truncated"] == 1
    assert kept["splits"]["train"]["dropped"] == 1 and kept["splits"]["train"]["examples"] == 5
    dropped = prepare_sft_data([source], tmp_path / "drop", sequence_length=64, overlong="drop")
    assert dropped["splits"]["train"]["dropped"] == 2
    assert dropped["splits"]["train"]["examples"] == 4


def test_rerun_is_a_no_op_and_other_arguments_are_refused(tmp_path: Path) -> None:
    source = write(tmp_path / "a.jsonl", examples(10))
    first = prepare_sft_data([source], tmp_path / "out", sequence_length=64)
    assert prepare_sft_data([source], tmp_path / "out", sequence_length=64) == first
    with pytest.raises(DataError, match="different sequence_length"):
        prepare_sft_data([source], tmp_path / "out", sequence_length=128)
    with pytest.raises(DataError, match="pretraining token shards"):
        from olmolike.data import prepare_data

        prepare_data([source], tmp_path / "pre", text_field="prompt")
        SFTDataset(tmp_path / "pre")


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*preloaded_python.command(), "-m", "olmolike.cli", "prepare-data", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=patient(120),
    )


@pytest.mark.timeout(240)
def test_command_line(tmp_path: Path) -> None:
    write(tmp_path / "a.jsonl", examples(30))
    result = cli("--sft", "a.jsonl", "-o", "out", "--sequence-length", "64", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "train: 30 examples in" in result.stdout and "padding" in result.stdout
    result = cli("--sft", "a.jsonl", "-o", "o2", cwd=tmp_path)
    assert result.returncode == 2 and "--sequence-length" in result.stderr
    (tmp_path / "b.jsonl").write_text("{oops\n")
    result = cli("--sft", "b.jsonl", "-o", "o3", "--sequence-length", "64", cwd=tmp_path)
    assert result.returncode == 2 and "b.jsonl, line 1: not valid JSON" in result.stderr


def test_a_split_opened_twice_is_described_in_the_log_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # `make sft` opened the validation split for its before-training loss and its evaluator.
    prepare_sft_data(
        [write(tmp_path / "a.jsonl", examples(40))], tmp_path / "out", sequence_length=64
    )
    with caplog.at_level("INFO", logger="olmolike.data.sft_dataset"):
        SFTDataset(tmp_path / "out")
        SFTDataset(tmp_path / "out")
    assert [r.getMessage().startswith("SFT data") for r in caplog.records] == [True]
