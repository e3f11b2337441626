"""``prepare-data``: text and JSONL files -> memory-mappable token shards plus ``metadata.json``.

The run has two phases, both resumable:

1. **Tokenize** each source file (in parallel over files) into a *part* under
   ``OUT/.prepare/parts/``: its train and validation tokens (an EOS after every document) and
   the document lengths. A part is written under a temporary name and renamed, so a killed run
   leaves whole parts or none, and a rerun tokenizes only the missing ones.
2. **Write shards**: the parts are concatenated in source order and cut into ``.npy`` shards at
   document boundaries (a shard closes after the document that brings it to ``shard_tokens``).
   The cuts depend only on document lengths, never on which worker tokenized what, so the
   output is bit-identical for any number of workers.

``metadata.json`` is written last and marks the output complete. The arguments of a run are
recorded before any work (``.prepare/args.json``), so a rerun with other arguments or inputs is
refused instead of mixing two datasets, unless ``overwrite`` is set.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from ..exceptions import DataError
from ..io import removed_if_left_empty
from .numpy_dataset import METADATA_FILE, NumpyDatasetConfig
from .prepared_io import (
    SPLITS,
    WORK_DIR,
    abandon_output,
    begin_output,
    check_settings,
    finish_output,
    in_validation,
    run_arguments,
    token_dtype,
    write_atomically,
)
from .sources import Source, not_text, read_documents, resolve_inputs, stdlib_python_files
from .tokenizer import Tokenizer, TokenizerConfig

__all__ = [
    "DEFAULT_SHARD_TOKENS",
    "PreparedData",
    "Source",
    "prepare_data",
    "resolve_inputs",
    "stdlib_python_files",
]

log = logging.getLogger(__name__)

DEFAULT_SHARD_TOKENS = 1 << 28
"""About 268 M tokens (512 MiB as uint16) per shard: few files, each far longer than a sequence."""

# -- phase 1: tokenize each source into a part -------------------------------------------------


PART_BYTES = 1 << 22
"""Input bytes per part (more if one file is larger): few part files, yet work for each worker."""


def _group_sources(sources: list[Source]) -> list[list[Source]]:
    """Consecutive sources in parts of about :data:`PART_BYTES`; independent of ``workers``,
    so a rerun with another worker count resumes with the same parts."""
    groups: list[list[Source]] = [[]]
    size = 0
    for source in sources:
        if size >= PART_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(source)
        size += source.size
    return groups


@dataclass(frozen=True)
class _PartJob:
    sources: tuple[Source, ...]
    part_path: Path
    text_field: str
    seed: int
    val_fraction: float
    dtype: str


def _tokenize(job: _PartJob, tokenizer: Tokenizer) -> int:
    """Write one part file; return its input bytes (for the progress bar)."""
    dtype = np.dtype(job.dtype)
    eos = np.array([tokenizer.eos_token_id], dtype=dtype)
    chunks: dict[str, list[np.ndarray]] = {split: [] for split in SPLITS}
    lengths: dict[str, list[int]] = {split: [] for split in SPLITS}
    for source in job.sources:
        for document, text in read_documents(source, job.text_field):
            ids = tokenizer.encode_to_array(text).astype(dtype, copy=False)
            if not len(ids):
                continue  # an empty document would only add a lone EOS
            split = SPLITS[in_validation(job.seed, source.name, document, job.val_fraction)]
            chunks[split] += [ids, eos]
            lengths[split].append(len(ids) + 1)
    arrays: dict[str, Any] = {}
    for split in SPLITS:
        arrays[split] = np.concatenate(chunks[split]) if chunks[split] else np.empty(0, dtype)
        arrays[f"{split}_lengths"] = np.asarray(lengths[split], dtype=np.int64)
    write_atomically(job.part_path, lambda f: np.savez(f, **arrays))
    return sum(source.size for source in job.sources)


_worker_tokenizer: Tokenizer | None = None


def _init_worker(config: TokenizerConfig) -> None:
    global _worker_tokenizer
    _worker_tokenizer = config.build()


def _tokenize_in_worker(job: _PartJob) -> int:
    assert _worker_tokenizer is not None
    return _tokenize(job, _worker_tokenizer)


def _run_jobs(
    jobs: list[_PartJob], tokenizer: TokenizerConfig, workers: int, bar: Progress
) -> None:
    if not jobs:
        return
    total = sum(source.size for job in jobs for source in job.sources)
    task = bar.add_task("tokenizing", total=total)
    if workers <= 1 or len(jobs) == 1:
        built = tokenizer.build()
        for job in jobs:
            bar.advance(task, _tokenize(job, built))
        return
    # fork where there is one: a spawned worker would re-import the parent's main module,
    # torch included (seconds per worker), while the workers only need numpy and the tokenizer.
    forking = "fork" in multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if forking else "spawn")
    with context.Pool(min(workers, len(jobs)), _init_worker, (tokenizer,)) as pool:
        for size in pool.imap_unordered(_tokenize_in_worker, jobs):
            bar.advance(task, size)


# -- phase 2: cut the parts into shards --------------------------------------------------------


def _shard_ends(lengths: np.ndarray, shard_tokens: int) -> list[int]:
    """Document counts at which shards end: each closes once it holds ``shard_tokens``."""
    ends: list[int] = []
    ends_at = np.cumsum(lengths)
    start_doc, start_token = 0, 0
    while start_doc < len(lengths):
        last = int(np.searchsorted(ends_at, start_token + shard_tokens, side="left"))
        end = min(last + 1, len(lengths))
        ends.append(end)
        start_doc, start_token = end, int(ends_at[end - 1])
    return ends


def _split_tokens(parts: list[Path], split: str) -> Iterator[np.ndarray]:
    """Each part's tokens of ``split`` in order, one part in memory at a time."""
    for path in parts:
        with np.load(path) as part:
            yield part[split]


