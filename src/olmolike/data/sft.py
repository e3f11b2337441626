"""``prepare-data --sft``: chat or prompt/completion JSONL -> fixed-length training sequences.

Each JSONL line is one example, either

* ``{"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}``, or
* ``{"prompt": "...", "completion": "..."}`` (a user turn and an assistant turn; both may also
  be lists of messages, as in TRL's conversational prompt-completion format).

The tokenizer's chat template renders the conversation; the tokens of the assistant's turns
(see :meth:`~olmolike.data.chat_template.ChatTemplate.assistant_spans`) are the only ones
trained on. Examples are then laid out in sequences of ``sequence_length`` tokens:

* ``packed``: several examples per sequence (best-fit decreasing, which leaves little
  padding); the model sees each one alone, through per-document attention and positions;
* ``padded``: one example per sequence, padded at the end.

Each split is three ``(sequences, sequence_length)`` arrays: ``input_ids``, ``label_mask``
(1 where a token is trained on) and ``doc_ids`` (the example's index within its sequence, -1
on padding). ``metadata.json``, written last, records counts and the padding fraction.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..config import StrEnum, check_choice
from ..exceptions import DataError
from ..io import removed_if_left_empty
from .chat_template import ChatTemplate, Message, chat_template_for, check_messages
from .prepared_io import (
    SPLITS,
    abandon_output,
    begin_output,
    check_settings,
    finish_output,
    in_validation,
    read_jsonl,
    run_arguments,
    token_dtype,
    write_atomically,
)
from .sources import Source, resolve_inputs
from .tokenizer import Tokenizer, TokenizerConfig

__all__ = ["OverlongPolicy", "PackingMode", "SFTExample", "prepare_sft_data", "tokenize_example"]


SFT_KIND = "sft"


class PackingMode(StrEnum):
    """How SFT examples are laid out in fixed-length training sequences."""

    packed = "packed"
    """Several examples per sequence, attention kept within each: little padding."""
    padded = "padded"
    """One example per sequence: simple, but short examples leave most of it as padding."""


class OverlongPolicy(StrEnum):
    """What happens to an SFT example longer than a training sequence."""

    error = "error"
    """An example longer than a sequence stops the run, naming its file and line."""
    truncate = "truncate"
    """Keep its first ``sequence_length`` tokens; dropped if none of them is trained on."""
    drop = "drop"
    """Leave it out. Truncated and dropped examples are counted in ``metadata.json``."""


@dataclass
class SFTExample:
    """One tokenized example: its ids and which of them are trained on."""

    ids: np.ndarray
    """The example's token ids, prompt and completion, in order."""
    trained: np.ndarray
    """One boolean per id: whether the loss is taken on it (the completion's tokens, not the
    prompt's)."""


# -- reading -----------------------------------------------------------------------------------


def _as_messages(value: Any, where: str, name: str) -> list[Message]:
    if isinstance(value, str):
        return [{"role": "assistant" if name == "completion" else "user", "content": value}]
    if isinstance(value, list):
        return list(value)
    raise DataError(f"{where}: {name!r} must be a string or a list of messages")


