"""Token files on disk or in a bucket: finding them, reading their headers, their metadata.

A token file is a flat array of unsigned token ids: an ``.npy`` file (its header gives the
dtype) or a raw file with no header (``.bin``), whose dtype must be configured. Only sizes and
headers are read here, never the data; ``metadata.json``, which ``olmolike prepare-data``
writes beside its shards, is found for each file and gives its tokenizer's ids and largest
token id.
"""

from __future__ import annotations

import glob
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..exceptions import ConfigurationError, DataError
from ..io import exists, is_url, join_path, local_path, read_bytes, retry_network, url_to_fs

__all__ = [
    "METADATA_FILE",
    "UNSIGNED_DTYPES",
    "TokenFile",
    "expand_paths",
    "inspect_token_file",
    "metadata_near",
    "recorded_max_token_id",
]

METADATA_FILE = "metadata.json"
UNSIGNED_DTYPES = ("uint8", "uint16", "uint32", "uint64")
RAW_SUFFIXES = (".bin",)
"""Raw token files picked up from a folder (any name works when listed or globbed)."""
_GLOB_CHARS = frozenset("*?[")


@dataclass(frozen=True)
class TokenFile:
    """One token file: where its tokens start, their dtype and count."""

    path: str
    """The file, local or a URL."""
    size: int
    """The file's size in bytes."""
    dtype: np.dtype
    """The unsigned integer dtype of its token ids."""
    offset: int
    """Where the tokens start, in bytes (after a ``.npy`` header; 0 for a raw file)."""
    num_tokens: int
    """How many token ids the file holds."""


# -- finding files ---------------------------------------------------------------------------


def _is_data_file(name: str, *, listed_by_glob: bool) -> bool:
    base = name.rsplit("/", 1)[-1]
    if base.startswith(".") or base == METADATA_FILE or base.endswith(".tmp"):
        return False
    return listed_by_glob or base.endswith((".npy", *RAW_SUFFIXES))


def _expand_local(pattern: str) -> list[tuple[str, int]]:
    if _GLOB_CHARS & set(pattern):
        found = sorted(glob.glob(pattern, recursive=True))
        files = [f for f in found if os.path.isfile(f) and _is_data_file(f, listed_by_glob=True)]
        if not files:
            raise DataError(f"no token files match the glob {pattern!r}")
    elif os.path.isdir(pattern):
        files = []
        for parent, dirs, names in os.walk(pattern):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            files += [os.path.join(parent, n) for n in sorted(names)]
        files = [f for f in files if _is_data_file(f, listed_by_glob=False)]
        if not files:
            raise DataError(f"the folder {pattern!r} holds no .npy or .bin token files")
    elif os.path.isfile(pattern):
        files = [pattern]
    else:
        raise DataError(f"the token file or folder {pattern!r} does not exist")
    return [(f, os.path.getsize(f)) for f in files]


def _expand_remote(pattern: str) -> list[tuple[str, int]]:
    fs, root = url_to_fs(pattern)

    def listing() -> dict[str, Any]:
        if _GLOB_CHARS & set(pattern):
            return dict(fs.glob(root, detail=True))
        if fs.isdir(root):
            return dict(fs.find(root, detail=True))
        try:
            return {root: fs.info(root)}
        except FileNotFoundError:
            return {}

    entries = retry_network(listing, f"listing {pattern}")
    globbed = bool(_GLOB_CHARS & set(pattern))
    files = [
        (fs.unstrip_protocol(path), int(info["size"]))
        for path, info in sorted(entries.items())
        if info.get("type") != "directory" and _is_data_file(path, listed_by_glob=globbed)
    ]
    if not files:
        what = "match the glob" if globbed else "exist at"
        raise DataError(f"no token files {what} {pattern!r}")
    return files


def expand_paths(patterns: Sequence[str]) -> list[tuple[str, int]]:
    """``(path, size in bytes)`` of every token file named by files, folders or globs."""
    out: list[tuple[str, int]] = []
    for pattern in patterns:
        out += (
            _expand_remote(pattern) if is_url(pattern) else _expand_local(str(local_path(pattern)))
        )
    return out


