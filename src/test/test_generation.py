"""Sampling: greedy decoding, top-k/top-p, EOS handling, context cropping, determinism."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from olmolike.nn import TransformerConfig, export_hf, generate
from olmolike.nn.generation import filter_logits, sample
from olmolike.nn.kv_cache import KVCache

VOCAB = 37


@pytest.fixture(scope="module")
def model() -> nn.Module:
    config = TransformerConfig(
        vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, max_sequence_length=16
    )
    return config.build(seed=0)


def prompt(batch: int = 2, length: int = 4) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(0))


def argmax_loop(model: nn.Module, ids: torch.Tensor, steps: int, context: int = 16) -> torch.Tensor:
    for _ in range(steps):
        with torch.no_grad():
            next_ids = model(ids[:, -context:])[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat((ids, next_ids), dim=-1)
    return ids


def test_greedy_equals_an_argmax_loop(model: nn.Module) -> None:
    ids = prompt()
    out = generate(model, ids, max_new_tokens=6, temperature=0)
    assert out.shape == (2, 10)
    assert torch.equal(out, argmax_loop(model, ids, 6))


def test_top_k_one_and_tiny_top_p_are_greedy(model: nn.Module) -> None:
    ids = prompt()
    greedy = generate(model, ids, max_new_tokens=5, temperature=0)
    top_k = generate(model, ids, max_new_tokens=5, top_k=1, generator=torch.Generator())
    top_p = generate(model, ids, max_new_tokens=5, top_p=1e-6, generator=torch.Generator())
    assert torch.equal(top_k, greedy)
    assert torch.equal(top_p, greedy)


def test_sampling_is_deterministic_given_a_generator(model: nn.Module) -> None:
    ids = prompt()

    def sample(seed: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        return generate(model, ids, max_new_tokens=12, temperature=2.0, generator=generator)

    assert torch.equal(sample(1), sample(1))
    assert not torch.equal(sample(1), sample(2))


def test_top_k_and_top_p_restrict_the_candidates() -> None:
    """Every sampled token must come from the allowed set, across many draws."""
    model = Fixed(torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0, -1.0]))
    generator = torch.Generator().manual_seed(0)
    ids = torch.zeros(64, 1, dtype=torch.long)
    top_k = generate(model, ids, max_new_tokens=8, top_k=2, generator=generator)[:, 1:]
    assert set(top_k.unique().tolist()) == {0, 1}
    # Probabilities are about 0.64, 0.24, 0.09, ...: the first two reach 0.8, three reach 0.9.
    top_p = generate(model, ids, max_new_tokens=8, top_p=0.8, generator=generator)[:, 1:]
    assert set(top_p.unique().tolist()) == {0, 1}
    top_p = generate(model, ids, max_new_tokens=8, top_p=0.9, generator=generator)[:, 1:]
    assert set(top_p.unique().tolist()) == {0, 1, 2}


@dataclass
class _Config:
    max_sequence_length: int


class Successor(nn.Module):
    """Always predicts (last token + 1) mod vocab, and records the context lengths it saw."""

    def __init__(self, vocab: int = 10, context: int = 100) -> None:
        super().__init__()
        self.vocab = vocab
        self.config = _Config(context)
        self.seen_lengths: list[int] = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.seen_lengths.append(ids.shape[1])
        return nn.functional.one_hot((ids + 1) % self.vocab, self.vocab).float() * 10


class Fixed(nn.Module):
    """The same next-token logits whatever the input."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.logits.expand(*ids.shape, -1)


def test_stops_at_eos_and_pads_finished_rows() -> None:
    out = generate(
        Successor(), torch.tensor([2, 3]), max_new_tokens=10, temperature=0, eos_token_id=6
    )
    assert out.tolist() == [2, 3, 4, 5, 6]
    batch = torch.tensor([[4], [1]])
    out = generate(Successor(), batch, max_new_tokens=10, temperature=0, eos_token_id=6)
    assert out.tolist() == [[4, 5, 6, 6, 6, 6], [1, 2, 3, 4, 5, 6]]


def test_context_is_cropped_to_max_sequence_length(model: nn.Module) -> None:
    successor = Successor(context=5)
    out = generate(successor, torch.tensor([0, 1, 2]), max_new_tokens=6, temperature=0)
    assert out.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert successor.seen_lengths == [3, 4, 5, 5, 5, 5]
    # The transformer itself refuses inputs longer than 16: cropping must keep it working.
    assert generate(model, prompt(1, 12), max_new_tokens=10, temperature=0).shape == (1, 22)


def test_restores_training_mode_and_records_no_gradients(model: nn.Module) -> None:
    model.train()
    out = generate(model, prompt(), max_new_tokens=2)
    assert model.training
    assert not out.requires_grad
    model.eval()
    generate(model, prompt(), max_new_tokens=2)
    assert not model.training


