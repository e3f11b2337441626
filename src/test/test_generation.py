"""Sampling: greedy decoding, top-k/top-p, EOS handling, context cropping, determinism."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn

from olmolike.nn import TransformerConfig, generate

VOCAB = 37


@pytest.fixture(scope="module")
def model() -> nn.Module:
    config = TransformerConfig(
        vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, max_sequence_length=16
    )
    return config.build(seed=0)


def prompt(batch: int = 2, length: int = 4) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(0))


def argmax_loop(model: nn.Module, ids: torch.Tensor, steps: int) -> torch.Tensor:
    for _ in range(steps):
        with torch.no_grad():
            next_ids = model(ids[:, -16:])[:, -1].argmax(-1, keepdim=True)
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
