"""``prepare-data --dpo``: preference JSONL -> pair rows on disk, and reading them back.

The output folder holds ``train/pairs.npy`` and ``val/pairs.npy``: int32 arrays of shape
``(pairs, 4 * sequence_length)`` in the layout of
:func:`~olmolike.data.preference.encode_preference_pairs`, and ``metadata.json`` (written
last) with the tokenizer, the sequence length and the counts. :func:`load_preference_rows`
reads a split for :class:`~olmolike.data.preference.PreferenceDataLoader`.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..exceptions import DataError
from .numpy_dataset import METADATA_FILE
from .preference import PreferencePair, encode_preference_pairs, parse_preference_record
from .prepare import (
    FORMAT_VERSION,
    SPLITS,
    _begin_output,
    _finish_output,
    _in_validation,
    _write_atomically,
)
from .sft import _template
from .sources import resolve_inputs
from .tokenizer import TokenizerConfig

__all__ = ["DPO_KIND", "load_preference_rows", "prepare_preference_data"]

log = logging.getLogger(__name__)

DPO_KIND = "dpo"


def _read_pairs(path: Path, name: str) -> list[tuple[int, PreferencePair]]:
    pairs = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{name}, line {number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{where}: not valid JSON ({e}); each line must be one JSON object"
                ) from None
            pairs.append((number, parse_preference_record(record, where)))
    return pairs


def prepare_preference_data(
    inputs: Sequence[str | Path],
    output_dir: str | Path,
    *,
    sequence_length: int,
    tokenizer: TokenizerConfig | None = None,
    chat_template: str | None = None,
    val_fraction: float = 0.0,
    seed: int = 0,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Encode the preference JSONL ``inputs`` into pair rows under ``output_dir``; returns the
    metadata. ``chat_template`` (a Jinja file) replaces the tokenizer's template."""
    if sequence_length < 2:
        raise DataError(f"sequence_length must be at least 2, got {sequence_length}")
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction must be in [0, 1), got {val_fraction}")
    out = Path(output_dir)
    resolved = (tokenizer or TokenizerConfig()).resolve()
    built = resolved.build()
    template = built.chat_template if chat_template is None else _template(built, chat_template)
    sources = resolve_inputs(inputs, exclude=out)
    arguments = {
        "format_version": FORMAT_VERSION,
        "kind": DPO_KIND,
        "tokenizer": resolved.as_config_dict(),
        "chat_template": None if template is None else template.source,
        "sequence_length": sequence_length,
        "val_fraction": val_fraction,
        "seed": seed,
        "sources": [{"path": s.name, "bytes": s.size} for s in sources],
    }
    finished = _begin_output(out, arguments, overwrite)
    if finished is not None:
        return finished
    splits: dict[str, list[PreferencePair]] = {name: [] for name in SPLITS}
    for source in sources:
        for number, pair in _read_pairs(source.path, source.name):
            splits[SPLITS[_in_validation(seed, source.name, number, val_fraction)]].append(pair)
    if not splits["train"]:
        raise DataError(f"no preference pair in {', '.join(map(str, inputs))}")
    stats = {}
    width = 4 * sequence_length
    for name, pairs in splits.items():
        rows = (
            encode_preference_pairs(pairs, built, sequence_length, template=template)
            if pairs
            else torch.empty(0, width, dtype=torch.int64)
        )
        array = rows.numpy().astype(np.int32)
        (out / name).mkdir(parents=True, exist_ok=True)
        _write_atomically(out / name / "pairs.npy", lambda f, a=array: np.save(f, a))
        labels = np.concatenate(
            [array[:, sequence_length : width // 2], array[:, 3 * sequence_length :]], 1
        )
        stats[name] = {"pairs": len(pairs), "scored_tokens": int((labels != -100).sum())}
    ids = ("vocab_size", "eos_token_id", "pad_token_id", "bos_token_id")
    metadata = {
        "format_version": FORMAT_VERSION,
        "kind": DPO_KIND,
        "tokenizer": resolved.identifier,
        **{name: getattr(resolved, name) for name in ids},
        "sequence_length": sequence_length,
        "splits": stats,
        "arguments": arguments,
    }
    return _finish_output(out, metadata)


def load_preference_rows(folder: str | Path, split: str = "train") -> torch.Tensor:
    """The pair rows of one split of a ``prepare-data --dpo`` folder (int32, in memory)."""
    folder = Path(folder)
    meta_path = folder / METADATA_FILE
    if not meta_path.is_file():
        raise DataError(
            f"{folder} holds no {METADATA_FILE}; make it with olmolike prepare-data --dpo"
        )
    metadata = json.loads(meta_path.read_text())
    if metadata.get("kind") != DPO_KIND:
        raise DataError(
            f"{folder} holds {metadata.get('kind') or 'pretraining'} data, not preference pairs; "
            "prepare the preference JSONL with olmolike prepare-data --dpo"
        )
    if not metadata["splits"].get(split, {}).get("pairs"):
        raise DataError(
            f"{folder} has no {split!r} pairs; prepare it with --val-fraction > 0 for a "
            "validation split"
        )
    return torch.from_numpy(np.load(folder / split / "pairs.npy"))


def run_dpo_command(args: argparse.Namespace, inputs: list[str | Path]) -> int:
    """``olmolike prepare-data --dpo``."""
    if args.sequence_length is None:
        raise DataError("--dpo needs --sequence-length: the length of each side of a pair")
    metadata = prepare_preference_data(
        inputs,
        args.output,
        sequence_length=args.sequence_length,
        tokenizer=TokenizerConfig(identifier=args.tokenizer),
        chat_template=args.chat_template,
        val_fraction=args.val_fraction,
        seed=args.seed,
        overwrite=args.overwrite,
    )
    for split, stats in metadata["splits"].items():
        print(
            f"{split}: {stats['pairs']:,d} pairs of {metadata['sequence_length']} tokens a side, "
            f"{stats['scored_tokens']:,d} response tokens scored"
        )
    print(f"metadata: {Path(args.output) / METADATA_FILE}")
    return 0
