"""Sampling from DDP- and FSDP2-wrapped models on 2 gloo ranks, each rank with its own prompts,
and from a tensor-parallel model (TP=2 x FSDP=2 on 4 ranks).

Rank 0's sequences stop after a few tokens, rank 1's run to ``max_new_tokens``: with FSDP2
every forward call gathers parameters, so rank 0 must keep stepping until rank 1 is done (a
rank that stopped early would leave the other blocked in a gather, and the test would time
out). Every rank's tokens must equal those of an unwrapped copy of the model.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from testutils import run_distributed_test

from olmolike.distributed.parallel import apply_ddp, apply_fsdp
from olmolike.nn import TransformerConfig
from olmolike.nn.generation import sample

CONFIG = TransformerConfig(vocab_size=41, d_model=32, n_layers=2, n_heads=4, max_sequence_length=48)
NEW_TOKENS = 12


def rank_prompts(rank: int) -> list[list[int]]:
    return [[1, 2, 3], [4, 5, 6, 7, 8]] if rank == 0 else [[9, 10], [11], [12, 13, 14, 15]]


def draw(model: torch.nn.Module, rank: int, stop: list[int] | None, seed: int | None) -> Any:
    generator = None if seed is None else torch.Generator().manual_seed(seed + rank)
    return sample(
        model,
        rank_prompts(rank),
        max_new_tokens=NEW_TOKENS,
        temperature=0 if seed is None else 1.0,
        top_k=20,
        stop_token_ids=stop,
        generator=generator,
    )


def sample_wrapped(wrapper: str) -> dict[str, Any]:
    rank = dist.get_rank()
    reference = CONFIG.build(seed=0)
    model = CONFIG.build(seed=0)
    if wrapper == "fsdp":
        apply_fsdp(model, dist.device_mesh.init_device_mesh("cpu", (2,)))
        wrapped: torch.nn.Module = model
    else:
        wrapped = apply_ddp(model)
    calls: list[int] = []
    model.register_forward_hook(lambda *_: calls.append(1))
    # Rank 0 stops on the 3rd token its greedy continuations produce: it finishes early.
    free = draw(reference, rank, None, None)
    stop = sorted({int(t) for t in free.completion_ids[:, 2]}) if rank == 0 else None
    greedy = draw(wrapped, rank, stop, None)
    expected = draw(reference, rank, stop, None)
    sampled = [draw(wrapped, rank, None, seed=5).completion_ids for _ in range(2)]
    return {
        "equal": torch.equal(greedy.completion_ids, expected.completion_ids),
        "lengths": greedy.completion_lengths.tolist(),
        "calls": len(calls),
        "reproducible": torch.equal(sampled[0], sampled[1]),
        "sampled_matches_reference": torch.equal(
            sampled[0], draw(reference, rank, None, seed=5).completion_ids
        ),
    }


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
def test_two_ranks_sample_their_own_prompts(wrapper: str) -> None:
    ranks = run_distributed_test(sample_wrapped, args=(wrapper,), timeout=180)
    for result in ranks:
        assert result["equal"] and result["reproducible"], result
        assert result["sampled_matches_reference"], result
    # Rank 0 stopped early (all its sequences within 3 tokens), rank 1 ran all 12 steps.
    assert max(ranks[0]["lengths"]) <= 3 and ranks[1]["lengths"] == [NEW_TOKENS] * 3
    if wrapper == "fsdp":  # lockstep: as many forward calls on both ranks (12 per greedy run)
        assert ranks[0]["calls"] == ranks[1]["calls"] == 3 * NEW_TOKENS
    else:  # DDP samples from the local replica: rank 0 saves its steps
        assert ranks[0]["calls"] < ranks[1]["calls"]


def mismatched_steps() -> str:
    model = CONFIG.build(seed=0)
    apply_fsdp(model, dist.device_mesh.init_device_mesh("cpu", (2,)))
    try:
        sample(model, [[1, 2]], max_new_tokens=3 + dist.get_rank())
    except ValueError as e:
        return str(e)
    return "no error"


def test_fsdp_refuses_different_max_new_tokens_on_each_rank() -> None:
    for message in run_distributed_test(mismatched_steps, timeout=120):
        assert "max_new_tokens differs across ranks" in message


def first_token_stops() -> dict[str, Any]:
    rank = dist.get_rank()
    model, alone = CONFIG.build(seed=0), CONFIG.build(seed=0)
    apply_fsdp(model, dist.device_mesh.init_device_mesh("cpu", (2,)))
    calls: list[int] = []
    model.register_forward_hook(lambda *_: calls.append(1))
    # Every token stops rank 0's sequences: they all end with their first token.
    stop = list(range(CONFIG.vocab_size)) if rank == 0 else None

    def run(m: torch.nn.Module) -> tuple[Any, torch.Tensor]:
        generator = torch.Generator().manual_seed(7 + rank)
        out = sample(
            m, rank_prompts(rank), max_new_tokens=NEW_TOKENS, stop_token_ids=stop,
            generator=generator,
        )  # fmt: skip
        return out, generator.get_state()

    (sharded, state), (expected, expected_state) = run(model), run(alone)
    return {
        "lengths": sharded.completion_lengths.tolist(),
        "equal": torch.equal(sharded.completion_ids, expected.completion_ids),
        "same_draws": torch.equal(state, expected_state),
        "calls": len(calls),
    }


@pytest.mark.slow
def test_a_rank_stopped_at_the_first_token_steps_on_without_sampling() -> None:
    """Rank 0 keeps calling the sharded model until rank 1 is done, but draws nothing more
    from its generator: its output and random state are those of sampling alone."""
    ranks = run_distributed_test(first_token_stops, timeout=180)
    assert ranks[0]["lengths"] == [1, 1] and ranks[1]["lengths"] == [NEW_TOKENS] * 3
    assert ranks[0]["calls"] == ranks[1]["calls"] == NEW_TOKENS
    for result in ranks:
        assert result["equal"] and result["same_draws"], result


TP_CONFIG = TransformerConfig(
    vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, qk_norm=True,
    block_type="reordered_norm", max_sequence_length=24,
)  # fmt: skip


def sample_tensor_parallel() -> dict[str, Any]:
    """Each data-parallel rank samples its own prompts from a TP=2 x FSDP=2 model; the ranks of
    a tensor-parallel group pass the same prompts and seed (as GRPO does)."""
    from olmolike.distributed.mesh import ParallelDegrees, build_device_mesh
    from olmolike.nn.parallel_plan import apply_tensor_parallel

    degrees = ParallelDegrees.resolve(4, tp=2)
    mesh = build_device_mesh(degrees, "cpu")
    model, alone = TP_CONFIG.build(seed=0), TP_CONFIG.build(seed=0)
    apply_tensor_parallel(model, mesh["tp"])
    apply_fsdp(model, mesh["dp_shard"])
    dp_rank = degrees.dp_rank(dist.get_rank())
    prompts = rank_prompts(dp_rank)

    def run(m: torch.nn.Module, seed: int | None) -> torch.Tensor:
        generator = None if seed is None else torch.Generator().manual_seed(seed + dp_rank)
        out = sample(
            m, prompts, max_new_tokens=NEW_TOKENS, temperature=0 if seed is None else 1.0,
            top_p=0.9, vocab_size=60, generator=generator,
        )  # fmt: skip
        return out.completion_ids

    return {
        "dp_rank": dp_rank,
        "greedy": run(model, None),
        "greedy_alone": run(alone, None),
        "sampled": run(model, 11),
        "sampled_alone": run(alone, 11),
    }


@pytest.mark.slow
def test_a_tensor_parallel_model_samples_what_one_process_samples() -> None:
    """Greedy and seeded sampling through the split attention (the KV cache holds each rank's
    heads) and the vocabulary-sharded head give one process's tokens, on every rank."""
    ranks = run_distributed_test(sample_tensor_parallel, 4, timeout=240)
    assert [r["dp_rank"] for r in ranks] == [0, 0, 1, 1]
    for result in ranks:
        for kind in ("greedy", "sampled"):
            assert torch.equal(result[kind], result[f"{kind}_alone"]), (result["dp_rank"], kind)
    # The data-parallel ranks sampled their own prompts: different completions.
    assert ranks[0]["sampled"].shape != ranks[2]["sampled"].shape or not torch.equal(
        ranks[0]["sampled"], ranks[2]["sampled"]
    )
