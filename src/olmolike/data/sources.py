"""Which files a ``prepare-data`` run reads, and the documents inside them."""

from __future__ import annotations

import codecs
import glob
import os
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..exceptions import DataError
from .prepared_io import read_jsonl

__all__ = ["Source", "not_text", "read_documents", "resolve_inputs", "stdlib_python_files"]

_GLOB_CHARS = frozenset("*?[")
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True)
class Source:
    """One input file. ``name`` is the path as expanded from the user's input (not resolved),
    so the validation split, which hashes it, does not depend on the current directory."""

    path: Path
    """The file, as found on disk."""
    name: str
    """The path as the user's input expanded to it (not resolved): it names the file in messages and
    the metadata, and seeds the validation split."""
    size: int
    """The file's size in bytes (recorded, so that a rerun on changed inputs is refused)."""


def stdlib_python_files() -> list[Path]:
    """The running Python's standard-library ``.py`` files, in a fixed (sorted) order.

    Installed packages (``site-packages``/``dist-packages``) are left out: they differ between
    machines, while the standard library of one Python version is the same everywhere.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    return _walk(root, lambda d: d not in _SKIPPED_DIRS, lambda f: f.endswith(".py"))


def _walk(
    root: Path,
    keep_dir: Callable[[str], bool] = lambda d: not d.startswith("."),
    keep_file: Callable[[str], bool] = lambda f: not f.startswith("."),
) -> list[Path]:
    """Files under ``root`` in sorted order (by default without hidden files and folders)."""
    found: list[Path] = []
    for parent, dirs, files in os.walk(root):
        dirs[:] = sorted(filter(keep_dir, dirs))
        found.extend(Path(parent) / f for f in sorted(files) if keep_file(f))
    return found


def _expand(item: str) -> list[Path]:
    if _GLOB_CHARS & set(item):
        matches = [Path(m) for m in sorted(glob.glob(item, recursive=True))]
        if not matches:
            raise DataError(f"no files match the glob {item!r}; check the pattern and the path")
        return [f for m in matches for f in (_walk(m) if m.is_dir() else [m])]
    path = Path(item)
    if path.is_dir():
        files = _walk(path)
        if not files:
            raise DataError(f"the input directory {item!r} holds no files")
        return files
    if path.is_file():
        return [path]
    raise DataError(f"the input {item!r} does not exist; give text/JSONL files, folders or globs")


def resolve_inputs(inputs: Sequence[str | Path], *, exclude: Path | None = None) -> list[Source]:
    """Expand files, folders (recursively) and globs into sources, in a deterministic order.

    Files under ``exclude`` (the output directory) are skipped; a file reached twice is kept
    once, at its first position.
    """
    if not inputs:
        raise DataError("no inputs given; name text or JSONL files, folders or globs")
    skip = os.path.join(os.path.abspath(exclude), "") if exclude is not None else None
    seen: set[str] = set()
    sources: list[Source] = []
    for item in inputs:
        for path in _expand(str(item)):
            absolute = os.path.abspath(path)
            if (skip is not None and absolute.startswith(skip)) or absolute in seen:
                continue
            seen.add(absolute)
            sources.append(Source(path, path.as_posix(), path.stat().st_size))
    if not sources:
        raise DataError(f"the inputs {list(map(str, inputs))} hold no files outside the output")
    return sources


SNIFF_BYTES = 8192
"""How much of a plain-text input :func:`not_text` reads: enough to tell, little to read."""

MAX_INVALID_SHARE = 0.1
"""The share of bytes that are not UTF-8 above which an input is not text (text in Latin-1
with a few accented letters stays well below it; random bytes are at about 70%)."""


def not_text(source: Source) -> str | None:
    """Why ``source`` is not UTF-8 text, judged from its first :data:`SNIFF_BYTES` (a NUL
    byte, or more than :data:`MAX_INVALID_SHARE` of bytes that are no UTF-8); ``None`` if it
    is text. Binaries (executables, archives, checkpoints, images) and UTF-16 text fail;
    JSONL files are not judged here (a line that is no JSON is an error when read)."""
    if source.name.endswith((".jsonl", ".jsonl.gz")):
        return None
    with open(source.path, "rb") as f:
        head = f.read(SNIFF_BYTES)
    if b"\0" in head:
        return "it holds NUL bytes"
    # A character cut at the end of the sample is not counted: it is pending, not invalid.
    decoder = codecs.getincrementaldecoder("utf-8")("ignore")
    decoded = decoder.decode(head, final=False)
    invalid = len(head) - len(decoded.encode("utf-8")) - len(decoder.getstate()[0])
    if head and invalid > MAX_INVALID_SHARE * len(head):
        return f"{invalid / len(head):.0%} of its first {len(head):,d} bytes are not UTF-8"
    return None


def read_documents(source: Source, text_field: str) -> Iterator[tuple[int, str]]:
    """``(document index, text)`` pairs: the whole file, or one per non-blank JSONL line.

    Bytes that are not UTF-8 become U+FFFD rather than failing a large run on one stray file.
    """
    if not source.name.endswith((".jsonl", ".jsonl.gz")):
        yield 0, source.path.read_bytes().decode("utf-8", errors="replace")
        return
    for line_number, record in read_jsonl(source.path, name=source.name, errors="replace"):
        yield line_number, _document_text(record, f"{source.name}, line {line_number}", text_field)


def _document_text(record: Any, where: str, text_field: str) -> str:
    if not isinstance(record, dict) or text_field not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise DataError(
            f"{where}: no {text_field!r} field (found {keys}); set text_field "
            "(--text-field) to the field that holds the document text"
        )
    text = record[text_field]
    if not isinstance(text, str):
        raise DataError(f"{where}: field {text_field!r} holds a {type(text).__name__}, not text")
    return text
