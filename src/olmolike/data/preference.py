"""Preference pairs for DPO: JSONL (``prompt``, ``chosen``, ``rejected``) to token rows.

A record is plain text, ``{"prompt": "...", "chosen": "...", "rejected": "..."}`` (the
response follows the prompt directly and gets an end-of-sequence token), or a conversation:
``prompt`` a list of ``{"role", "content"}`` messages (or a string: one user turn) and
``chosen`` / ``rejected`` the assistant's reply as a message list (or a string); without a
``prompt``, ``chosen`` and ``rejected`` are whole conversations that differ only in their last
message. Conversations are rendered with the tokenizer's chat template, and only the tokens of
the reply's assistant turns (see
:meth:`~olmolike.data.chat_template.ChatTemplate.assistant_spans`) are scored.

Each pair becomes one int64 row of width ``4 * seq_len``, the concatenation of

    chosen input ids | chosen labels | rejected input ids | rejected labels

where labels are the next-token targets, ``-100`` on the prompt and on padding. Keeping a pair
in one row lets :class:`PreferenceDataLoader` reuse :class:`TokenTensorDataLoader`'s seeded
shuffling, rank slicing and exact resume unchanged; it splits the rows back and stacks chosen
over rejected, so the train module scores both in one forward. ``olmolike prepare-data
--dpo`` writes such rows to disk (:mod:`olmolike.data.preference_prepare`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..exceptions import DataError
from .chat_template import ChatTemplate, Message, check_messages
from .data_loader import Batch, TokenTensorDataLoader
from .prepared_io import read_jsonl
from .tokenizer import Tokenizer

__all__ = [
    "PreferenceDataLoader",
    "PreferencePair",
    "encode_preference_pairs",
    "parse_preference_record",
    "read_preference_jsonl",
    "split_pair_rows",
]

log = logging.getLogger(__name__)

IGNORE_INDEX = -100

Text = str | list[Message]


@dataclass(frozen=True)
class PreferencePair:
    """One preference record, read and checked: a prompt, the chosen and the rejected reply."""

    prompt: Text
    """The prompt: plain text, or the messages of a conversation."""
    chosen: Text
    """The preferred reply: text, or messages."""
    rejected: Text
    """The reply preferred less: text, or messages."""
    where: str
    """``file:line`` of the record, for error messages."""

    @property
    def is_chat(self) -> bool:
        """Whether the pair is a conversation (rendered with the chat template)."""
        return any(isinstance(part, list) for part in (self.prompt, self.chosen, self.rejected))


def _text(value: Any, where: str, key: str) -> Text:
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: '{key}' must be a string or a non-empty list of messages")
    return check_messages(value, where, key)


def parse_preference_record(record: Any, where: str) -> PreferencePair:
    """A checked :class:`PreferencePair` from one parsed JSONL record."""
    if not isinstance(record, dict) or not {"chosen", "rejected"} <= record.keys():
        raise DataError(f"{where}: a preference record needs 'chosen' and 'rejected'")
    chosen = _text(record["chosen"], where, "chosen")
    rejected = _text(record["rejected"], where, "rejected")
    if "prompt" in record:
        prompt = _text(record["prompt"], where, "prompt")
    elif isinstance(chosen, list) and isinstance(rejected, list) and chosen[:-1] == rejected[:-1]:
        prompt, chosen, rejected = chosen[:-1], chosen[-1:], rejected[-1:]
    else:
        raise DataError(
            f"{where}: without a 'prompt', 'chosen' and 'rejected' must be conversations that "
            "differ only in their last message; add the shared 'prompt'"
        )
    if not prompt:
        raise DataError(
            f"{where}: the prompt is empty; the first response token needs at least one prompt "
            "token to be predicted from"
        )
    if chosen == rejected:
        raise DataError(
            f"{where}: 'chosen' and 'rejected' are identical, so the pair states no "
            "preference; remove it or fix the rejected response"
        )
    return PreferencePair(prompt, chosen, rejected, where)


def read_preference_jsonl(path: str | Path) -> list[PreferencePair]:
    """Read preference records, one per line; blank lines skipped."""
    pairs = [
        parse_preference_record(record, f"{path}, line {number}")
        for number, record in read_jsonl(path)
    ]
    if not pairs:
        raise DataError(f"{path} holds no preference records")
    return pairs


def _as_messages(value: Text, role: str) -> list[Message]:
    return [{"role": role, "content": value}] if isinstance(value, str) else value


def _tokenize_side(
    pair: PreferencePair, response: Text, tokenizer: Tokenizer, template: ChatTemplate | None
) -> tuple[list[int], np.ndarray]:
    """Token ids of prompt + response and which of them are the response's."""
    if not pair.is_chat:
        assert isinstance(pair.prompt, str) and isinstance(response, str)
        prompt_ids = tokenizer.encode(pair.prompt)
        reply_ids = [*tokenizer.encode(response), tokenizer.eos_token_id]
        return prompt_ids + reply_ids, np.arange(len(prompt_ids) + len(reply_ids)) >= len(
            prompt_ids
        )
    if template is None:
        raise DataError(
            f"{pair.where}: the pair is a conversation but the tokenizer has no chat "
            "template; put a tokenizer_config.json with a 'chat_template' beside its "
            "tokenizer.json, or pass --chat-template FILE.jinja"
        )
    prompt, reply = _as_messages(pair.prompt, "user"), _as_messages(response, "assistant")
    text, spans = template.assistant_spans([*prompt, *reply])
    replies = sum(m.get("role") == "assistant" for m in reply)
    ids, starts = tokenizer.encode_with_offsets(text)
    offsets = np.asarray(starts, dtype=np.int64)
    trained = np.zeros(len(ids), dtype=bool)
    for start, end in spans[len(spans) - replies :] if replies else []:
        trained |= (offsets >= start) & (offsets < end)
    if not trained.any():
        raise DataError(
            f"{pair.where}: the response has no assistant turn once rendered by the chat "
            "template; give 'chosen' and 'rejected' an assistant message"
        )
    return ids, trained