def test_one_dimensional_prompt_gives_one_dimensional_output(model: nn.Module) -> None:
    ids = prompt()
    single = generate(model, ids[0], max_new_tokens=3, temperature=0)
    assert single.dim() == 1
    assert torch.equal(single, generate(model, ids, max_new_tokens=3, temperature=0)[0])
    assert torch.equal(generate(model, ids[0], max_new_tokens=0), ids[0])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_invalid_arguments(kwargs: dict[str, float], match: str) -> None:
    args = {"max_new_tokens": 1, **kwargs}
    with pytest.raises(ValueError, match=match):
        generate(Successor(), torch.tensor([1]), **args)  # type: ignore[arg-type]


def test_empty_prompt_is_an_error() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        generate(Successor(), torch.zeros(2, 0, dtype=torch.long), max_new_tokens=1)


# -- the KV cache -----------------------------------------------------------------------------


def config(**overrides: object) -> TransformerConfig:
    shape: dict[str, object] = dict(
        vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, max_sequence_length=64
    )
    return TransformerConfig(**{**shape, **overrides})  # type: ignore[arg-type]


@pytest.mark.parametrize("overrides", [{}, {"n_kv_heads": 2, "qk_norm": True}])
def test_cached_logits_equal_the_full_forward(overrides: dict[str, object]) -> None:
    model = config(**overrides).build(seed=1).eval()
    ids = prompt(3, 12)
    full = model(ids)
    cache = KVCache(batch_size=3, capacity=12, n_layers=2)
    chunks = [model(ids[:, :5], cache=cache)]  # a prefill, then one token at a time
    chunks += [model(ids[:, t : t + 1], cache=cache) for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(chunks, 1), full, atol=1e-5, rtol=0)
    assert cache.length == 12


def test_left_padded_logits_equal_each_sequence_alone() -> None:
    model = config().build(seed=2).eval()
    short, long = prompt(1, 3)[0], (prompt(1, 7)[0] + 1) % VOCAB
    ids = torch.stack((torch.cat((torch.zeros(4, dtype=torch.long), short)), long))
    valid = torch.stack((torch.arange(7) >= 4, torch.ones(7, dtype=torch.bool)))
    cache = KVCache(batch_size=2, capacity=9, n_layers=2)
    cache.set_padding(valid)
    logits = model(ids, cache=cache)[:, -1]
    next_logits = model(torch.tensor([[5], [6]]), cache=cache)[:, -1]
    for row, alone in enumerate((short, long)):
        extended = torch.cat((alone, torch.tensor([5 + row])))[None]
        torch.testing.assert_close(logits[row], model(alone[None])[0, -1], atol=1e-5, rtol=0)
        torch.testing.assert_close(next_logits[row], model(extended)[0, -1], atol=1e-5, rtol=0)


def test_cache_refuses_overflow_and_positions_past_the_model() -> None:
    model = config(max_sequence_length=8).build(seed=0)
    cache = KVCache(batch_size=1, capacity=4, n_layers=2)
    model(prompt(1, 3), cache=cache)
    with pytest.raises(ValueError, match="cannot add"):
        model(prompt(1, 2), cache=cache)
    with pytest.raises(ValueError, match="rotary positions"):
        model(prompt(1, 1), cache=KVCache(batch_size=1, capacity=9, n_layers=2))


def test_cached_greedy_equals_uncached_greedy() -> None:
    model = config(n_kv_heads=2).build(seed=3)
    ids = prompt(3, 6)
    cached = sample(model, ids, max_new_tokens=40, temperature=0)
    uncached = sample(model, ids, max_new_tokens=40, temperature=0, use_cache=False)
    assert cached.completion_ids.shape == (3, 40)
    assert torch.equal(cached.completion_ids, uncached.completion_ids)
    assert torch.equal(cached.completion_ids, argmax_loop(model, ids, 40, context=64)[:, 6:])


@pytest.mark.parametrize("use_cache", [True, False])
def test_left_padded_batch_equals_each_sequence_alone(use_cache: bool) -> None:
    model = config().build(seed=4)
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [30]]
    batch = sample(model, prompts, max_new_tokens=12, temperature=0, use_cache=use_cache)
    assert batch.prompt_mask.sum(-1).tolist() == [3, 9, 1]
    for row, one in enumerate(prompts):
        alone = sample(model, [one], max_new_tokens=12, temperature=0, use_cache=use_cache)
        assert torch.equal(batch.completion_ids[row], alone.completion_ids[0])


def test_cache_refill_past_the_context_matches_a_cropped_restart() -> None:
    """When the cache is full, it restarts from the last 3/4 of the context: the next token
    is then exactly what a model run on that cropped context predicts."""
    model = config(max_sequence_length=8).build(seed=5)
    out = sample(model, prompt(1, 6), max_new_tokens=4, temperature=0)
    tokens = out.sequences[0]
    assert len(tokens) == 10
    with torch.no_grad():  # the cache filled at 8 slots; the 10th token came from slots 2..8
        assert int(model(tokens[None, 2:9])[0, -1].argmax()) == int(tokens[9])


