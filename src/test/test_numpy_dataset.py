"""NumpyFSLDataset: instances over .npy and raw files, checks, fingerprints, mixtures, remote."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from remote_servers import RemoteStore

from olmolike.data import NumpyDatasetConfig, SourceMixtureConfig, prepare_data
from olmolike.exceptions import ConfigurationError, DataError

SEQ = 8


def write_npy(path: Path, tokens: np.ndarray) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, tokens)
    return str(path)


def dataset(paths: list[str], **config: object) -> object:
    return NumpyDatasetConfig(paths=paths, sequence_length=SEQ, **config).build()  # type: ignore[arg-type]


def test_instances_are_windows_within_each_file_and_tails_are_dropped(tmp_path: Path) -> None:
    a = write_npy(tmp_path / "a.npy", np.arange(3 * SEQ + 5, dtype=np.uint16))  # 3 + a tail
    b = write_npy(tmp_path / "b.npy", np.arange(1000, 1000 + 2 * SEQ, dtype=np.uint32))
    ds = NumpyDatasetConfig(paths=[a, b], sequence_length=SEQ).build()
    assert len(ds) == 5 and ds.num_tokens == 5 * SEQ
    item = ds[3]
    assert item["index"] == 3 and item["input_ids"].dtype == torch.int64
    assert item["input_ids"].tolist() == list(range(1000, 1000 + SEQ))
    assert ds[2]["input_ids"].tolist() == list(range(2 * SEQ, 3 * SEQ))
    with pytest.raises(IndexError):
        ds[5]


def test_folders_and_globs_pick_token_files_in_sorted_order(tmp_path: Path) -> None:
    write_npy(tmp_path / "d" / "b.npy", np.full(SEQ, 2, dtype=np.uint16))
    write_npy(tmp_path / "d" / "sub" / "a.npy", np.full(SEQ, 1, dtype=np.uint16))
    (tmp_path / "d" / "notes.txt").write_text("not tokens")
    folder = NumpyDatasetConfig(paths=[str(tmp_path / "d")], sequence_length=SEQ).build()
    assert [int(folder[i]["input_ids"][0]) for i in range(2)] == [2, 1]
    globbed = NumpyDatasetConfig(paths=[str(tmp_path / "d/**/*.npy")], sequence_length=SEQ).build()
    assert len(globbed) == 2


def test_raw_files_from_other_tools_need_their_dtype(tmp_path: Path) -> None:
    raw = tmp_path / "tokens.bin"
    np.arange(70_000, 70_000 + 2 * SEQ, dtype=np.uint32).tofile(raw)
    ds = NumpyDatasetConfig(paths=[str(raw)], sequence_length=SEQ, dtype="uint32").build()
    assert ds[1]["input_ids"].tolist() == list(range(70_000 + SEQ, 70_000 + 2 * SEQ))
    with pytest.raises(ConfigurationError, match=r"dtype: .*tokens\.bin is a raw token file"):
        NumpyDatasetConfig(paths=[str(raw)], sequence_length=SEQ).build()
    with pytest.raises(ConfigurationError, match="dtype"):
        NumpyDatasetConfig(paths=[str(raw)], sequence_length=SEQ, dtype="int32")


def test_bad_files_are_named_with_the_problem(tmp_path: Path) -> None:
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match=r"empty\.bin is empty"):
        dataset([str(empty)], dtype="uint16")
    floats = write_npy(tmp_path / "floats.npy", np.zeros(SEQ, dtype=np.float32))
    with pytest.raises(DataError, match=r"floats\.npy holds float32, not unsigned"):
        dataset([floats])
    u16 = write_npy(tmp_path / "u16.npy", np.zeros(SEQ, dtype=np.uint16))
    with pytest.raises(DataError, match=r"u16\.npy holds uint16, but dtype is set to uint32"):
        dataset([u16], dtype="uint32")
    cut = tmp_path / "cut.npy"
    cut.write_bytes(
        Path(write_npy(tmp_path / "whole.npy", np.zeros(4 * SEQ, np.uint16))).read_bytes()[:-3]
    )
    with pytest.raises(DataError, match=r"cut\.npy is truncated"):
        dataset([str(cut)])
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x00" * 5)
    with pytest.raises(DataError, match=r"odd\.bin is truncated or not uint16"):
        dataset([str(odd)], dtype="uint16")
    with pytest.raises(DataError, match=r"no token files match the glob '.*nothing-\*\.npy'"):
        dataset([str(tmp_path / "nothing-*.npy")])
    with pytest.raises(DataError, match="does not exist"):
        dataset([str(tmp_path / "missing.npy")])
    short = write_npy(tmp_path / "short.npy", np.zeros(SEQ - 1, np.uint16))
    with pytest.raises(DataError, match="no token file holds 8 tokens"):
        dataset([short])


def test_token_ids_are_checked_per_instance_against_the_vocabulary(tmp_path: Path) -> None:
    tokens = np.zeros(3 * SEQ, dtype=np.uint16)
    tokens[2 * SEQ + 1] = 300
    path = write_npy(tmp_path / "ids.npy", tokens)
    ds = dataset([path], vocab_size=258)
    assert ds[0]["input_ids"].sum() == 0  # other instances are fine: nothing reads ahead
    with pytest.raises(DataError, match=r"ids\.npy holds token id 300 \(in tokens \[16, 24\)\)"):
        ds[2]
    assert dataset([path])[2]["input_ids"].max() == 300  # no vocabulary known: no check


def test_prepared_data_supplies_vocab_and_eos_from_its_metadata(tmp_path: Path) -> None:
    (tmp_path / "doc.txt").write_text("x" * 40)
    prepared = prepare_data([tmp_path / "doc.txt"], tmp_path / "out")
    ds = dataset([str(tmp_path / "out" / "train")])
    assert (ds.vocab_size, ds.eos_token_id) == (258, 256)
    meta = json.loads((tmp_path / "out" / "metadata.json").read_text())
    meta["vocab_size"] = 100  # as if made with a smaller tokenizer: "x" (120) is out of range
    (tmp_path / "out" / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match="not below vocab_size=100"):
        dataset(prepared.paths())[0]


def test_fingerprint_follows_names_sizes_and_sequence_length_not_folders(tmp_path: Path) -> None:
    tokens = np.arange(4 * SEQ, dtype=np.uint16)
    a = write_npy(tmp_path / "one" / "data.npy", tokens)
    b = write_npy(tmp_path / "two" / "data.npy", tokens)
    c = write_npy(tmp_path / "three" / "data.npy", tokens[:-1])
    assert dataset([a]).fingerprint == dataset([b]).fingerprint
    assert dataset([a]).fingerprint != dataset([c]).fingerprint
    other_length = NumpyDatasetConfig(paths=[a], sequence_length=4).build()
    assert other_length.fingerprint != dataset([a]).fingerprint


def mixture_sources(tmp_path: Path, sizes: dict[str, int]) -> dict[str, str]:
    """One file per source, each instance filled with the source's marker id."""
    return {
        name: write_npy(tmp_path / f"{name}.npy", np.full(count * SEQ, marker, dtype=np.uint16))
        for marker, (name, count) in enumerate(sizes.items(), start=1)
    }


