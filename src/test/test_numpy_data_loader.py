"""NumpyDataLoader: seeded epoch order, rank slices, exact resume, batch-size changes, eval."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from olmolike.data import (
    NumpyDataLoader,
    NumpyDataLoaderConfig,
    NumpyDatasetConfig,
    NumpyFSLDataset,
    iter_eval_batches,
)
from olmolike.exceptions import ConfigurationError, DataError
from olmolike.testing import TinyCausalLM
from olmolike.train import BasicTrainModule, Callback, Duration, TrainerConfig

SEQ = 4
INSTANCES = 50


@pytest.fixture
def dataset(tmp_path: Path) -> NumpyFSLDataset:
    """Instance ``i`` holds tokens ``[i*SEQ, (i+1)*SEQ)``: its first token names it."""
    np.save(tmp_path / "tokens.npy", np.arange(INSTANCES * SEQ, dtype=np.uint16))
    return NumpyDatasetConfig(paths=[str(tmp_path / "tokens.npy")], sequence_length=SEQ).build()


def build(dataset: NumpyFSLDataset, instances: int = 4, **options: object) -> NumpyDataLoader:
    config = NumpyDataLoaderConfig(global_batch_size=instances * SEQ, seed=7)
    return config.replace(**options).build(dataset, dp_rank=0, dp_world_size=1)  # type: ignore[arg-type]


def rows(batches: object) -> list[list[int]]:
    """Each batch as the instances it holds, checking the batch's own index field."""
    out = []
    for batch in batches:  # type: ignore[attr-defined]
        ids = (batch["input_ids"][:, 0] // SEQ).tolist()
        assert batch["index"].tolist() == ids and batch["input_ids"].dtype == torch.int64
        out.append(ids)
    return out


def epoch(loader: NumpyDataLoader, number: int) -> list[list[int]]:
    loader.reshuffle(number)
    return rows(loader)


def test_an_epoch_is_a_seeded_permutation_in_global_batch_windows(dataset: NumpyFSLDataset) -> None:
    loader = build(dataset)
    assert loader.total_batches == 12  # 50 // 4; the last 2 instances wait for another epoch
    first = epoch(loader, 1)
    expected = np.random.default_rng(7 + 1).permutation(INSTANCES)[:48].reshape(12, 4)
    assert first == expected.tolist()
    assert epoch(build(dataset), 1) == first  # reproducible
    assert epoch(build(dataset), 2) != first  # reshuffled per epoch
    assert epoch(build(dataset, seed=8), 1) != first
    flat = [i for batch in epoch(build(dataset, shuffle=False), 1) for i in batch]
    assert flat == list(range(48))


def test_two_ranks_partition_each_global_batch(dataset: NumpyFSLDataset) -> None:
    whole = epoch(build(dataset), 3)
    config = NumpyDataLoaderConfig(global_batch_size=4 * SEQ, seed=7)
    ranks = [epoch(config.build(dataset, dp_rank=r, dp_world_size=2), 3) for r in (0, 1)]
    for full, zero, one in zip(whole, *ranks, strict=True):
        assert len(zero) == len(one) == 2 and zero + one == full


@pytest.mark.parametrize(
    "workers", [0, pytest.param(2, marks=[pytest.mark.slow, pytest.mark.timeout(120)])]
)
def test_resume_continues_at_exactly_the_next_batch(dataset: NumpyFSLDataset, workers: int) -> None:
    uninterrupted = epoch(build(dataset, num_workers=workers), 2)
    loader = build(dataset, num_workers=workers)
    loader.reshuffle(2)
    batches = iter(loader)
    seen = rows(next(batches) for _ in range(5))
    state = loader.state_dict()
    assert state["instances_consumed"] == 20 and state["epoch"] == 2
    resumed = build(dataset, num_workers=workers)
    resumed.load_state_dict(state)
    resumed.reshuffle(2)  # the trainer does this on start; it keeps the position
    assert seen + rows(resumed) == uninterrupted


@pytest.mark.parametrize("factor", [2, 0.5])
def test_a_batch_size_changed_by_an_integer_factor_continues_the_same_order(
    dataset: NumpyFSLDataset, factor: float
) -> None:
    order = [i for batch in epoch(build(dataset, instances=2), 1) for i in batch]
    loader = build(dataset)
    loader.reshuffle(1)
    batches = iter(loader)
    consumed = [i for _ in range(2) for i in rows([next(batches)])[0]]
    resized = build(dataset, instances=int(4 * factor))
    resized.load_state_dict(loader.state_dict())
    resized.reshuffle(1)
    rest = [i for batch in rows(resized) for i in batch]
    assert consumed + rest == order[: len(consumed) + len(rest)]
    assert len(consumed) + len(rest) == resized.total_batches * resized.instances_per_batch


def test_batch_size_changes_that_cannot_line_up_are_refused(dataset: NumpyFSLDataset) -> None:
    loader = build(dataset, instances=2)
    loader.reshuffle(1)
    next(iter(loader))  # 2 instances consumed
    with pytest.raises(DataError, match=r"consumed 2 instances.*global batch of 4"):
        build(dataset, instances=4).load_state_dict(loader.state_dict())
    with pytest.raises(DataError, match="from 2 to 3 instances, not by an integer factor"):
        build(dataset, instances=3).load_state_dict(loader.state_dict())


def test_other_data_or_seed_is_refused(
    dataset: NumpyFSLDataset, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    loader = build(dataset)
    loader.reshuffle(1)
    batches = iter(loader)
    next(batches)
    state = loader.state_dict()
    with pytest.raises(DataError, match="seed was 7 in the checkpoint but is 8"):
        build(dataset, seed=8).load_state_dict(state)
    np.save(tmp_path / "other.npy", np.arange(60 * SEQ, dtype=np.uint16))
    other = NumpyDatasetConfig(paths=[str(tmp_path / "other.npy")], sequence_length=SEQ).build()
    with pytest.raises(DataError, match=r"different dataset.*ignore_fingerprint_mismatch=True"):
        build(other).load_state_dict(state)
    tolerant = build(other, ignore_fingerprint_mismatch=True)
    with caplog.at_level(logging.WARNING):
        tolerant.load_state_dict(state)
    assert "differs from the checkpoint" in caplog.text
    assert tolerant.batches_processed == 1 and tolerant.epoch == 1  # from the saved position


def test_batch_size_must_fill_whole_instances_on_every_rank(dataset: NumpyFSLDataset) -> None:
    with pytest.raises(ConfigurationError, match=r"multiple of .* 4 x 2 = 8 tokens, got 12"):
        NumpyDataLoaderConfig(global_batch_size=12).build(dataset, dp_rank=0, dp_world_size=2)
    with pytest.raises(DataError, match="fewer than one global batch"):
        build(dataset, instances=64)
    with pytest.raises(ConfigurationError, match="num_workers"):
        NumpyDataLoaderConfig(global_batch_size=8, num_workers=-1)


def test_mock_batch_has_this_ranks_shape(dataset: NumpyFSLDataset) -> None:
    config = NumpyDataLoaderConfig(global_batch_size=8 * SEQ)
    mock = config.build(dataset, dp_rank=1, dp_world_size=2).get_mock_batch()
    assert mock["input_ids"].shape == (4, SEQ) and mock["input_ids"].dtype == torch.int64


def test_eval_batches_cover_every_instance_once_across_ranks(dataset: NumpyFSLDataset) -> None:
    per_rank = [rows(iter_eval_batches(dataset, 8, r, 3)) for r in range(3)]
    flat = [i for rank in per_rank for batch in rank for i in batch]
    assert flat == list(range(INSTANCES))
    assert [len(batch) for batch in per_rank[0]] == [8, 8]  # 50 * 1 // 3 = 16 instances
    assert [len(batch) for batch in per_rank[1]] == [8, 8, 1]  # instances 16..32: 17, last partial
    assert [len(batch) for batch in per_rank[2]] == [8, 8, 1]


@dataclass
class BatchRecorder(Callback):
    """Records which instances each step trained on, and cancels the run at a step."""

    seen: dict[int, list[int]] = field(default_factory=dict)
    cancel_at: int = 0

    def pre_step(self, batch: dict[str, Any]) -> None:
        self.seen[self.trainer.global_step] = batch["index"].tolist()

    def post_step(self) -> None:
        if self.trainer.global_step == self.cancel_at:
            self.trainer.cancel_run("interrupted for the test")


def fit(save: Path, dataset: NumpyFSLDataset, cancel_at: int = 0) -> dict[int, list[int]]:
    torch.manual_seed(0)
    model = TinyCausalLM(vocab_size=256, d_model=8, n_layers=1, n_heads=1, max_seq_len=SEQ)
    optim = torch.optim.AdamW(model.parameters())
    module = BasicTrainModule(model, optim, rank_microbatch_size=4 * SEQ)
    config = TrainerConfig(save_folder=str(save), max_duration=Duration.steps(7))
    trainer = config.build(module, build(dataset))
    recorder = BatchRecorder(cancel_at=cancel_at)
    trainer.add_callback("recorder", recorder)
    trainer.fit()
    return recorder.seen


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_trainer_resumes_the_data_exactly_across_an_epoch_boundary(tmp_path: Path) -> None:
    np.save(tmp_path / "small.npy", np.arange(22 * SEQ, dtype=np.uint16))
    small = NumpyDatasetConfig(paths=[str(tmp_path / "small.npy")], sequence_length=SEQ).build()
    full = fit(tmp_path / "full", small)
    first = fit(tmp_path / "split", small, cancel_at=6)  # in epoch 2: 5 batches an epoch
    second = fit(tmp_path / "split", small)
    assert sorted(first) == list(range(1, 7)) and sorted(second) == [7]
    assert {**first, **second} == full
    order = [np.random.default_rng(7 + e).permutation(22)[:20] for e in (1, 2)]
    assert [i for step in range(1, 8) for i in full[step]] == np.concatenate(order)[:28].tolist()


def test_data_with_more_token_ids_than_the_model_embeds_is_refused_at_build(
    tmp_path: Path,
) -> None:
    np.save(tmp_path / "tokens.npy", np.arange(INSTANCES * SEQ, dtype=np.uint16))
    data = NumpyDatasetConfig(
        paths=[str(tmp_path / "tokens.npy")], sequence_length=SEQ, vocab_size=300
    ).build()
    model = TinyCausalLM(vocab_size=256, d_model=8, n_layers=1, n_heads=1, max_seq_len=SEQ)
    module = BasicTrainModule(
        model, torch.optim.AdamW(model.parameters()), rank_microbatch_size=4 * SEQ
    )
    config = TrainerConfig(save_folder=str(tmp_path / "run"), max_duration=Duration.steps(1))
    with pytest.raises(ConfigurationError, match=r"model.vocab_size: .* 300 token ids .* only 256"):
        config.build(module, build(data))
