"""TokenTensorDataLoader: rank slicing, seeded order, exact resume, input checks."""

from __future__ import annotations

import pytest
import torch

from olmolike.data import TokenTensorDataLoader
from olmolike.exceptions import ConfigurationError, DataError

SEQ = 4


def instances(n: int = 20) -> torch.Tensor:
    return torch.arange(n * SEQ).reshape(n, SEQ)


def loader(**kwargs: object) -> TokenTensorDataLoader:
    options: dict = {"global_batch_size": 4 * SEQ, "dp_world_size": 1, "dp_rank": 0, "seed": 3}
    options.update(kwargs)
    return TokenTensorDataLoader(instances(), **options)


def epoch_rows(dl: TokenTensorDataLoader, epoch: int) -> list[list[int]]:
    dl.reshuffle(epoch)
    rows = [batch["input_ids"][:, 0].tolist() for batch in dl]
    dl.reset()
    return rows


def test_epoch_covers_each_instance_once_and_drops_the_remainder() -> None:
    dl = loader(global_batch_size=3 * SEQ)
    assert dl.total_batches == 6
    rows = [r for batch in epoch_rows(dl, 1) for r in batch]
    assert len(rows) == 18 and len(set(rows)) == 18


def test_order_is_seeded_by_seed_and_epoch() -> None:
    assert epoch_rows(loader(), 1) == epoch_rows(loader(), 1)
    assert epoch_rows(loader(), 1) != epoch_rows(loader(), 2)
    assert epoch_rows(loader(), 1) != epoch_rows(loader(seed=4), 1)
    unshuffled = epoch_rows(loader(shuffle=False), 1)
    assert [r for b in unshuffled for r in b] == [i * SEQ for i in range(20)]


def test_ranks_split_each_global_batch_disjointly() -> None:
    whole = epoch_rows(loader(), 1)
    rank0 = epoch_rows(loader(dp_world_size=2, dp_rank=0), 1)
    rank1 = epoch_rows(loader(dp_world_size=2, dp_rank=1), 1)
    for full, a, b in zip(whole, rank0, rank1):
        assert a + b == full


def test_a_batch_size_change_mid_epoch_reads_on_at_the_same_position_on_every_rank() -> None:
    (order,) = epoch_rows(loader(global_batch_size=20 * SEQ), 1)  # the whole epoch's order

    def rank_rows(rank: int) -> list[list[int]]:
        dl = loader(global_batch_size=2 * SEQ, dp_world_size=2, dp_rank=rank)
        dl.reshuffle(1)
        batches = iter(dl)
        rows = [next(batches)["input_ids"][:, 0].tolist() for _ in range(2)]
        dl.global_batch_size = 4 * SEQ  # 4 of the 20 instances read
        return rows + [batch["input_ids"][:, 0].tolist() for batch in batches]

    for rank in (0, 1):
        small = [[order[2 * b + rank]] for b in range(2)]
        large = [order[4 + 4 * b + 2 * rank : 6 + 4 * b + 2 * rank] for b in range(4)]
        assert rank_rows(rank) == small + large


def test_a_batch_edited_in_place_leaves_the_data_and_the_next_epoch_alone() -> None:
    dl = loader(shuffle=False)
    dl.reshuffle(1)
    for batch in dl:
        batch["input_ids"].zero_()
    dl.reset()
    assert torch.equal(dl.instances, instances())
    assert [r for b in epoch_rows(dl, 2) for r in b] == [i * SEQ for i in range(20)]


def test_state_dict_resumes_at_the_next_batch() -> None:
    dl = loader()
    dl.reshuffle(2)
    it = iter(dl)
    seen = [next(it)["input_ids"] for _ in range(2)]
    state = dl.state_dict()
    rest = [b["input_ids"] for b in it]
    assert state["batches_processed"] == 2 and state["tokens_processed"] == 2 * 4 * SEQ

    resumed = loader()
    resumed.load_state_dict(state)
    resumed.reshuffle(2)  # the trainer calls this; it must keep the position
    again = [b["input_ids"] for b in resumed]
    assert len(seen) + len(again) == 5
    assert all(torch.equal(a, b) for a, b in zip(rest, again))


def test_state_from_other_data_or_settings_is_refused() -> None:
    state = loader().state_dict()
    other = TokenTensorDataLoader(
        instances() + 1, global_batch_size=4 * SEQ, dp_world_size=1, dp_rank=0, seed=3
    )
    with pytest.raises(DataError, match="different token data"):
        other.load_state_dict(state)
    with pytest.raises(DataError, match="seed"):
        loader(seed=5).load_state_dict(state)


@pytest.mark.parametrize("size", [0, 3, 5 * SEQ + 1])
def test_global_batch_size_must_fit_the_geometry(size: int) -> None:
    with pytest.raises(ConfigurationError, match="global_batch_size"):
        loader(global_batch_size=size)
    with pytest.raises(ConfigurationError, match="global_batch_size"):
        loader(global_batch_size=2 * SEQ, dp_world_size=4, dp_rank=0)


def test_bad_inputs_are_clear_errors() -> None:
    with pytest.raises(DataError, match="non-empty"):
        TokenTensorDataLoader(
            torch.zeros(0, 4, dtype=torch.long), global_batch_size=4, dp_world_size=1, dp_rank=0
        )
    with pytest.raises(DataError, match="integer"):
        TokenTensorDataLoader(torch.zeros(4, 4), global_batch_size=4, dp_world_size=1, dp_rank=0)
    with pytest.raises(ConfigurationError, match="dp_rank"):
        loader(dp_world_size=2, dp_rank=2)
    with pytest.raises(RuntimeError, match="reshuffle"):
        next(iter(loader()))


def test_mock_batch_has_the_rank_shape() -> None:
    assert loader(dp_world_size=2, dp_rank=1).get_mock_batch()["input_ids"].shape == (2, SEQ)
