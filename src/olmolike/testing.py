"""Small, fast building blocks for testing trainers and callbacks (yours and ours)."""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["TinyCausalLM", "random_token_instances"]


class TinyCausalLM(nn.Module):
    """A pre-norm causal transformer built from ``nn.TransformerEncoderLayer``.

    Deterministic on CPU (no dropout), about 1 M parameters at the defaults; maps ``input_ids``
    ``(B, T)`` to logits ``(B, T, vocab_size)``.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        d_model: int = 128,
        n_layers: int = 4,
        n_heads: int = 4,
        max_seq_len: int = 512,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_seq_len, d_model)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                d_model, n_heads, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True
            )
            for _ in range(n_layers)
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seq_len = input_ids.shape[1]
        positions = torch.arange(seq_len, device=input_ids.device)
        x = self.embed(input_ids) + self.pos(positions)
        mask = nn.Transformer.generate_square_subsequent_mask(seq_len, device=input_ids.device)
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.head(self.norm(x))


def random_token_instances(
    num_instances: int, seq_len: int, vocab_size: int = 256, seed: int = 0
) -> torch.Tensor:
    """``(num_instances, seq_len)`` int64 token ids with some learnable structure.

    Each instance counts up from a random start (mod ``vocab_size``) with occasional random
    tokens, so the loss falls quickly when training works.
    """
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, vocab_size, (num_instances, 1), generator=generator)
    tokens = (starts + torch.arange(seq_len)) % vocab_size
    noise = torch.rand(num_instances, seq_len, generator=generator) < 0.1
    random_tokens = torch.randint(0, vocab_size, (num_instances, seq_len), generator=generator)
    return torch.where(noise, random_tokens, tokens)