def test_stop_tokens_per_sequence() -> None:
    out = sample(
        Successor(),
        torch.tensor([[1], [4], [0]]),
        max_new_tokens=6,
        temperature=0,
        stop_token_ids=[[3], [6, 9], []],
        pad_token_id=0,
    )
    assert out.completion_ids.tolist() == [
        [2, 3, 0, 0, 0, 0],
        [5, 6, 0, 0, 0, 0],
        [1, 2, 3, 4, 5, 6],
    ]
    assert out.completion_lengths.tolist() == [2, 2, 6]
    assert out.stopped.tolist() == [True, True, False]
    assert out.completions() == [[2], [5], [1, 2, 3, 4, 5, 6]]
    assert out.completions(include_stop=True)[:2] == [[2, 3], [5, 6]]
    # A shared list applies to every row; sampling ends once all rows have stopped.
    shared = sample(Successor(), torch.tensor([[1], [2]]), max_new_tokens=9, stop_token_ids=[4])
    assert shared.completion_ids.tolist() == [[2, 3, 4], [3, 4, 0]]
    with pytest.raises(ValueError, match="one list per prompt"):
        sample(Successor(), torch.tensor([[1]]), max_new_tokens=1, stop_token_ids=[[1], [2]])


def test_a_transformer_row_stops_while_the_others_continue() -> None:
    model = config().build(seed=6)
    ids = prompt(2, 4)
    free = sample(model, ids, max_new_tokens=10, temperature=0).completion_ids
    stop = int(free[0, 3])
    assert stop not in free[0, :3].tolist()
    out = sample(model, ids, max_new_tokens=10, temperature=0, stop_token_ids=[[stop], []])
    assert out.completion_mask[0].tolist() == [True] * 4 + [False] * 6
    assert torch.equal(out.completion_ids[0, :4], free[0, :4])
    assert torch.equal(out.completion_ids[1], free[1])


def test_seeded_cached_sampling_is_reproducible() -> None:
    model = config().build(seed=7)

    def draw(seed: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        return sample(
            model, [[1, 2], [3]], max_new_tokens=20, top_k=10, top_p=0.9, generator=generator
        ).completion_ids

    assert torch.equal(draw(1), draw(1))
    assert not torch.equal(draw(1), draw(2))


def test_filter_logits_on_crafted_logits() -> None:
    # softmax([4, 3, 2, 1, 0, -1]) ~ 0.64, 0.24, 0.09, 0.03, 0.01, 0.004
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0], [-1.0, 0.0, 1.0, 2.0, 3.0, 4.0]])

    def kept(**kwargs: float) -> list[list[int]]:
        out = filter_logits(logits, **kwargs)  # type: ignore[arg-type]
        return [torch.isfinite(row).nonzero().flatten().tolist() for row in out]

    assert kept(top_k=2) == [[0, 1], [4, 5]]
    assert kept(top_p=0.5) == [[0], [5]]  # the top token alone already reaches 0.5
    assert kept(top_p=0.8) == [[0, 1], [4, 5]]
    assert kept(top_p=0.9) == [[0, 1, 2], [3, 4, 5]]
    assert kept(top_k=2, top_p=0.9) == [[0, 1], [4, 5]]
    assert kept(top_k=100, top_p=1.0) == [[0, 1, 2, 3, 4, 5]] * 2
    # Kept logits are unchanged: the survivors keep their relative probabilities.
    assert filter_logits(logits, top_k=3)[0, :3].tolist() == [4.0, 3.0, 2.0]


def test_vocab_size_limits_the_sampled_ids() -> None:
    model = Fixed(torch.tensor([0.0, 0.0, 9.0, 9.0]))
    out = sample(model, torch.zeros(8, 1, dtype=torch.long), max_new_tokens=5, vocab_size=2)
    assert set(out.completion_ids.unique().tolist()) <= {0, 1}


def test_unequal_prompts_need_a_transformer() -> None:
    with pytest.raises(ValueError, match="different lengths"):
        sample(Successor(), [[1, 2], [3]], max_new_tokens=1)
    with pytest.raises(ValueError, match="non-empty"):
        sample(Successor(), [[1], []], max_new_tokens=1)


def test_left_padded_cached_greedy_equals_transformers_generate(tmp_path: Path) -> None:
    """An independent implementation of left-padded cached decoding: Hugging Face's."""
    transformers = pytest.importorskip("transformers")
    ours = config(n_kv_heads=2, rope_theta=1000.0).build(seed=8).eval()
    out = export_hf(ours.state_dict(), ours.config, tmp_path / "hf")
    theirs = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    prompts = [[3, 4, 5, 6, 7, 8], [9, 10], [11, 12, 13, 14]]
    batch = sample(ours, prompts, max_new_tokens=15, temperature=0, pad_token_id=0)
    with torch.no_grad():
        hf = theirs.generate(
            input_ids=batch.prompt_ids,
            attention_mask=batch.prompt_mask.long(),
            max_new_tokens=15,
            min_new_tokens=15,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    assert torch.equal(batch.completion_ids, hf[:, batch.prompt_ids.shape[1] :])
