"""Fixed-length token instances over flat token files, local (memory-mapped) or remote.

A token file is a flat array of unsigned integer token ids: an ``.npy`` file (as written by
``olmolike prepare-data`` or ``np.save``; the header gives the dtype) or a *raw* file with no
header at all (e.g. ``.bin`` files from other tools), whose dtype must be configured.

Nothing reads a whole file: opening a dataset reads each file's size and ``.npy`` header, and
an instance is one slice, from a memory map (local files) or one ranged request (``gs://``,
``s3://`` and any other fsspec URL). The checks that need the data itself, such as a token id
beyond the vocabulary, therefore run on each instance as it is read.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import math
import os
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import Config
from ..exceptions import ConfigurationError, DataError
from ..io import exists, is_url, join_path, local_path, read_bytes, retry_network, url_to_fs

__all__ = [
    "METADATA_FILE",
    "NumpyDatasetConfig",
    "NumpyFSLDataset",
    "SourceMixtureConfig",
    "TokenFile",
]

log = logging.getLogger(__name__)

METADATA_FILE = "metadata.json"
UNSIGNED_DTYPES = ("uint8", "uint16", "uint32", "uint64")
RAW_SUFFIXES = (".bin",)
"""Raw token files picked up from a folder (any name works when listed or globbed)."""
_RATE_TOLERANCE = 1e-6
_GLOB_CHARS = frozenset("*?[")


@dataclass(frozen=True)
class TokenFile:
    """One token file: where its tokens start, their dtype and count."""

    path: str
    size: int
    dtype: np.dtype
    offset: int
    num_tokens: int


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


def _metadata_near(path: str, cache: dict[str, dict[str, Any] | None]) -> dict[str, Any] | None:
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


# -- configs ---------------------------------------------------------------------------------


@dataclass
class SourceMixtureConfig(Config):
    """One source of a mixture: its files and the share of each epoch's instances it supplies."""

    name: str
    paths: list[str]
    rate: float
    max_repetition: float = 1.0
    """How many times the source's instances may be used per epoch; beyond it is an error."""

    def validate(self) -> None:
        if not self.name:
            raise self._invalid("name", "must not be empty")
        if not self.paths:
            raise self._invalid("paths", f"source {self.name!r} needs at least one path")
        if not 0.0 < self.rate <= 1.0:
            raise self._invalid("rate", f"must be in (0, 1], got {self.rate}")
        if self.max_repetition <= 0.0:
            raise self._invalid("max_repetition", f"must be positive, got {self.max_repetition}")


@dataclass
class NumpyDatasetConfig(Config):
    """Fixed-length instances from token files, or from a mixture of sources with rates."""

    paths: list[str] = field(default_factory=list)
    """Files, folders (their ``.npy``/``.bin`` files, recursively) and globs; local or URLs."""
    sequence_length: int = 1024
    dtype: str | None = None
    """Token dtype; ``None`` reads it from ``.npy`` headers (required for raw files)."""
    vocab_size: int | None = None
    """Token ids must be below it; ``None`` takes it from ``metadata.json`` beside the data."""
    eos_token_id: int | None = None
    """``None`` takes it from ``metadata.json`` beside the data, if any."""
    mixture: list[SourceMixtureConfig] | None = None
    """Instead of ``paths``: sources whose ``rate`` sums to 1."""
    seed: int = 0
    """Seeds which instances a mixture picks from each source."""

    def validate(self) -> None:
        if self.sequence_length < 1:
            raise self._invalid("sequence_length", f"must be positive, got {self.sequence_length}")
        if self.dtype is not None and self.dtype not in UNSIGNED_DTYPES:
            raise self._invalid("dtype", f"must be one of {', '.join(UNSIGNED_DTYPES)} or null")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise self._invalid("vocab_size", f"must be positive, got {self.vocab_size}")
        if bool(self.paths) == bool(self.mixture):
            raise self._invalid("paths", "set exactly one of paths and mixture")
        if self.mixture:
            self._validate_mixture(self.mixture)

    def _validate_mixture(self, mixture: list[SourceMixtureConfig]) -> None:
        names = [s.name for s in mixture]
        if len(set(names)) != len(names):
            raise self._invalid("mixture", f"source names must be unique, got {names}")
        total = sum(s.rate for s in mixture)
        if abs(total - 1.0) > _RATE_TOLERANCE:
            rates = ", ".join(f"{s.name}={s.rate}" for s in mixture)
            raise self._invalid("mixture", f"rates must sum to 1, got {total:.6g} ({rates})")

    def build(self) -> NumpyFSLDataset:
        """Find and check every file (headers and sizes only) and build the dataset."""
        groups = [self.paths] if self.mixture is None else [s.paths for s in self.mixture]
        files = [
            [inspect_token_file(path, size, self.dtype) for path, size in expand_paths(group)]
            for group in groups
        ]
        vocab_size, eos = self._from_metadata([f for group in files for f in group])
        return NumpyFSLDataset(
            files,
            self.sequence_length,
            vocab_size=vocab_size,
            eos_token_id=eos,
            mixture=self.mixture,
            seed=self.seed,
        )

    def _from_metadata(self, files: list[TokenFile]) -> tuple[int | None, int | None]:
        if self.vocab_size is not None and self.eos_token_id is not None:
            return self.vocab_size, self.eos_token_id
        cache: dict[str, dict[str, Any] | None] = {}
        found: dict[str, tuple[int, int]] = {}
        for f in files:
            meta = _metadata_near(f.path, cache)
            if meta is not None:
                found[f.path] = (int(meta["vocab_size"]), int(meta["eos_token_id"]))
        if len(set(found.values())) > 1:
            raise DataError(
                f"the files were prepared with different tokenizers (vocab size, EOS id): "
                f"{sorted(set(found.values()))}; train on data from one tokenizer"
            )
        vocab, eos = next(iter(found.values()), (None, None))
        return (
            self.vocab_size if self.vocab_size is not None else vocab,
            self.eos_token_id if self.eos_token_id is not None else eos,
        )


