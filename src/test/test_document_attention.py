"""Packed sequences: each document's logits equal its logits alone (fp32)."""

from __future__ import annotations

import torch

from olmolike.nn import TransformerConfig
from olmolike.nn.rope import document_attention


def _model(**overrides: object) -> torch.nn.Module:
    config = TransformerConfig(
        vocab_size=97, d_model=32, n_layers=2, n_heads=4, max_sequence_length=64, **overrides
    )
    return config.build(seed=3).eval()


def test_positions_restart_and_mask_stays_inside_documents() -> None:
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 2, -1, -1]])
    positions, mask = document_attention(doc_ids)
    assert positions.tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]
    assert mask.shape == (1, 1, 8, 8)
    expected = torch.zeros(8, 8, dtype=torch.bool)
    for start, end in ((0, 3), (3, 5), (5, 6), (6, 8)):
        expected[start:end, start:end] = torch.ones(end - start, end - start).tril().bool()
    assert torch.equal(mask[0, 0], expected)


def test_packed_logits_equal_each_document_alone() -> None:
    for overrides in ({}, {"n_kv_heads": 2, "qk_norm": True}):
        model = _model(**overrides)
        generator = torch.Generator().manual_seed(0)
        lengths = [(7, 12, 5, 8), (20, 3, 9)]  # the second row ends with padding
        rows, doc_rows = [], []
        docs: list[list[torch.Tensor]] = []
        for row_lengths in lengths:
            parts = [torch.randint(0, 97, (n,), generator=generator) for n in row_lengths]
            docs.append(parts)
            pad = 32 - sum(row_lengths)
            rows.append(torch.cat([*parts, torch.zeros(pad, dtype=torch.long)]))
            ids = [torch.full((n,), i) for i, n in enumerate(row_lengths)]
            doc_rows.append(torch.cat([*ids, torch.full((pad,), -1)]))
        with torch.no_grad():
            packed = model(torch.stack(rows), doc_ids=torch.stack(doc_rows))
            for row, parts in enumerate(docs):
                start = 0
                for part in parts:
                    alone = model(part.unsqueeze(0))[0]
                    got = packed[row, start : start + len(part)]
                    torch.testing.assert_close(got, alone, atol=1e-5, rtol=0)
                    start += len(part)
            # Without doc_ids a packed row is one document: the later documents then differ.
            unmasked = model(torch.stack(rows))
        assert (unmasked[0, 7:19] - packed[0, 7:19]).abs().max() > 1e-3


def test_one_document_per_row_matches_the_causal_path() -> None:
    model = _model()
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(ids)
        with_docs = model(ids, doc_ids=torch.zeros_like(ids))
    torch.testing.assert_close(with_docs, plain, atol=1e-5, rtol=0)