def mixture(
    paths: dict[str, str], rates: dict[str, float], seed: int = 0, **max_rep: float
) -> object:
    sources = [
        SourceMixtureConfig(name, [paths[name]], rate, max_repetition=max_rep.get(name, 1.0))
        for name, rate in rates.items()
    ]
    return NumpyDatasetConfig(mixture=sources, sequence_length=SEQ, seed=seed).build()


def test_mixture_rates_hold_within_rounding_and_repetition_limits(tmp_path: Path) -> None:
    paths = mixture_sources(tmp_path, {"web": 30, "code": 10})
    ds = mixture(paths, {"web": 0.3, "code": 0.7}, code=3.0)
    assert len(ds) == 40
    markers = Counter(int(ds[i]["input_ids"][0]) for i in range(len(ds)))
    assert markers == {1: 12, 2: 28}  # 0.3 and 0.7 of 40
    code_picks = Counter(int(i) for i in ds._index if i >= 30)
    assert set(code_picks.values()) == {2, 3}  # repeated evenly, never beyond 3 times
    web_picks = [int(i) for i in ds._index if i < 30]
    assert len(set(web_picks)) == 12  # subsampled without repetition
    again = mixture(paths, {"web": 0.3, "code": 0.7}, code=3.0)
    assert np.array_equal(again._index, ds._index)
    reseeded = mixture(paths, {"web": 0.3, "code": 0.7}, seed=1, code=3.0)
    assert not np.array_equal(reseeded._index, ds._index)
    assert reseeded.fingerprint != ds.fingerprint


