"""Fixed-length token instances over flat token files, local (memory-mapped) or remote.

A token file is a flat array of unsigned integer token ids: an ``.npy`` file (as written by
``olmolike prepare-data`` or ``np.save``; the header gives the dtype) or a *raw* file with no
header at all (e.g. ``.bin`` files from other tools), whose dtype must be configured.

Nothing reads a whole file: opening a dataset reads each file's size and ``.npy`` header, and
an instance is one slice, from a memory map (local files) or one ranged request (``gs://``,
``s3://`` and any other fsspec URL). A token id beyond the vocabulary (the data's or the
model's) is refused when the dataset is built if ``metadata.json`` records the largest id,
else on each instance as it is read. Finding files and reading their headers and metadata:
:mod:`olmolike.data.token_files`.
"""

from __future__ import annotations

import hashlib
import json
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..config import Config
from ..exceptions import DataError
from ..io import is_url, retry_network, url_to_fs
from .token_files import (
    METADATA_FILE,
    UNSIGNED_DTYPES,
    TokenFile,
    expand_paths,
    inspect_token_file,
    metadata_near,
    recorded_max_token_id,
)

__all__ = [
    "METADATA_FILE",
    "NumpyDatasetConfig",
    "NumpyFSLDataset",
    "SourceMixtureConfig",
    "TokenFile",
]


_RATE_TOLERANCE = 1e-6


# -- configs ---------------------------------------------------------------------------------


@dataclass
class SourceMixtureConfig(Config):
    """One source of a mixture: its files and the share of each epoch's instances it supplies."""

    name: str
    """The source's name, unique in the mixture (it names the source in errors and logs)."""
    paths: list[str]
    """The source's token files, folders or globs, as ``NumpyDatasetConfig.paths``."""
    rate: float
    """The share of each epoch's instances this source supplies, in (0, 1]; the rates of a mixture
    sum to 1."""
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
    """Tokens per training instance (each instance is one window of a token file; the tail of a file
    shorter than it is dropped)."""
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
        vocab_size, eos, top = self._from_metadata([f for group in files for f in group])
        dataset = NumpyFSLDataset(
            files,
            self.sequence_length,
            vocab_size=vocab_size,
            eos_token_id=eos,
            mixture=self.mixture,
            seed=self.seed,
        )
        dataset.max_token_id = top
        if vocab_size is not None:
            dataset.check_token_ids_below(vocab_size, "vocab_size")
        return dataset

    def _from_metadata(self, files: list[TokenFile]) -> tuple[int | None, int | None, int | None]:
        """Vocabulary size, EOS id and the largest token id that ``metadata.json`` records for
        the files (each ``None`` where no file has it); the config's own values win."""
        cache: dict[str, dict[str, Any] | None] = {}
        found: dict[str, tuple[int, int]] = {}
        tops = []
        for f in files:
            meta = metadata_near(f.path, cache)
            if meta is not None:
                found[f.path] = (int(meta["vocab_size"]), int(meta["eos_token_id"]))
                tops += [t for t in [recorded_max_token_id(meta, f.path)] if t is not None]
        top = max(tops, default=None)
        if self.vocab_size is not None and self.eos_token_id is not None:
            return self.vocab_size, self.eos_token_id, top
        if len(set(found.values())) > 1:
            raise DataError(
                f"the files were prepared with different tokenizers (vocab size, EOS id): "
                f"{sorted(set(found.values()))}; train on data from one tokenizer"
            )
        vocab, eos = next(iter(found.values()), (None, None))
        return (
            self.vocab_size if self.vocab_size is not None else vocab,
            self.eos_token_id if self.eos_token_id is not None else eos,
            top,
        )


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
        self.max_token_id: int | None = None
        """The largest token id in the files, where prepare-data's metadata records it."""
        self._id_limit: tuple[int, str, str | None] | None = None
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
        if self._id_limit is not None and top >= self._id_limit[0]:
            start = local * self.sequence_length
            limit, name, fix = self._id_limit
            raise DataError(
                f"{self.files[file_index].path} holds token id {top} (in tokens "
                f"[{start}, {start + self.sequence_length})), not below {name}={limit}; "
                + (fix or f"the file was made with another tokenizer or {name} is wrong")
            )
        return tokens

    def check_token_ids_below(self, limit: int, name: str, fix: str | None = None) -> None:
        """Refuse token ids >= ``limit`` (``name`` says whose limit, e.g. the model's
        vocabulary): now, where the metadata records the largest id, else as each instance is
        read, before any forward pass sees it. ``fix``: what the error tells to do instead
        of the default (use the model's tokenizer, or raise ``name``)."""
        if self.max_token_id is not None and self.max_token_id >= limit:
            raise DataError(
                f"the data holds token id {self.max_token_id} (max_token_id in its "
                f"metadata.json, files like {self.files[0].path}), not below {name}={limit}; "
                + (fix or f"prepare the data with the model's tokenizer or raise {name}")
            )
        if self._id_limit is None or limit < self._id_limit[0]:
            self._id_limit = (limit, name, fix)

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