# -- the dataset -----------------------------------------------------------------------------


def _apportion(total: int, rates: Sequence[float]) -> list[int]:
    """Integer shares of ``total`` proportional to ``rates`` that sum to ``total`` exactly
    (largest remainders get the leftover units, so each share is within 1 of its ideal)."""
    ideal = [rate * total for rate in rates]
    counts = [math.floor(x) for x in ideal]
    by_remainder = sorted(range(len(rates)), key=lambda i: (counts[i] - ideal[i], i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


class NumpyFSLDataset(torch.utils.data.Dataset):
    """Fixed-length instances of ``sequence_length`` tokens over token files.

    Instance ``j`` of a file is its tokens ``[j * T, (j + 1) * T)``: an instance never spans
    two files, and **the tail of each file shorter than one instance is dropped** (with
    prepare-data's large shards that is a negligible share). Items are
    ``{"input_ids": LongTensor (T,), "index": i}``: int64 because embedding lookups and the
    loss's targets take int64, so converting once here saves a cast on every step.

    With a mixture, the instances of an epoch are a fixed, seeded selection in which each
    source supplies ``rate`` of the instances (the epoch has as many instances as all sources
    together); a source with too few is repeated, at most ``max_repetition`` times.
    """

    _MAX_OPEN_MAPS = 128  # each memory map holds a file descriptor

    def __init__(
        self,
        files: Sequence[Sequence[TokenFile]],
        sequence_length: int,
        *,
        vocab_size: int | None = None,
        eos_token_id: int | None = None,
        mixture: Sequence[SourceMixtureConfig] | None = None,
        seed: int = 0,
    ) -> None:
        self.sequence_length = sequence_length
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.files = [f for group in files for f in group]
        counts = [f.num_tokens // sequence_length for f in self.files]
        self._starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        if self._starts[-1] == 0:
            raise DataError(
                f"no token file holds {sequence_length} tokens (one instance); add data or lower "
                "sequence_length"
            )
        group_ends = np.cumsum([len(g) for g in files])
        self._group_bounds = [
            (int(self._starts[end - len(g)]), int(self._starts[end]))
            for g, end in zip(files, group_ends)
        ]
        self._index = None if mixture is None else self._mixture_index(mixture, seed)
        self._fingerprint = self._compute_fingerprint(files, mixture, seed)
        self._maps: dict[int, np.ndarray] = {}
        self._remote: dict[int, tuple[Any, str]] = {}

    def _mixture_index(self, mixture: Sequence[SourceMixtureConfig], seed: int) -> np.ndarray:
        sizes = [end - start for start, end in self._group_bounds]
        total = sum(sizes)
        picked = []
        for source, (start, _), size, count in zip(
            mixture, self._group_bounds, sizes, _apportion(total, [s.rate for s in mixture])
        ):
            if size == 0:
                raise DataError(
                    f"mixture source {source.name!r} has no instance of {self.sequence_length} "
                    "tokens; add data to it or lower sequence_length"
                )
            if count > math.floor(size * source.max_repetition + 1e-9):
                raise DataError(
                    f"mixture source {source.name!r} has {size} instances, but rate "
                    f"{source.rate} of an epoch of {total} needs {count} ({count / size:.2f} "
                    f"repetitions), more than max_repetition={source.max_repetition}; lower "
                    "its rate, raise its max_repetition, or add data to it"
                )
            repeats, rest = divmod(count, size)
            # Seeded by the source's name: adding a source does not change another's picks.
            rng = np.random.default_rng([seed, zlib.crc32(source.name.encode())])
            extra = np.sort(rng.choice(size, rest, replace=False))
            picked.append(start + np.concatenate([np.tile(np.arange(size), repeats), extra]))
        return np.concatenate(picked).astype(np.int64)

    def _compute_fingerprint(
        self,
        files: Sequence[Sequence[TokenFile]],
        mixture: Sequence[SourceMixtureConfig] | None,
        seed: int,
    ) -> str:
        """What identifies the instances: file names (not folders: data may move), sizes,
        dtypes, the sequence length and the mixture. No token is read."""
        groups = [[[f.path.rsplit("/", 1)[-1], f.size, f.dtype.str] for f in g] for g in files]
        described: dict[str, Any] = {"sequence_length": self.sequence_length, "files": groups}
        if mixture is not None:
            described["mixture"] = [[s.name, s.rate, s.max_repetition] for s in mixture]
            described["seed"] = seed
        return hashlib.sha256(json.dumps(described).encode()).hexdigest()

    @property
    def fingerprint(self) -> str:
        """A sha256 over what defines the instances, to check a resumed run reads the same."""
        return self._fingerprint

    def __len__(self) -> int:
        return int(self._starts[-1]) if self._index is None else len(self._index)

    @property
    def num_tokens(self) -> int:
        """Tokens served per epoch (instances x sequence length)."""
        return len(self) * self.sequence_length

    def __getitem__(self, index: int) -> dict[str, Any]:
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"instance {index} is out of range for {len(self)} instances")
        tokens = self.instance_tokens(index)
        return {"input_ids": torch.from_numpy(tokens.astype(np.int64)), "index": index}

    def instance_tokens(self, index: int) -> np.ndarray:
        """The token ids of instance ``index`` in the file's own dtype, range-checked."""
        instance = int(self._index[index]) if self._index is not None else index
        file_index = int(np.searchsorted(self._starts, instance, side="right")) - 1
        local = instance - int(self._starts[file_index])
        tokens = self._read(file_index, local)
        top = int(tokens.max())
        if self.vocab_size is not None and top >= self.vocab_size:
            start = local * self.sequence_length
            raise DataError(
                f"{self.files[file_index].path} holds token id {top} (in tokens "
                f"[{start}, {start + self.sequence_length})), not below vocab_size="
                f"{self.vocab_size}; the file was made with another tokenizer or vocab_size "
                "is wrong"
            )
        return tokens

    def _read(self, file_index: int, local: int) -> np.ndarray:
        f = self.files[file_index]
        length = self.sequence_length
        if not is_url(f.path):
            return self._map(file_index)[local * length : (local + 1) * length]
        if file_index not in self._remote:
            self._remote[file_index] = url_to_fs(f.path)
        fs, fs_path = self._remote[file_index]
        start = f.offset + local * length * f.dtype.itemsize
        end = start + length * f.dtype.itemsize
        data = retry_network(
            lambda: fs.cat_file(fs_path, start=start, end=end), f"reading {f.path}"
        )
        if len(data) != end - start:
            raise DataError(
                f"{f.path} ended at byte {start + len(data)}, expected {end}: it shrank"
            )
        return np.frombuffer(data, dtype=f.dtype)

    def _map(self, file_index: int) -> np.ndarray:
        mapped = self._maps.pop(file_index, None)
        if mapped is None:
            f = self.files[file_index]
            mapped = np.memmap(
                f.path, dtype=f.dtype, mode="r", offset=f.offset, shape=(f.num_tokens,)
            )
            if len(self._maps) >= self._MAX_OPEN_MAPS:
                self._maps.pop(next(iter(self._maps)))
        self._maps[file_index] = mapped  # most recently used last
        return mapped

    def __getstate__(self) -> dict[str, Any]:
        # Maps and clients are reopened where the dataset lands (e.g. a data-loader worker).
        return {**self.__dict__, "_maps": {}, "_remote": {}}