def _check_messages(messages: Any, where: str) -> list[Message]:
    """A conversation to train on: well formed, with a non-empty assistant turn."""
    for i, message in enumerate(check_messages(messages, where)):
        if message["role"] == "assistant" and not message["content"].strip():
            raise DataError(
                f"{where}: message {i} is an empty assistant turn (empty completion): there "
                "is nothing to train on; remove the example or fill in the completion"
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(
            f"{where}: the conversation has no assistant turn, so nothing to train on; add the "
            "assistant's answer or remove the example"
        )
    return messages


def read_examples(source: Source) -> Iterator[tuple[int, list[Message]]]:
    """``(line number, messages)`` of each non-blank line of a JSONL file, checked."""
    for line_number, record in read_jsonl(source.path, name=source.name):
        where = f"{source.name}, line {line_number}"
        if isinstance(record, dict) and "messages" in record:
            messages = record["messages"]
        elif isinstance(record, dict) and "prompt" in record and "completion" in record:
            messages = _as_messages(record["prompt"], where, "prompt") + _as_messages(
                record["completion"], where, "completion"
            )
        else:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise DataError(
                f"{where}: an SFT example needs 'messages' or 'prompt' and 'completion' "
                f"(found {keys})"
            )
        yield line_number, _check_messages(messages, where)


def tokenize_example(
    tokenizer: Tokenizer, template: ChatTemplate, messages: Sequence[Message], where: str = ""
) -> SFTExample:
    """Render ``messages``, tokenize the whole text once, and mark the tokens that start inside
    an assistant span. The first token is never trained on: nothing comes before it."""
    text, spans = template.assistant_spans(messages)
    ids, starts = tokenizer.encode_with_offsets(text)
    trained = np.zeros(len(ids), dtype=bool)
    offsets = np.asarray(starts, dtype=np.int64)
    for start, end in spans:
        trained |= (offsets >= start) & (offsets < end)
    if len(trained):
        trained[0] = False
    if not trained.any():
        raise DataError(
            f"{where}: the assistant's turns cover no token once rendered by the chat "
            "template; check the template renders the assistant's content"
        )
    return SFTExample(np.asarray(ids, dtype=np.int64), trained)


# -- layout ------------------------------------------------------------------------------------


def _pack(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing: example indices per sequence, longest first, each into the fullest
    sequence that still has room (ties broken by index, so the result is deterministic)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, bin), sorted
    for i in order:
        slot = bisect.bisect_left(free, (lengths[i], -1))
        if slot == len(free):
            bins.append([i])
            room, number = capacity - lengths[i], len(bins) - 1
        else:
            room, number = free.pop(slot)
            bins[number].append(i)
            room -= lengths[i]
        if room > 0:
            bisect.insort(free, (room, number))
    return bins


@dataclass
class _Split:
    examples: list[SFTExample] = field(default_factory=list)
    truncated: int = 0
    dropped: int = 0


def _layout(
    split: _Split, sequence_length: int, packing: PackingMode, pad_id: int, dtype: np.dtype
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    lengths = [len(e.ids) for e in split.examples]
    if packing == PackingMode.packed:
        groups = _pack(lengths, sequence_length)
    else:
        groups = [[i] for i in range(len(lengths))]
    shape = (len(groups), sequence_length)
    ids = np.full(shape, pad_id, dtype=dtype)
    mask = np.zeros(shape, dtype=np.uint8)
    docs = np.full(shape, -1, dtype=np.int32)
    for row, group in enumerate(groups):
        start = 0
        for doc, i in enumerate(group):
            example, end = split.examples[i], start + lengths[i]
            ids[row, start:end] = example.ids
            mask[row, start:end] = example.trained
            docs[row, start:end] = doc
            start = end
    padding = int((docs < 0).sum())
    stats = {
        "sequences": len(groups),
        "examples": len(lengths),
        "tokens": ids.size,
        "padding_tokens": padding,
        "padding_fraction": padding / ids.size if ids.size else 0.0,
        "trained_tokens": int(mask.sum()),
        "truncated": split.truncated,
        "dropped": split.dropped,
    }
    return {"input_ids": ids, "label_mask": mask, "doc_ids": docs}, stats


def _fit(
    example: SFTExample, sequence_length: int, overlong: OverlongPolicy, split: _Split, where: str
) -> None:
    if len(example.ids) <= sequence_length:
        split.examples.append(example)
        return
    if overlong == OverlongPolicy.error:
        raise DataError(
            f"{where}: the example has {len(example.ids)} tokens, more than sequence_length="
            f"{sequence_length}; raise --sequence-length, or pass --overlong truncate (keep "
            "the start) or --overlong drop (leave such examples out)"
        )
    kept = example.trained[:sequence_length]
    if overlong == OverlongPolicy.drop or not kept.any():
        split.dropped += 1
        return
    split.truncated += 1
    split.examples.append(SFTExample(example.ids[:sequence_length], kept))


def prepare_sft_data(
    inputs: Sequence[str | Path],
    output_dir: str | Path,
    *,
    sequence_length: int,
    tokenizer: TokenizerConfig | None = None,
    chat_template: str | None = None,
    packing: PackingMode = PackingMode.packed,
    overlong: OverlongPolicy = OverlongPolicy.error,
    val_fraction: float = 0.0,
    seed: int = 0,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Prepare SFT sequences under ``output_dir`` (see the module docstring); returns the
    metadata. ``chat_template`` (a Jinja file) replaces the tokenizer's template."""
    check_settings(val_fraction, sequence_length)
    packing = check_choice(packing, PackingMode, "packing")
    overlong = check_choice(overlong, OverlongPolicy, "overlong")
    out = Path(output_dir)
    resolved = (tokenizer or TokenizerConfig()).resolve()
    built = resolved.build()
    template = chat_template_for(built.chat_template, chat_template)
    assert resolved.vocab_size is not None
    dtype = token_dtype(resolved.vocab_size)
    sources = resolve_inputs(inputs, exclude=out)
    # Recorded in the arguments and again in the metadata, where readers look for them.
    layout = {"kind": SFT_KIND, "sequence_length": sequence_length, "packing": packing.value}
    arguments = run_arguments(
        resolved,
        sources,
        **layout,
        chat_template=template.source,
        overlong=overlong.value,
        val_fraction=val_fraction,
        seed=seed,
    )
    # A refused preparation leaves nothing behind: no work folder, no empty folder.
    with removed_if_left_empty(out):
        finished = begin_output(out, arguments, overwrite)
        if finished is not None:
            return finished
        splits = {name: _Split() for name in SPLITS}
        for source in sources:
            for line_number, messages in read_examples(source):
                where = f"{source.name}, line {line_number}"
                example = tokenize_example(built, template, messages, where)
                split = splits[SPLITS[in_validation(seed, source.name, line_number, val_fraction)]]
                _fit(example, sequence_length, overlong, split, where)
        if not splits["train"].examples:
            abandon_output(out)
            raise DataError(f"no training example in {', '.join(map(str, inputs))}")
        stats = {}
        for name, split in splits.items():
            arrays, stats[name] = _layout(
                split, sequence_length, packing, built.pad_token_id, dtype
            )
            (out / name).mkdir(parents=True, exist_ok=True)
            for key, array in arrays.items():
                write_atomically(out / name / f"{key}.npy", lambda f, a=array: np.save(f, a))
        return finish_output(out, resolved, arguments, **layout, dtype=dtype.name, splits=stats)
