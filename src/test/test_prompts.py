"""Prompt JSONL records, the per-rank resumable prompt sampler, and its data loader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from olmolike.data.prompts import PromptDataLoader, PromptRecord, PromptSampler, read_prompt_jsonl
from olmolike.exceptions import ConfigurationError, DataError


def write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_records_keep_their_fields(tmp_path: Path) -> None:
    lines = [
        json.dumps({"prompt": "1+2=", "answer": "3", "level": 1}),
        "",
        json.dumps({"q": "x", "prompt": "a"}),
    ]
    records = read_prompt_jsonl(write(tmp_path, lines))
    assert records == [
        PromptRecord("1+2=", {"answer": "3", "level": 1}),
        PromptRecord("a", {"q": "x"}),
    ]
    other = read_prompt_jsonl(
        write(tmp_path, [json.dumps({"question": "q?"})]), prompt_key="question"
    )
    assert other == [PromptRecord("q?", {})]


@pytest.mark.parametrize(
    ("lines", "match"),
    [
        (['{"prompt": "a"}', "{oops"], "line 2: not valid JSON"),
        (['["prompt"]'], "line 1: expected a JSON object"),
        (['{"answer": "3"}'], "line 1: needs a non-empty string 'prompt'.*answer"),
        (['{"prompt": 3}'], "needs a non-empty string"),
        (['{"prompt": "a", "completions": 1}'], "'completions' would shadow"),
        ([""], "holds no prompt records"),
    ],
)
def test_bad_records_name_the_line(tmp_path: Path, lines: list[str], match: str) -> None:
    with pytest.raises(DataError, match=match):
        read_prompt_jsonl(write(tmp_path, lines))


def records(n: int) -> list[PromptRecord]:
    return [PromptRecord(f"p{i}") for i in range(n)]


def prompts(sampler: PromptSampler, batches: int) -> list[list[str]]:
    return [[r.prompt for r in sampler.next_batch()] for _ in range(batches)]


def test_ranks_get_disjoint_prompts_and_every_epoch_is_a_new_order() -> None:
    data = records(10)  # 2 ranks x 2 prompts: 2 batches per epoch, 2 prompts dropped
    rank0 = prompts(PromptSampler(data, prompts_per_rank=2, seed=3, rank=0, world_size=2), 4)
    rank1 = prompts(PromptSampler(data, prompts_per_rank=2, seed=3, rank=1, world_size=2), 4)
    for epoch in (0, 1):
        seen = [
            p
            for batch in rank0[2 * epoch : 2 * epoch + 2] + rank1[2 * epoch : 2 * epoch + 2]
            for p in batch
        ]
        assert len(seen) == len(set(seen)) == 8
    assert rank0[:2] != rank0[2:]
    assert prompts(PromptSampler(data, prompts_per_rank=2, seed=4, world_size=2), 2) != rank0[:2]


def test_sampler_resumes_exactly() -> None:
    data = records(7)
    straight = prompts(PromptSampler(data, prompts_per_rank=3, seed=1), 6)
    first = PromptSampler(data, prompts_per_rank=3, seed=1)
    head = prompts(first, 4)
    resumed = PromptSampler(data, prompts_per_rank=3, seed=1)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert head + prompts(resumed, 2) == straight
    with pytest.raises(ConfigurationError, match="same seed"):
        PromptSampler(data, prompts_per_rank=3, seed=2).load_state_dict(first.state_dict())


def test_sampler_guards() -> None:
    with pytest.raises(DataError, match="cannot fill one batch"):
        PromptSampler(records(3), prompts_per_rank=2, world_size=2)
    with pytest.raises(ConfigurationError, match="prompts_per_rank"):
        PromptSampler(records(3), prompts_per_rank=0)


def loader_prompts(loader: PromptDataLoader, epoch: int) -> list[list[str]]:
    loader.reshuffle(epoch)
    return [[r.prompt for r in batch["records"]] for batch in loader]


def test_loader_deals_the_sampler_order_and_resumes_exactly() -> None:
    data = records(10)
    ranks = [PromptDataLoader(data, prompts_per_rank=2, seed=3, dp_world_size=2, dp_rank=r)
             for r in (0, 1)]  # fmt: skip
    samplers = [
        PromptSampler(data, prompts_per_rank=2, seed=3, rank=r, world_size=2) for r in (0, 1)
    ]
    for loader, sampler in zip(ranks, samplers):
        assert loader.global_batch_size == 4 and loader.total_batches == 2
        assert loader_prompts(loader, 1) + loader_prompts(loader, 2) == prompts(sampler, 4)
    first = PromptDataLoader(data, prompts_per_rank=2, seed=3, dp_world_size=2, dp_rank=1)
    first.reshuffle(2)
    batch = next(iter(first))
    assert batch["input_ids"].shape == (2, 1)
    assert [data[i] for i in batch["input_ids"][:, 0].tolist()] == batch["records"]
    resumed = PromptDataLoader(data, prompts_per_rank=2, seed=3, dp_world_size=2, dp_rank=1)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    fresh = PromptDataLoader(data, prompts_per_rank=2, seed=3, dp_world_size=2, dp_rank=1)
    assert loader_prompts(resumed, 2) == loader_prompts(fresh, 2)[1:]
    with pytest.raises(DataError, match="different prompts"):
        PromptDataLoader(records(9), prompts_per_rank=2).load_state_dict(first.state_dict())
    with pytest.raises(DataError, match="seed"):
        PromptDataLoader(
            data, prompts_per_rank=2, seed=4, dp_world_size=2, dp_rank=1
        ).load_state_dict(first.state_dict())