def _encode_side(
    ids: list[int], trained: np.ndarray, seq_len: int, pad: int
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Input ids and labels of one side: label ``t`` is token ``t + 1`` if it is trained."""
    full = torch.tensor(ids[: seq_len + 1])
    keep = torch.from_numpy(trained[1 : seq_len + 1])
    input_ids = torch.full((seq_len,), pad, dtype=torch.int64)
    labels = torch.full((seq_len,), IGNORE_INDEX, dtype=torch.int64)
    input_ids[: len(full) - 1] = full[:-1]
    labels[: len(full) - 1] = torch.where(keep, full[1:], IGNORE_INDEX)
    return input_ids, labels, len(ids) > seq_len + 1


def encode_preference_pairs(
    pairs: list[PreferencePair],
    tokenizer: Tokenizer,
    seq_len: int,
    *,
    template: ChatTemplate | None = None,
) -> torch.Tensor:
    """Token rows ``(num_pairs, 4 * seq_len)`` (see the module docstring).

    Conversations are rendered with ``template`` (default: the tokenizer's). A response is cut
    to fit ``seq_len``; a prompt that leaves no room for a response token, an empty prompt,
    or a pair whose chosen and rejected responses are identical (no preference to learn) is
    an error naming the record.
    """
    template = template or tokenizer.chat_template
    rows = []
    truncated = 0
    for pair in pairs:
        if pair.chosen == pair.rejected:
            raise DataError(
                f"{pair.where}: 'chosen' and 'rejected' are identical, so the pair states no "
                "preference; remove it or fix the rejected response"
            )
        sides = [_tokenize_side(pair, r, tokenizer, template) for r in (pair.chosen, pair.rejected)]
        if sides[0][0] == sides[1][0]:
            raise DataError(
                f"{pair.where}: 'chosen' and 'rejected' encode to the same tokens, so the pair "
                "states no preference; remove it or fix the rejected response"
            )
        parts = []
        for ids, trained in sides:
            prompt_tokens = int(np.argmax(trained))
            if prompt_tokens == 0:
                raise DataError(
                    f"{pair.where}: the prompt is empty; the first response token needs at "
                    "least one prompt token to be predicted from"
                )
            if prompt_tokens >= seq_len:
                raise DataError(
                    f"{pair.where}: the prompt has {prompt_tokens} tokens, leaving no room for "
                    f"a response in sequences of {seq_len}; raise seq_len (--sequence-length) "
                    "or shorten the prompt"
                )
            input_ids, labels, cut = _encode_side(ids, trained, seq_len, tokenizer.pad_token_id)
            truncated += cut
            parts += [input_ids, labels]
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

    def _make_batch(self, rows: torch.Tensor, order: torch.Tensor, window: slice) -> Batch:
        return {**split_pair_rows(rows), "index": order[window]}


def split_pair_rows(rows: torch.Tensor) -> Batch:
    """``input_ids`` and ``labels`` (int64) of pair rows, chosen stacked over rejected."""
    if rows.shape[1] % 4:
        raise DataError(f"preference rows must be 4 * seq_len wide, got {rows.shape[1]}")
    c_ids, c_labels, r_ids, r_labels = rows.long().chunk(4, dim=1)
    return {"input_ids": torch.cat([c_ids, r_ids]), "labels": torch.cat([c_labels, r_labels])}