# -- reading headers -------------------------------------------------------------------------


def _open(path: str) -> Any:
    if is_url(path):
        # A small block: the header is all we read, never the whole object.
        fs, fs_path = url_to_fs(path)
        return fs.open(fs_path, "rb", block_size=1 << 16)
    return open(path, "rb")


def _read_npy_header(path: str) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    def read() -> tuple[tuple[int, ...], bool, np.dtype, int]:
        with _open(path) as f:
            version = np.lib.format.read_magic(f)
            reader = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, fortran, dtype = reader(f)
            return tuple(shape), bool(fortran), np.dtype(dtype), int(f.tell())

    try:
        return retry_network(read, f"reading the header of {path}")
    except ValueError as e:
        raise DataError(
            f"{path} is not a valid .npy file ({e}); re-create it with np.save"
        ) from None


def inspect_token_file(path: str, size: int, dtype: str | None) -> TokenFile:
    """Check one file's header and size (no token is read) and describe it."""
    if size == 0:
        raise DataError(f"{path} is empty; remove it or re-create it with olmolike prepare-data")
    if not path.endswith(".npy"):
        if dtype is None:
            raise ConfigurationError(
                f"{path} is a raw token file (no .npy header); set dtype to the type it was "
                f"written with, one of {', '.join(UNSIGNED_DTYPES)}",
                path="dtype",
            )
        raw = np.dtype(dtype)
        if size % raw.itemsize:
            raise DataError(
                f"{path} is truncated or not {dtype}: {size} bytes is not a multiple of "
                f"{raw.itemsize}; re-create it or set the dtype it was written with"
            )
        return TokenFile(path, size, raw, 0, size // raw.itemsize)
    shape, fortran, found, offset = _read_npy_header(path)
    if found.kind != "u":
        raise DataError(
            f"{path} holds {found}, not unsigned integer token ids; re-create it with "
            "olmolike prepare-data"
        )
    if dtype is not None and found != np.dtype(dtype):
        raise DataError(f"{path} holds {found}, but dtype is set to {dtype}; fix or unset dtype")
    if fortran and len(shape) > 1:
        raise DataError(f"{path} is a Fortran-ordered array; save it as a flat C-ordered array")
    count = math.prod(shape)
    if count == 0:
        raise DataError(f"{path} holds no tokens; remove it or re-create it")
    expected = offset + count * found.itemsize
    if size != expected:
        raise DataError(
            f"{path} is truncated: its header announces {count} tokens ({expected} bytes) but "
            f"the file has {size} bytes; re-create it"
        )
    return TokenFile(path, size, found, offset, count)


def _parent(path: str) -> str | None:
    if not is_url(path):
        parent = str(Path(path).parent)
        return None if parent == path else parent
    head = path.rstrip("/").rpartition("/")[0]
    return None if head.endswith(":/") else head  # "gs:/" is above the bucket


def metadata_near(path: str, cache: dict[str, dict[str, Any] | None]) -> dict[str, Any] | None:
    """``metadata.json`` in the file's folder or the one above (prepare-data's layout)."""
    directory = _parent(path)
    for _ in range(2):
        if directory is None:
            return None
        if directory not in cache:
            candidate = join_path(directory, METADATA_FILE)
            cache[directory] = json.loads(read_bytes(candidate)) if exists(candidate) else None
        if cache[directory] is not None:
            return cache[directory]
        directory = _parent(directory)
    return None


def recorded_max_token_id(meta: dict[str, Any], path: str) -> int | None:
    """The largest token id of ``path``'s shard in prepare-data's metadata (older metadata
    records none)."""
    for shards in meta.get("splits", {}).values():
        for shard in shards if isinstance(shards, list) else ():
            if path.endswith("/" + shard["path"]) and "max_token_id" in shard:
                return int(shard["max_token_id"])
    return None


# -- the dataset -----------------------------------------------------------------------------
