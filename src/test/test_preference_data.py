"""Preference data: chat pairs rendered with the chat template, and prepare-data --dpo."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import preloaded_python
import pytest
import torch
from testutils import patient

from olmolike.data import ByteTokenizer
from olmolike.data.preference import (
    PreferenceDataLoader,
    encode_preference_pairs,
    parse_preference_record,
    read_preference_jsonl,
)
from olmolike.data.preference_prepare import load_preference_rows, prepare_preference_data
from olmolike.exceptions import DataError

TOK = ByteTokenizer()
SEQ = 96


def scored(row: torch.Tensor, side: int) -> str:
    """The text of one side's scored tokens (0: chosen, 1: rejected)."""
    labels = row.chunk(4)[2 * side + 1]
    return bytes(labels[labels != -100].tolist()).decode()


def test_chat_pair_is_rendered_with_the_template_and_scores_the_reply_only() -> None:
    record = {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
        "chosen": [{"role": "assistant", "content": "4"}],
        "rejected": [{"role": "assistant", "content": "5"}],
    }
    row = encode_preference_pairs([parse_preference_record(record, "x:1")], TOK, SEQ)[0]
    template = TOK.chat_template
    assert template is not None
    text = template.render(record["prompt"] + record["chosen"])  # type: ignore[operator]
    c_ids = row.chunk(4)[0]
    assert bytes(c_ids[: len(text) - 1].tolist()).decode() == text[:-1]
    # The role header is prompt; the reply and its closing marker are scored.
    assert text.endswith("<|assistant|>\n4<|end|>\n")
    assert scored(row, 0) == "4<|end|>\n" and scored(row, 1) == "5<|end|>\n"


def test_strings_mixed_with_messages_and_conversations_without_prompt() -> None:
    mixed = parse_preference_record({"prompt": "hi", "chosen": "hello", "rejected": "go"}, "x:1")
    assert not mixed.is_chat
    chat = parse_preference_record(
        {"prompt": "2+2?", "chosen": [{"role": "assistant", "content": "4"}], "rejected": "5"},
        "x:2",
    )
    implicit = parse_preference_record(
        {
            "chosen": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
            "rejected": [
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "5"},
            ],
        },
        "x:3",
    )
    rows = encode_preference_pairs([chat, implicit], TOK, SEQ)
    assert torch.equal(rows[0], rows[1])
    labels = encode_preference_pairs([mixed], TOK, SEQ)[0].chunk(4)[1]
    assert labels[labels != -100].tolist() == [*TOK.encode("hello"), TOK.eos_token_id]


@pytest.mark.parametrize(
    ("record", "match"),
    [
        ({"prompt": "p", "chosen": "same", "rejected": "same"}, "x:1: 'chosen' and 'rejected' are identical.*fix the rejected"),
        ({"prompt": "", "chosen": "a", "rejected": "b"}, "x:1: the prompt is empty"),
        (
            {"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
             "rejected": [{"role": "user", "content": "z"}, {"role": "assistant", "content": "c"}]},
            "x:1: without a 'prompt'.*add the shared 'prompt'",
        ),
        ({"prompt": [{"role": "robot", "content": "a"}], "chosen": "b", "rejected": "c"}, "unknown role 'robot'"),
        ({"prompt": "a", "chosen": "b"}, "x:1: a preference record needs 'chosen' and 'rejected'"),
    ],
)  # fmt: skip
def test_bad_records_name_the_record_and_the_fix(record: dict[str, Any], match: str) -> None:
    with pytest.raises(DataError, match=match):
        parse_preference_record(record, "x:1")


def test_a_prompt_longer_than_the_sequence_names_the_fix() -> None:
    long_chat = parse_preference_record(
        {"prompt": [{"role": "user", "content": "q" * 90}], "chosen": "a", "rejected": "b"}, "x:4"
    )
    with pytest.raises(DataError, match=r"x:4: the prompt has 1\d\d tokens.*--sequence-length"):
        encode_preference_pairs([long_chat], TOK, SEQ)


def write(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def records(count: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i in range(count):
        if i % 2:
            out.append({"prompt": f"Q{i}: ", "chosen": f"yes {i}", "rejected": f"no {i}"})
        else:
            out.append({
                "prompt": [{"role": "user", "content": f"Q{i}?"}],
                "chosen": [{"role": "assistant", "content": f"good {i}"}],
                "rejected": [{"role": "assistant", "content": f"bad {i}"}],
            })  # fmt: skip
    return out


def test_prepared_pairs_equal_the_encoded_ones_and_feed_the_loader(tmp_path: Path) -> None:
    source = write(tmp_path / "prefs.jsonl", records(40))
    meta = prepare_preference_data(
        [source], tmp_path / "out", sequence_length=SEQ, val_fraction=0.25, seed=1
    )
    train, val = (
        load_preference_rows(tmp_path / "out"),
        load_preference_rows(tmp_path / "out", "val"),
    )
    assert meta["splits"]["train"]["pairs"] == len(train) and len(train) + len(val) == 40
    assert 0 < len(val) < 20
    everything = encode_preference_pairs(read_preference_jsonl(source), TOK, SEQ)
    got = {tuple(r.tolist()) for r in torch.cat([train, val]).long()}
    assert got == {tuple(r.tolist()) for r in everything}
    loader = PreferenceDataLoader(train, global_batch_size=4 * 4 * SEQ, seed=0)
    loader.reshuffle(1)
    batch = next(iter(loader))
    assert batch["input_ids"].shape == (8, SEQ) and batch["labels"].dtype == torch.int64
    with pytest.raises(DataError, match="prepare-data --dpo"):
        load_preference_rows(tmp_path)


@pytest.mark.timeout(120)
def test_command_line(tmp_path: Path) -> None:
    write(tmp_path / "a.jsonl", records(10))
    result = subprocess.run(
        [*preloaded_python.command(), "-m", "olmolike.cli", "prepare-data", "--dpo", "a.jsonl", "-o", "out",
         "--sequence-length", "64"],
        cwd=tmp_path, capture_output=True, text=True, timeout=patient(110),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "train: 10 pairs of 64 tokens a side" in result.stdout
    assert load_preference_rows(tmp_path / "out").shape == (10, 4 * 64)


def test_command_line_errors_name_the_record_and_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from olmolike.cli import main

    monkeypatch.chdir(tmp_path)
    write(tmp_path / "a.jsonl", records(4))
    write(tmp_path / "b.jsonl", [*records(2), {"prompt": "p", "chosen": "x", "rejected": "x"}])
    cases = [
        (["b.jsonl", "--sequence-length", "64"], "b.jsonl, line 3: 'chosen' and 'rejected' are identical"),
        (["a.jsonl", "--sequence-length", "8"], "raise seq_len (--sequence-length)"),
        (["a.jsonl"], "--dpo needs --sequence-length"),
        (["a.jsonl", "--sft", "--sequence-length", "64"], "--sft or --dpo, not both"),
    ]  # fmt: skip
    for i, (args, message) in enumerate(cases):
        assert main(["prepare-data", "--dpo", *args, "-o", f"o{i}"]) == 2
        assert message in capsys.readouterr().err