def _take(stream: Iterator[np.ndarray], rest: np.ndarray, count: int) -> tuple[list, np.ndarray]:
    """The next ``count`` tokens (as slices of the parts) and what is left of the last part."""
    chunks = []
    while count:
        if not len(rest):
            rest = next(stream)
        chunks.append(rest[:count])
        count -= len(chunks[-1])
        rest = rest[len(chunks[-1]) :]
    return chunks, rest


def _write_shard(path: Path, dtype: np.dtype, chunks: list[np.ndarray]) -> None:
    """Write ``chunks`` as one flat ``.npy`` array, whole or not at all, without joining them."""

    def fill(f: Any) -> None:
        header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False}
        count = sum(len(c) for c in chunks)
        np.lib.format.write_array_header_1_0(f, {**header, "shape": (count,)})
        for chunk in chunks:
            f.write(np.ascontiguousarray(chunk, dtype=dtype).tobytes())

    write_atomically(path, fill)


def _write_split(
    out: Path, split: str, parts: list[Path], dtype: np.dtype, shard_tokens: int, bar: Progress
) -> list[dict[str, Any]]:
    """Write one split's shards (skipping finished ones) and return their metadata."""
    per_part: list[np.ndarray] = [np.empty(0, np.int64)]
    for path in parts:
        with np.load(path) as part:
            per_part.append(part[f"{split}_lengths"])
    lengths = np.concatenate(per_part)
    stream, rest = _split_tokens(parts, split), np.empty(0, dtype)
    task = bar.add_task(f"writing {split}", total=int(lengths.sum()))
    shards, ends_at, start_doc = [], np.cumsum(lengths), 0
    for number, end_doc in enumerate(_shard_ends(lengths, shard_tokens)):
        start = int(ends_at[start_doc - 1]) if start_doc else 0
        end = int(ends_at[end_doc - 1])
        relative = f"{split}/part-{number:05d}.npy"
        chunks, rest = _take(stream, rest, end - start)
        if not (out / relative).exists():  # present: written whole by an interrupted run
            (out / split).mkdir(exist_ok=True)
            _write_shard(out / relative, dtype, chunks)
        top = max(int(c.max()) for c in chunks if len(c))  # a shard holds >= 1 document
        shards.append(
            {
                "path": relative,
                "tokens": end - start,
                "documents": end_doc - start_doc,
                "max_token_id": top,
            }
        )
        bar.advance(task, end - start)
        start_doc = end_doc
    return shards


