"""Preference pairs for DPO: JSONL (``prompt``, ``chosen``, ``rejected``) to token rows.

Each pair becomes one int64 row of width ``4 * seq_len``, the concatenation of

    chosen input ids | chosen labels | rejected input ids | rejected labels

where labels are the next-token targets, ``-100`` on the prompt and on padding, so only the
response tokens (and the closing end-of-sequence token) are scored. Keeping a pair in one row
lets :class:`PreferenceDataLoader` reuse :class:`TokenTensorDataLoader`'s seeded shuffling,
rank slicing and exact resume unchanged; it splits the rows back and stacks chosen over
rejected, so the train module scores both in one forward.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..exceptions import DataError
from .data_loader import Batch, TokenTensorDataLoader
from .tokenizer import Tokenizer

__all__ = [
    "PreferenceDataLoader",
    "PreferencePair",
    "encode_preference_pairs",
    "read_preference_jsonl",
    "split_pair_rows",
]

log = logging.getLogger(__name__)

IGNORE_INDEX = -100


@dataclass(frozen=True)
class PreferencePair:
    prompt: str
    chosen: str
    rejected: str
    where: str
    """``file:line`` of the record, for error messages."""


def _response_text(value: Any, where: str, key: str) -> str:
    if isinstance(value, str):
        return value
    # Chat style: a list of messages; the response is the assistant's content.
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        replies = [m.get("content", "") for m in value if m.get("role") == "assistant"]
        if replies:
            return "".join(str(r) for r in replies)
    raise DataError(
        f"{where}: '{key}' must be a string or a list of messages with an assistant reply, "
        f"got {type(value).__name__}"
    )


def _prompt_text(record: dict[str, Any], where: str) -> str:
    prompt = record.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):  # chat messages before the reply
        return "".join(f"{m.get('role', '')}: {m.get('content', '')}\n" for m in prompt)
    raise DataError(f"{where}: a preference record needs a 'prompt' string or message list")


def read_preference_jsonl(path: str | Path) -> list[PreferencePair]:
    """Read ``{"prompt", "chosen", "rejected"}`` records, one per line; blank lines skipped."""
    pairs: list[PreferencePair] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e})") from e
            if not isinstance(record, dict) or not {"chosen", "rejected"} <= record.keys():
                raise DataError(f"{where}: a preference record needs 'chosen' and 'rejected'")
            pairs.append(
                PreferencePair(
                    prompt=_prompt_text(record, where),
                    chosen=_response_text(record["chosen"], where, "chosen"),
                    rejected=_response_text(record["rejected"], where, "rejected"),
                    where=where,
                )
            )
    if not pairs:
        raise DataError(f"{path} holds no preference records")
    return pairs


def _encode_side(
    prompt: list[int], response: list[int], seq_len: int, pad: int
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    full = (prompt + response)[: seq_len + 1]
    truncated = len(prompt) + len(response) > seq_len + 1
    ids = torch.full((seq_len,), pad, dtype=torch.int64)
    labels = torch.full((seq_len,), IGNORE_INDEX, dtype=torch.int64)
    ids[: len(full) - 1] = torch.tensor(full[:-1])
    targets = torch.tensor(full[1:])
    # Position t predicts token t + 1: only targets inside the response are trained.
    trained = torch.arange(len(full) - 1) >= len(prompt) - 1
    labels[: len(full) - 1] = torch.where(trained, targets, IGNORE_INDEX)
    return ids, labels, truncated


def encode_preference_pairs(
    pairs: list[PreferencePair], tokenizer: Tokenizer, seq_len: int
) -> torch.Tensor:
    """Token rows ``(num_pairs, 4 * seq_len)`` (see the module docstring).

    A response gets the end-of-sequence token appended and is cut to fit ``seq_len``; a prompt
    that leaves no room for a response token, an empty prompt, or a pair whose chosen and
    rejected responses are identical (no preference to learn) is an error naming the record.
    """
    rows = []
    truncated = 0
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    for pair in pairs:
        if pair.chosen == pair.rejected:
            raise DataError(
                f"{pair.where}: 'chosen' and 'rejected' are identical, so the pair states no "
                "preference; remove it or fix the rejected response"
            )
        prompt = tokenizer.encode(pair.prompt)
        if not prompt:
            raise DataError(
                f"{pair.where}: the prompt is empty; the first response token "
                "needs at least one prompt token to be predicted from"
            )
        if len(prompt) >= seq_len:
            raise DataError(
                f"{pair.where}: the prompt has {len(prompt)} tokens, leaving no room for a "
                f"response in sequences of {seq_len}; raise seq_len or shorten the prompt"
            )
        parts = []
        for response in (pair.chosen, pair.rejected):
            ids, labels, cut = _encode_side(
                prompt, [*tokenizer.encode(response), eos], seq_len, pad
            )
            truncated += cut
            parts += [ids, labels]
        rows.append(torch.cat(parts))
    if truncated:
        log.warning(
            "%d of %d responses were cut to fit %d tokens", truncated, 2 * len(pairs), seq_len
        )
    return torch.stack(rows)


class PreferenceDataLoader(TokenTensorDataLoader):
    """Pairs from :func:`encode_preference_pairs`, batched chosen-over-rejected.

    ``global_batch_size`` counts the stored rows' tokens: ``pairs per step * 4 * seq_len``.
    Each batch holds ``input_ids`` and ``labels`` of shape ``(2 * P, seq_len)``: the ``P``
    chosen responses of this rank, then their ``P`` rejected ones, in the same order; and
    ``index``, the ``P`` pairs' rows in ``instances`` (what precomputed reference log-probs
    are looked up by).
    """

    def _make_batch(self, rows: torch.Tensor, indices: torch.Tensor) -> Batch:
        return {**split_pair_rows(rows), "index": indices}


def split_pair_rows(rows: torch.Tensor) -> Batch:
    """``input_ids`` and ``labels`` (int64) of pair rows, chosen stacked over rejected."""
    if rows.shape[1] % 4:
        raise DataError(f"preference rows must be 4 * seq_len wide, got {rows.shape[1]}")
    c_ids, c_labels, r_ids, r_labels = rows.long().chunk(4, dim=1)
    return {"input_ids": torch.cat([c_ids, r_ids]), "labels": torch.cat([c_labels, r_labels])}