def test_mixture_refuses_more_repetition_than_allowed(tmp_path: Path) -> None:
    paths = mixture_sources(tmp_path, {"web": 30, "code": 10})
    with pytest.raises(
        DataError, match=r"'code' has 10 instances.*needs 28.*max_repetition=2\.5; lower its rate"
    ):
        mixture(paths, {"web": 0.3, "code": 0.7}, code=2.5)
    with pytest.raises(ConfigurationError, match=r"rates must sum to 1, got 0\.9"):
        mixture(paths, {"web": 0.3, "code": 0.6})
    with pytest.raises(ConfigurationError, match="exactly one of paths and mixture"):
        NumpyDatasetConfig(paths=[paths["web"]], mixture=[SourceMixtureConfig("w", ["x"], 1.0)])


def test_configs_round_trip_through_plain_dicts() -> None:
    config = NumpyDatasetConfig(
        mixture=[SourceMixtureConfig("a", ["x.npy"], 0.25), SourceMixtureConfig("b", ["y"], 0.75)],
        sequence_length=16,
        dtype="uint16",
    )
    assert NumpyDatasetConfig.from_dict(config.as_config_dict()) == config
    merged = config.merge(["--sequence_length=32"])
    assert merged.sequence_length == 32


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("bucket", ["gcs_bucket", "s3_bucket"])
def test_remote_files_are_read_by_byte_range(
    bucket: str, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store: RemoteStore = request.getfixturevalue(bucket)
    (tmp_path / "doc.txt").write_text("remote tokens " * 20)
    prepared = prepare_data([tmp_path / "doc.txt"], tmp_path / "out")
    raw = np.arange(5 * SEQ, dtype=np.uint32)
    raw.tofile(tmp_path / "raw.bin")
    store.fs.put_file(prepared.paths()[0], store.url("data", "train", "part-00000.npy"))
    store.fs.put_file(str(tmp_path / "out" / "metadata.json"), store.url("data", "metadata.json"))
    store.fs.put_file(str(tmp_path / "raw.bin"), store.url("raw", "x.bin"))

    remote = dataset([store.url("data", "train")])
    local = dataset(prepared.paths())
    assert remote.vocab_size == 258 and remote.fingerprint == local.fingerprint
    requests: list[tuple[object, object]] = []
    real_cat = store.fs.cat_file
    monkeypatch.setattr(
        store.fs,
        "cat_file",
        lambda path, start=None, end=None, **kw: (
            requests.append((start, end)) or real_cat(path, start=start, end=end, **kw)
        ),
    )
    for i in range(len(local)):
        assert torch.equal(remote[i]["input_ids"], local[i]["input_ids"])
    assert len(requests) == len(local)
    assert all(end - start == 2 * SEQ for start, end in requests)  # one instance of uint16
    raw_ds = dataset([store.url("raw", "*.bin")], dtype="uint32")
    assert raw_ds[4]["input_ids"].tolist() == raw[4 * SEQ :].tolist()
    with pytest.raises(DataError, match="no token files match the glob"):
        dataset([store.url("raw", "*.npy")])
