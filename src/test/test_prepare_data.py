"""prepare-data: inputs, shards, metadata, the validation split, resuming and refusals."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

import olmolike.data.prepare as prepare
import olmolike.data.sources as sources
from olmolike.cli import main
from olmolike.data import TokenizerConfig, prepare_data, stdlib_python_files
from olmolike.data.prepare import PreparedData
from olmolike.exceptions import DataError

EOS = 256
VAL_DOCS = 20
"""Documents of :func:`many_documents` in the validation split at fraction 0.25, seed 0."""


def byte_doc(text: str) -> list[int]:
    return [*text.encode("utf-8"), EOS]


def tree_of_files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def many_documents(root: Path, files: int = 12, per_file: int = 6) -> Path:
    root.mkdir()
    for f in range(files):
        lines = [json.dumps({"text": f"file {f} document {d} " * (d + 1)}) for d in range(per_file)]
        (root / f"{f:02d}.jsonl").write_text("\n".join(lines) + "\n")
    return root


def test_jsonl_text_and_glob_inputs_become_one_eos_separated_stream(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "texts").mkdir(parents=True)
    (data / "a.jsonl").write_text('{"text": "first", "id": 1}\n\n{"text": "second"}\n')
    with gzip.open(data / "b.jsonl.gz", "wt") as f:
        f.write('{"text": "zipped ü"}\n')
    (data / "texts" / "c.txt").write_text("plain file")
    (data / "texts" / "d.txt").write_text("")  # an empty document adds nothing
    prepared = prepare_data(
        [data / "a.jsonl", str(data / "b.jsonl.gz"), str(data / "texts" / "*.txt")],
        tmp_path / "out",
        text_field="text",
    )
    assert prepared.paths("val") == []
    (shard,) = prepared.paths("train")
    tokens = np.load(shard, mmap_mode="r")
    assert tokens.dtype == np.uint16
    expected = (
        byte_doc("first") + byte_doc("second") + byte_doc("zipped ü") + byte_doc("plain file")
    )
    assert tokens.tolist() == expected
    meta = json.loads((tmp_path / "out" / "metadata.json").read_text())
    assert meta["vocab_size"] == 258 and meta["eos_token_id"] == EOS and meta["dtype"] == "uint16"
    assert meta["splits"]["train"] == [
        {"path": "train/part-00000.npy", "tokens": len(tokens), "documents": 4, "max_token_id": EOS}
    ]
    assert [s["path"] for s in meta["sources"]] == [
        f"{data}/a.jsonl",
        f"{data}/b.jsonl.gz",
        f"{data}/texts/c.txt",
        f"{data}/texts/d.txt",
    ]
    assert [s["bytes"] for s in meta["sources"]][2:] == [10, 0]


def test_a_missing_text_field_names_the_file_and_line(tmp_path: Path) -> None:
    source = tmp_path / "docs.jsonl"
    source.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(DataError, match=r"docs\.jsonl, line 2: no 'text' field.*--text-field"):
        prepare_data([source], tmp_path / "out")
    (tmp_path / "bad.jsonl").write_text("{broken\n")
    with pytest.raises(DataError, match=r"bad\.jsonl, line 1: not valid JSON"):
        prepare_data([tmp_path / "bad.jsonl"], tmp_path / "out2")


def test_field_choice_and_folder_inputs(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "sub" / "x.jsonl").write_text('{"body": "b1"}\n')
    (data / ".hidden").write_text("skipped")
    prepared = prepare_data([data], data / "out", text_field="body")  # output inside input
    assert np.load(prepared.paths()[0]).tolist() == byte_doc("b1")
    again = prepare_data([data], data / "out", text_field="body")
    assert again.metadata == prepared.metadata


def test_inputs_that_match_nothing_are_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"no files match the glob '.*\*\.nothing'"):
        prepare_data([str(tmp_path / "*.nothing")], tmp_path / "out")
    with pytest.raises(DataError, match="does not exist"):
        prepare_data([tmp_path / "missing.txt"], tmp_path / "out")
    with pytest.raises(DataError, match="val_fraction"):
        prepare_data([tmp_path], tmp_path / "out", val_fraction=1.0)


def test_shards_close_at_document_boundaries(tmp_path: Path) -> None:
    data = many_documents(tmp_path / "data")
    whole = prepare_data([data], tmp_path / "whole")
    cut = prepare_data([data], tmp_path / "cut", shard_tokens=500)
    shards = [np.load(p) for p in cut.paths()]
    assert len(shards) > 3
    assert np.array_equal(np.concatenate(shards), np.load(whole.paths()[0]))
    assert all(s[-1] == EOS for s in shards)
    assert all(len(s) >= 500 for s in shards[:-1])
    # A shard closes at the first document end at or past 500 tokens: one document fewer
    # would leave it short.
    for shard in shards[:-1]:
        last_doc_start = np.flatnonzero(shard[:-1] == EOS)[-1] + 1
        assert last_doc_start < 500
    counts = [s["documents"] for s in cut.metadata["splits"]["train"]]
    assert sum(counts) == 72 and [int((s == EOS).sum()) for s in shards] == counts


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_validation_split_is_stable_and_output_identical_for_any_worker_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # relative inputs: the source names, hence the split, are fixed
    data = many_documents(Path("data"))
    monkeypatch.setattr(prepare, "PART_BYTES", 600)  # several parts, so both workers get some
    one = prepare_data([data], "w1", val_fraction=0.25, shard_tokens=700)
    two = prepare_data([data], "w2", val_fraction=0.25, shard_tokens=700, workers=2)
    assert tree_of_files(tmp_path / "w1") == tree_of_files(tmp_path / "w2")
    val_docs = sum(s["documents"] for s in one.metadata["splits"]["val"])
    assert val_docs == VAL_DOCS and 0 < two.num_tokens("val") < two.num_tokens("train")
    other_seed = prepare_data([data], "s1", val_fraction=0.25, seed=1)
    assert (
        np.load(other_seed.paths("val")[0]).tolist()
        != np.concatenate([np.load(p) for p in one.paths("val")]).tolist()
    )


def test_resume_after_a_killed_run_skips_finished_parts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = many_documents(tmp_path / "data")
    monkeypatch.setattr(prepare, "PART_BYTES", 600)
    reference = prepare_data([data], tmp_path / "reference", val_fraction=0.2, shard_tokens=900)
    real_tokenize, calls = prepare._tokenize, []

    def dies_on_the_third_part(job: object, tokenizer: object) -> int:
        if len(calls) == 2:
            raise KeyboardInterrupt("killed")
        calls.append(job)
        return real_tokenize(job, tokenizer)  # type: ignore[arg-type]

    out = tmp_path / "out"
    monkeypatch.setattr(prepare, "_tokenize", dies_on_the_third_part)
    with pytest.raises(KeyboardInterrupt):
        prepare_data([data], out, val_fraction=0.2, shard_tokens=900)
    assert not (out / "metadata.json").exists()
    (out / "train").mkdir()
    (out / "train" / "part-00000.npy.tmp").write_bytes(b"half a shard")  # killed mid-write
    calls.clear()
    monkeypatch.setattr(
        prepare, "_tokenize", lambda job, tok: calls.append(job) or real_tokenize(job, tok)
    )
    prepare_data([data], out, val_fraction=0.2, shard_tokens=900)
    total_parts = len(prepare._group_sources(prepare.resolve_inputs([data])))
    assert len(calls) == total_parts - 2
    assert tree_of_files(out) == tree_of_files(tmp_path / "reference")
    assert reference.metadata["splits"] == PreparedData.load(out).metadata["splits"]


def test_rerun_with_other_arguments_is_refused_unless_overwrite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = many_documents(tmp_path / "data", files=2)
    out = tmp_path / "out"
    first = prepare_data([data], out)
    monkeypatch.setattr(prepare, "_tokenize", None)  # an identical rerun must not tokenize
    assert prepare_data([data], out).metadata == first.metadata
    with pytest.raises(
        DataError, match=r"different val_fraction; pass --overwrite \(overwrite=True from Python\)"
    ):
        prepare_data([data], out, val_fraction=0.5)
    (data / "extra.txt").write_text("new input")
    with pytest.raises(DataError, match="different sources"):
        prepare_data([data], out)
    monkeypatch.undo()
    replaced = prepare_data([data], out, val_fraction=0.5, overwrite=True)
    assert replaced.metadata["arguments"]["val_fraction"] == 0.5
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="not empty"):
        prepare_data([data], foreign)


def test_a_large_vocabulary_gets_uint32_tokens(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"w{i}": i for i in range(70_000)} | {"[UNK]": 70_000, "<|endoftext|>": 70_001}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    model.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "doc.txt").write_text("w1 w69999 w65536")
    prepared = prepare_data(
        [tmp_path / "doc.txt"],
        tmp_path / "out",
        tokenizer=TokenizerConfig(identifier=str(tmp_path / "tokenizer.json")),
    )
    tokens = np.load(prepared.paths()[0])
    assert tokens.dtype == np.uint32 and prepared.metadata["dtype"] == "uint32"
    assert tokens.tolist() == [1, 69_999, 65_536, 70_001]
    assert prepared.vocab_size == 70_002 and prepared.eos_token_id == 70_001


def test_stdlib_files_are_sorted_python_sources_without_installed_packages() -> None:
    files = stdlib_python_files()
    assert len(files) > 100 and files == stdlib_python_files()
    assert all(f.suffix == ".py" for f in files)
    assert not any({"site-packages", "dist-packages"} & set(f.parts) for f in files)
    assert any(f.name == "os.py" for f in files)


def test_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "doc.txt").write_text("from the command line")
    # The command imports it when it runs (its help imports nothing heavy).
    monkeypatch.setattr(sources, "stdlib_python_files", lambda: [tmp_path / "doc.txt"])
    assert (
        main(["prepare-data", "--stdlib", "-o", str(tmp_path / "out"), "--val-fraction", "0"]) == 0
    )
    assert "train: 22 tokens in 1 shard(s)" in capsys.readouterr().out
    rerun = ["prepare-data", str(tmp_path / "doc.txt"), "-o", str(tmp_path / "out")]
    assert main([*rerun, "--seed", "1"]) == 2
    assert "different seed" in capsys.readouterr().err
    assert main([*rerun, "--seed", "1", "--overwrite"]) == 0
    assert main(["prepare-data", "-o", str(tmp_path / "none")]) == 2
    assert "--stdlib" in capsys.readouterr().err


def test_the_command_says_when_no_validation_was_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # No training tokens at all is an error: test_data_mistakes.py. A document's split hashes
    # its source as named, so the file is named the same in every run: under tmp_path's
    # changing name, the one document went to validation in ~2% of runs (an error, exit 2).
    monkeypatch.chdir(tmp_path)
    Path("doc.txt").write_text("one document")  # with seed 0, a training document
    one = ["prepare-data", "doc.txt", "-o", "b"]
    assert main([*one, "--val-fraction", "0.02"]) == 0
    assert "validation split is empty: --val-fraction 0.02 of 1 document(s)" in (
        capsys.readouterr().err
    )


def test_sft_says_when_the_validation_split_it_was_asked_for_is_empty(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"prompt": "2+2=", "completion": "4"}) + "\n")
    args = ["prepare-data", "--sft", str(data), "--sequence-length", "64"]
    assert main([*args, "-o", str(tmp_path / "a"), "--val-fraction", "0.02"]) == 0
    assert "validation split is empty: --val-fraction 0.02 of 1 example(s)" in (
        capsys.readouterr().err
    )
    assert main([*args, "-o", str(tmp_path / "b")]) == 0  # none asked for: nothing to say
    assert "validation split" not in capsys.readouterr().err
