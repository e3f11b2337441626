"""StagedDataLoader: each stage's loader for its steps, exact resume on either side."""

from __future__ import annotations

import pytest
import torch

from olmolike.data import StagedDataLoader, TokenTensorDataLoader
from olmolike.exceptions import ConfigurationError, DataError
from olmolike.testing import random_token_instances

SEQ = 4


def loader(seed: int, count: int = 8, **kwargs: int) -> TokenTensorDataLoader:
    data = random_token_instances(count, SEQ, 50, seed=seed)
    return TokenTensorDataLoader(data, global_batch_size=2 * SEQ, seed=seed, **kwargs)


def staged(**kwargs: int) -> StagedDataLoader:
    return StagedDataLoader([(loader(1, **kwargs), 6), (loader(2, **kwargs), None)])


def take(data_loader: StagedDataLoader | TokenTensorDataLoader, count: int) -> list[torch.Tensor]:
    if data_loader.epoch is None:
        data_loader.reshuffle(1)
    it = iter(data_loader)
    return [next(it)["input_ids"] for _ in range(count)]


def epochs(single: TokenTensorDataLoader, count: int) -> list[torch.Tensor]:
    """``count`` batches of ``single`` over as many epochs as it takes."""
    out: list[torch.Tensor] = []
    epoch = 1
    while len(out) < count:
        single.reshuffle(epoch)
        out += [b["input_ids"] for b in single][: count - len(out)]
        epoch += 1
    return out


def test_each_stage_serves_its_steps_from_its_own_loader() -> None:
    got = take(staged(), 10)
    # Stage 1 (4 batches an epoch) runs into its second epoch; stage 2 starts at its beginning.
    want = epochs(loader(1), 6) + epochs(loader(2), 4)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert staged().total_batches is None
    assert StagedDataLoader([(loader(1), 2), (loader(2), 3)]).total_batches == 5


@pytest.mark.parametrize("stop", [0, 3, 4, 5, 6, 7, 9])
def test_resume_is_exact_before_at_and_after_the_boundary(stop: int) -> None:
    want = take(staged(), 12)
    first = staged()
    take(first, stop)
    state = first.state_dict()
    second = staged()
    second.load_state_dict(state)
    second.reshuffle(state["epoch"])  # as the trainer does
    got = take(second, 12 - stop)
    assert all(torch.equal(g, w) for g, w in zip(got, want[stop:], strict=True))


def test_ranks_take_their_slices_of_each_stage() -> None:
    whole = take(staged(), 8)
    parts = [take(staged(dp_world_size=2, dp_rank=r), 8) for r in (0, 1)]
    for batch, a, b in zip(whole, *parts, strict=True):
        assert torch.equal(batch, torch.cat([a, b]))


def test_bad_stages_name_the_fix() -> None:
    with pytest.raises(ConfigurationError, match="only the last stage may run until"):
        StagedDataLoader([(loader(1), None), (loader(2), 3)])
    other = TokenTensorDataLoader(
        random_token_instances(8, SEQ, 50, seed=3), global_batch_size=4 * SEQ
    )
    with pytest.raises(ConfigurationError, match="same batch size and ranks"):
        StagedDataLoader([(loader(1), 2), (other, None)])
    state = staged().state_dict()
    with pytest.raises(DataError, match="set the stages back"):
        StagedDataLoader([(loader(1), 5), (loader(2), None)]).load_state_dict(state)