# -- the run -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PreparedData:
    """The result of :func:`prepare_data`: where the shards are and what ``metadata.json`` says."""

    output_dir: Path
    """The folder ``prepare_data`` wrote: the shards under ``train/`` and ``val/``, and
    ``metadata.json``."""
    metadata: dict[str, Any]
    """The contents of ``metadata.json``: the tokenizer and its ids, the shards of each split with
    their token counts, the sources, and the arguments of the run."""

    @classmethod
    def load(cls, output_dir: str | Path) -> PreparedData:
        path = Path(output_dir) / METADATA_FILE
        if not path.is_file():
            raise DataError(f"{output_dir} holds no {METADATA_FILE}; run olmolike prepare-data")
        return cls(Path(output_dir), json.loads(path.read_text()))

    def paths(self, split: str = "train") -> list[str]:
        return [str(self.output_dir / s["path"]) for s in self.metadata["splits"][split]]

    def num_tokens(self, split: str = "train") -> int:
        return sum(s["tokens"] for s in self.metadata["splits"][split])

    @property
    def vocab_size(self) -> int:
        return int(self.metadata["vocab_size"])

    @property
    def eos_token_id(self) -> int:
        return int(self.metadata["eos_token_id"])

    def dataset_config(
        self, sequence_length: int, *, split: str = "train", seed: int = 0
    ) -> NumpyDatasetConfig:
        """A dataset over one split; a missing validation split is a clear error."""
        paths = self.paths(split)
        if not paths:
            raise DataError(
                f"{self.output_dir} has no {split!r} shards; prepare it with val_fraction > 0 "
                "(--val-fraction) to get a validation split"
            )
        return NumpyDatasetConfig(
            paths=paths,
            sequence_length=sequence_length,
            vocab_size=self.vocab_size,
            eos_token_id=self.eos_token_id,
            seed=seed,
        )


def _clean_temporaries(out: Path) -> None:
    """Remove half-written files that a killed run left under temporary names."""
    for directory in (out, out / WORK_DIR, out / WORK_DIR / "parts", *(out / s for s in SPLITS)):
        for tmp in directory.glob("*.tmp"):
            log.info("Removing %s, left by an interrupted run", tmp)
            tmp.unlink()


def prepare_data(
    inputs: Sequence[str | Path],
    output_dir: str | Path,
    *,
    tokenizer: TokenizerConfig | None = None,
    text_field: str = "text",
    val_fraction: float = 0.0,
    seed: int = 0,
    workers: int = 1,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    overwrite: bool = False,
    progress: bool = False,
    keep_binary: bool = False,
) -> PreparedData:
    """Tokenize ``inputs`` into ``.npy`` shards under ``output_dir`` (see the module docstring).

    Documents go to the validation split with probability ``val_fraction``, decided by a hash
    of ``(seed, source name, document index)``. A file that is not UTF-8 text (a binary: see
    :func:`~olmolike.data.sources.not_text`) is skipped with a warning naming it, and listed
    under ``skipped`` in the metadata, unless ``keep_binary`` (its invalid bytes then become
    U+FFFD).
    """
    check_settings(val_fraction)
    if shard_tokens < 1 or workers < 1:
        raise DataError("shard_tokens and workers must be at least 1")
    out = Path(output_dir)
    resolved = (tokenizer or TokenizerConfig()).resolve()
    assert resolved.vocab_size is not None and resolved.eos_token_id is not None
    dtype = token_dtype(resolved.vocab_size)
    # A refused preparation leaves no empty output folder behind.
    with removed_if_left_empty(out):
        sources, skipped = _text_sources(resolve_inputs(inputs, exclude=out), keep_binary)
        # Everything the output depends on; not ``workers``, which never changes it.
        arguments = run_arguments(
            resolved,
            sources,
            dtype=dtype.name,
            text_field=text_field,
            val_fraction=val_fraction,
            seed=seed,
            shard_tokens=shard_tokens,
        )
        finished = begin_output(out, arguments, overwrite)
        if finished is not None:
            return PreparedData(out, finished)
        parts_dir = out / WORK_DIR / "parts"
        parts_dir.mkdir(parents=True, exist_ok=True)
        _clean_temporaries(out)
        groups = _group_sources(sources)
        parts = [parts_dir / f"{i:06d}.npz" for i in range(len(groups))]
        jobs = [
            _PartJob(tuple(group), part, text_field, seed, val_fraction, dtype.name)
            for group, part in zip(groups, parts)
            if not part.exists()
        ]
        if len(jobs) < len(parts):
            log.info(
                "Resuming: %d of %d parts already tokenized", len(parts) - len(jobs), len(parts)
            )
        columns = (TextColumn("{task.description}"), BarColumn(), TimeRemainingColumn())
        with Progress(*columns, disable=not progress) as bar:
            _run_jobs(jobs, resolved, workers, bar)
            splits = {s: _write_split(out, s, parts, dtype, shard_tokens, bar) for s in SPLITS}
        _refuse_an_empty_training_split(out, splits, len(sources), val_fraction)
        fields = _shard_fields(arguments, splits)
        metadata = finish_output(out, resolved, arguments, **fields, skipped=skipped)
        return PreparedData(out, metadata)


