"""What every kind of ``prepare-data`` shares: reading JSONL input, and writing an output folder.

Three preparations write folders (token shards, SFT sequences, preference pairs), and each
reads JSONL (so do GRPO's prompt files). They share one protocol, kept here so that none of
them imports another:

* :func:`begin_output` claims the folder for one set of arguments (recorded in
  ``.prepare/args.json`` before any work), so a rerun with other inputs or settings is refused
  instead of mixing two datasets, and a rerun with the same ones finds the finished metadata;
* every file is written under a temporary name and renamed (:func:`write_atomically`), so a
  killed run leaves whole files or none;
* :func:`finish_output` writes ``metadata.json`` last: it marks the folder complete;
* a document's split is a hash of what identifies it (:func:`in_validation`): the same in every
  run and for any number of workers.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from .. import io
from ..config import Config
from ..exceptions import DataError
from .numpy_dataset import METADATA_FILE

__all__ = [
    "FORMAT_VERSION",
    "SPLITS",
    "WORK_DIR",
    "PreparedSplitConfig",
    "abandon_output",
    "begin_output",
    "check_settings",
    "claim_output",
    "finish_output",
    "in_validation",
    "read_jsonl",
    "run_arguments",
    "token_dtype",
    "tokenizer_ids",
    "write_atomically",
]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
WORK_DIR = ".prepare"
"""The work folder inside an output: recorded arguments and partial results; gone when done."""
SPLITS = ("train", "val")


@dataclass
class PreparedSplitConfig(Config):
    """One split of a ``prepare-data`` output folder (the SFT and DPO dataset configs)."""

    path: str
    """The folder ``prepare-data -o`` wrote."""
    split: str = "train"
    """``train`` or ``val`` (with ``--val-fraction``): held-out examples for evaluation."""

    def validate(self) -> None:
        if self.split not in SPLITS:
            raise self._invalid("split", f"must be 'train' or 'val', got {self.split!r}")


# -- input ---------------------------------------------------------------------------------------


def read_jsonl(
    path: io.PathOrStr, *, name: str | None = None, errors: str = "strict"
) -> Iterator[tuple[int, Any]]:
    """``(line number, record)`` for each non-blank line of a JSONL file, in order.

    ``path`` may be local (``.gz`` is decompressed) or a URL that :mod:`olmolike.io` reads.
    A line that is not JSON is a :class:`DataError` naming the file (``name``, else the path)
    and the line. ``errors="replace"`` turns bytes that are not UTF-8 into U+FFFD instead of
    failing a large run on one stray file.
    """
    where = name or str(path)
    for number, line in enumerate(_lines(path, errors), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(
                f"{where}, line {number}: not valid JSON ({e.msg}); each line must be one JSON "
                "object"
            ) from None
        yield number, record


def _lines(path: io.PathOrStr, errors: str) -> Iterator[str]:
    if io.is_url(str(path)):
        yield from io.read_bytes(path).decode("utf-8", errors=errors).splitlines()
        return
    opener: Callable[..., IO[str]] = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8", errors=errors) as f:
        yield from f


def in_validation(seed: int, source: str, document: int, fraction: float) -> bool:
    """A document's split, from a hash of what identifies it: stable across runs and workers."""
    if fraction <= 0.0:
        return False
    digest = hashlib.blake2b(f"{seed}\0{source}\0{document}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < fraction * 2.0**64


# -- output --------------------------------------------------------------------------------------


def check_settings(val_fraction: float, sequence_length: int | None = None) -> None:
    """Refuse a validation fraction outside [0, 1) and a sequence shorter than two tokens."""
    if sequence_length is not None and sequence_length < 2:
        raise DataError(f"sequence_length must be at least 2, got {sequence_length}")
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction must be in [0, 1), got {val_fraction}")


def run_arguments(tokenizer: Any, sources: list[Any], **settings: Any) -> dict[str, Any]:
    """Everything an output depends on, recorded before any work and compared on a rerun: the
    format, the resolved tokenizer, ``settings`` and every source's name and size."""
    return {
        "format_version": FORMAT_VERSION,
        "tokenizer": tokenizer.as_config_dict(),
        **settings,
        "sources": [{"path": s.name, "bytes": s.size} for s in sources],
    }


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned type that holds every token id of the vocabulary."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def tokenizer_ids(tokenizer: Any) -> dict[str, Any]:
    """The ids a trainer needs from a resolved :class:`~olmolike.data.TokenizerConfig`."""
    return {
        name: getattr(tokenizer, name)
        for name in ("vocab_size", "eos_token_id", "pad_token_id", "bos_token_id")
    }


def write_atomically(path: Path, fill: Callable[..., Any]) -> None:
    """Call ``fill`` with ``path``'s temporary twin open for binary writing, then rename the
    twin to ``path``: never a half-written file under ``path``."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            fill(f)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def claim_output(out: Path, arguments: dict[str, Any], overwrite: bool) -> dict[str, Any] | None:
    """Check ``out`` may receive this run; return the finished metadata if it already has it."""
    recorded = None
    for path in (out / METADATA_FILE, out / WORK_DIR / "args.json"):
        if path.is_file():
            recorded = json.loads(path.read_text()).get("arguments")
            break
    if overwrite:
        for name in (*SPLITS, WORK_DIR, METADATA_FILE):
            target = out / name
            shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
    elif recorded is not None and recorded != arguments:
        differing = sorted(k for k in arguments if recorded.get(k) != arguments[k])
        raise DataError(
            f"{out} holds data prepared with different {', '.join(differing)}; pass "
            "--overwrite (overwrite=True from Python) to replace it, or choose another output directory"
        )
    elif recorded is None and out.is_dir() and any(out.iterdir()):
        raise DataError(
            f"{out} is not empty and holds no prepare-data output; choose an empty directory "
            "or pass --overwrite (overwrite=True from Python)"
        )
    if not overwrite and (out / METADATA_FILE).is_file():
        return dict(json.loads((out / METADATA_FILE).read_text()))
    return None


def begin_output(out: Path, arguments: dict[str, Any], overwrite: bool) -> dict[str, Any] | None:
    """Claim ``out`` and record this run's arguments in its work folder; the finished metadata
    instead (and nothing to do) if ``out`` already holds this data."""
    finished = claim_output(out, arguments, overwrite)
    if finished is not None:
        log.info("%s already holds this data; nothing to do", out)
        shutil.rmtree(out / WORK_DIR, ignore_errors=True)  # killed after the metadata landed
        return finished
    (out / WORK_DIR).mkdir(parents=True, exist_ok=True)
    write_atomically(
        out / WORK_DIR / "args.json",
        lambda f: f.write(json.dumps({"arguments": arguments}).encode()),
    )
    return None


def abandon_output(out: Path) -> None:
    """What a refused preparation leaves of ``out``: nothing of its own (the splits written,
    the work folder and the arguments it recorded), so that a corrected rerun starts afresh
    instead of being refused as another preparation's. A folder holding finished data never
    gets here (there is nothing to do for it)."""
    for name in (*SPLITS, WORK_DIR):
        shutil.rmtree(out / name, ignore_errors=True)


def finish_output(
    out: Path, tokenizer: Any, arguments: dict[str, Any], **fields: Any
) -> dict[str, Any]:
    """Write ``metadata.json`` (the mark of a finished folder), drop the work folder, and
    return the metadata: the format version, the resolved ``tokenizer`` and the ids a trainer
    needs from it, the preparation's own ``fields``, and the ``arguments`` it was made with."""
    metadata = {
        "format_version": FORMAT_VERSION,
        "tokenizer": tokenizer.identifier,
        **tokenizer_ids(tokenizer),
        **fields,
        "arguments": arguments,
    }
    write_atomically(
        out / METADATA_FILE, lambda f: f.write(json.dumps(metadata, indent=2).encode())
    )
    shutil.rmtree(out / WORK_DIR)
    return metadata
