"""``prepare-data --dpo``: preference JSONL -> pair rows on disk, and reading them back.

The output folder holds ``train/pairs.npy`` and ``val/pairs.npy``: int32 arrays of shape
``(pairs, 4 * sequence_length)`` in the layout of
:func:`~olmolike.data.preference.encode_preference_pairs`, and ``metadata.json`` (written
last) with the tokenizer, the sequence length and the counts. :func:`load_preference_rows`
reads a split for :class:`~olmolike.data.preference.PreferenceDataLoader`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..exceptions import DataError
from ..io import removed_if_left_empty
from .chat_template import chat_template_for
from .numpy_dataset import METADATA_FILE
from .preference import PreferencePair, encode_preference_pairs, parse_preference_record
from .prepared_io import (
    SPLITS,
    abandon_output,
    begin_output,
    check_settings,
    finish_output,
    in_validation,
    read_jsonl,
    run_arguments,
    write_atomically,
)
from .sources import resolve_inputs
from .tokenizer import TokenizerConfig

__all__ = ["DPO_KIND", "load_preference_rows", "prepare_preference_data"]


DPO_KIND = "dpo"


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
    check_settings(val_fraction, sequence_length)
    out = Path(output_dir)
    resolved = (tokenizer or TokenizerConfig()).resolve()
    built = resolved.build()
    template = (
        built.chat_template
        if chat_template is None
        else chat_template_for(built.chat_template, chat_template)
    )
    sources = resolve_inputs(inputs, exclude=out)
    # Recorded in the arguments and again in the metadata, where readers look for them.
    layout = {"kind": DPO_KIND, "sequence_length": sequence_length}
    arguments = run_arguments(
        resolved,
        sources,
        **layout,
        chat_template=None if template is None else template.source,
        val_fraction=val_fraction,
        seed=seed,
    )
    # A refused preparation leaves nothing behind: no work folder, no empty folder.
    with removed_if_left_empty(out):
        finished = begin_output(out, arguments, overwrite)
        if finished is not None:
            return finished
        splits: dict[str, list[PreferencePair]] = {name: [] for name in SPLITS}
        for source in sources:
            for number, record in read_jsonl(source.path, name=source.name):
                pair = parse_preference_record(record, f"{source.name}, line {number}")
                splits[SPLITS[in_validation(seed, source.name, number, val_fraction)]].append(pair)
        if not splits["train"]:
            abandon_output(out)
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
            write_atomically(out / name / "pairs.npy", lambda f, a=array: np.save(f, a))
            labels = np.concatenate(
                [array[:, sequence_length : width // 2], array[:, 3 * sequence_length :]], 1
            )
            stats[name] = {"pairs": len(pairs), "scored_tokens": int((labels != -100).sum())}
        return finish_output(out, resolved, arguments, **layout, splits=stats)


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