def _text_sources(sources: list[Source], keep_binary: bool) -> tuple[list[Source], list[str]]:
    """The sources to tokenize and the names of those skipped as not text (with a warning
    each); all of them with ``keep_binary``. Only binaries is an error.

    The standard library's ``.py`` files (``--stdlib``, the embedded default corpus) are kept
    whatever they hold: one is a test module in KOI8-R, and the corpus must be the same on
    every run for the documented numbers to hold.
    """
    if keep_binary:
        return sources, []
    kept, skipped = [], []
    stdlib: set[Path] | None = None
    for source in sources:
        reason = not_text(source)
        if reason is not None and stdlib is None:
            stdlib = {path.resolve() for path in stdlib_python_files()}
        if reason is None or (stdlib is not None and source.path.resolve() in stdlib):
            kept.append(source)
            continue
        log.warning(
            "skipping %s: not UTF-8 text (%s); keep_binary (--keep-binary) tokenizes it anyway",
            source.name,
            reason,
        )
        skipped.append(source.name)
    if not kept:
        raise DataError(
            f"none of the {len(sources)} input file(s) is UTF-8 text (e.g. {skipped[0]}: "
            f"{not_text(sources[0])}); give text or JSONL files, or set keep_binary "
            "(--keep-binary) to tokenize them anyway"
        )
    return kept, skipped


def _refuse_an_empty_training_split(
    out: Path, splits: dict[str, list[dict[str, Any]]], sources: int, val_fraction: float
) -> None:
    """No training tokens is an error now, not when a run fails to find ``train/``; the
    output is removed first (it is this run's: the folder was empty or held this data's work
    files), so no ``metadata.json`` marks it complete and a corrected rerun starts afresh."""
    if sum(s["tokens"] for s in splits["train"]):
        return
    held_out = sum(s["documents"] for s in splits["val"])
    abandon_output(out)
    if held_out:
        raise DataError(
            f"the training split is empty: val_fraction {val_fraction:g} (--val-fraction) held "
            f"out all {held_out} document(s); give more documents or a smaller val_fraction"
        )
    raise DataError(
        f"no tokens to write: the {sources} input file(s) hold no text (empty files, or JSONL "
        "lines without the text_field, --text-field)"
    )


def _shard_fields(arguments: dict[str, Any], splits: dict[str, Any]) -> dict[str, Any]:
    """What ``metadata.json`` records of token shards, beyond what every preparation does."""
    tops = [shard["max_token_id"] for shards in splits.values() for shard in shards]
    return {
        # Checked against the model's vocabulary when a run is built, not at the batch that
        # holds it.
        "max_token_id": max(tops),
        "dtype": arguments["dtype"],
        "splits": splits,
        "sources": arguments["sources"],
    }
