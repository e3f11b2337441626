"""``olmolike prepare-data``: its options, and the choice between the three preparations.

Token shards for pretraining (:func:`~olmolike.data.prepare_data`), SFT sequences
(``--sft``, :func:`~olmolike.data.prepare_sft_data`) and preference pairs (``--dpo``,
:func:`~olmolike.data.preference_prepare.prepare_preference_data`) are three library
functions that know nothing of each other; this module parses the command line, calls one,
and reports what it wrote.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .exceptions import DataError

if TYPE_CHECKING:
    from .data.prepare import PreparedData

__all__ = ["add_prepare_data_command"]

# The library's defaults and choices, written out: olmolike.data imports torch, which would
# make `olmolike prepare-data --help` take seconds (test_cli_help.py checks they agree).
DEFAULT_SHARD_TOKENS = 1 << 28
PACKING_MODES = ("packed", "padded")
OVERLONG_POLICIES = ("error", "truncate", "drop")


def _run(args: argparse.Namespace) -> int:
    from .data.numpy_dataset import METADATA_FILE
    from .data.prepare import prepare_data
    from .data.prepared_io import SPLITS
    from .data.sources import stdlib_python_files
    from .data.tokenizer import TokenizerConfig

    inputs: list[str | Path] = list(args.inputs)
    if args.stdlib:
        inputs += stdlib_python_files()
    if not inputs:
        raise DataError("name INPUT files, folders or globs, or pass --stdlib")
    if args.sft and args.dpo:
        raise DataError("pass --sft or --dpo, not both: they prepare different data")
    if args.sft or args.dpo:
        return _prepare_fine_tuning_data(args, inputs)
    prepared = prepare_data(
        inputs,
        args.output,
        tokenizer=TokenizerConfig(identifier=args.tokenizer),
        text_field=args.text_field,
        val_fraction=args.val_fraction,
        seed=args.seed,
        workers=args.workers,
        shard_tokens=args.shard_tokens,
        overwrite=args.overwrite,
        progress=True,
        keep_binary=args.keep_binary,
    )
    for split in SPLITS:
        print(
            f"{split}: {prepared.num_tokens(split):,d} tokens in {len(prepared.paths(split))} shard(s)"
        )
    print(f"metadata: {prepared.output_dir / METADATA_FILE}")
    skipped = prepared.metadata.get("skipped", [])
    if skipped:
        print(
            f"warning: skipped {len(skipped)} of {len(skipped) + len(prepared.metadata['sources'])}"
            " input file(s) that are not UTF-8 text (listed under 'skipped' in the metadata); "
            "--keep-binary tokenizes them anyway",
            file=sys.stderr,
        )
    return _say_what_is_empty(prepared, args.val_fraction)


def _say_what_is_empty(prepared: PreparedData, val_fraction: float) -> int:
    """An empty validation split that was asked for is a warning: a run would find out only
    when its evaluator starts. (No training tokens is :func:`prepare_data`'s error.)"""
    if val_fraction > 0 and prepared.num_tokens("val") == 0:
        documents = sum(s["documents"] for s in prepared.metadata["splits"]["train"])
        _warn_empty_validation(val_fraction, f"{documents} document(s)", "documents")
    return 0


def _warn_empty_validation(val_fraction: float, of_what: str, more: str) -> None:
    print(
        f"warning: the validation split is empty: --val-fraction {val_fraction:g} of {of_what} "
        f"held none out; give more {more} or a larger --val-fraction",
        file=sys.stderr,
    )


def _prepare_fine_tuning_data(args: argparse.Namespace, inputs: list[str | Path]) -> int:
    """``--sft`` (chat examples -> sequences) or ``--dpo`` (preference pairs -> pair rows)."""
    from .data.numpy_dataset import METADATA_FILE
    from .data.preference_prepare import prepare_preference_data
    from .data.sft import prepare_sft_data
    from .data.tokenizer import TokenizerConfig

    flag = "--sft" if args.sft else "--dpo"
    if args.sequence_length is None:
        what = "the training sequences" if args.sft else "each side of a pair"
        raise DataError(f"{flag} needs --sequence-length: the length of {what}")
    common: dict[str, Any] = {
        "sequence_length": args.sequence_length,
        "tokenizer": TokenizerConfig(identifier=args.tokenizer),
        "chat_template": args.chat_template,
        "val_fraction": args.val_fraction,
        "seed": args.seed,
        "overwrite": args.overwrite,
    }
    if args.sft:
        metadata = prepare_sft_data(
            inputs, args.output, packing=args.packing, overlong=args.overlong, **common
        )
    else:
        metadata = prepare_preference_data(inputs, args.output, **common)
    length, unit = metadata["sequence_length"], "examples" if args.sft else "pairs"
    for split, stats in metadata["splits"].items():
        if args.sft:
            print(
                f"{split}: {stats['examples']:,d} examples in {stats['sequences']:,d} sequences "
                f"of {length} tokens, {stats['trained_tokens']:,d} trained tokens, padding "
                f"{stats['padding_fraction']:.1%}, {stats['truncated']} truncated, "
                f"{stats['dropped']} dropped"
            )
        else:
            print(
                f"{split}: {stats['pairs']:,d} pairs of {length} tokens a side, "
                f"{stats['scored_tokens']:,d} response tokens scored"
            )
    print(f"metadata: {Path(args.output) / METADATA_FILE}")
    if args.val_fraction > 0 and metadata["splits"]["val"][unit] == 0:
        _warn_empty_validation(
            args.val_fraction, f"{metadata['splits']['train'][unit]} {unit[:-1]}(s)", unit
        )
    return 0


def add_prepare_data_command(cmd: argparse.ArgumentParser) -> None:
    """The arguments of ``olmolike prepare-data`` (its parser and help come from
    :mod:`olmolike.cli`)."""
    cmd.add_argument("inputs", nargs="*", metavar="INPUT", help="files, folders or globs")
    cmd.add_argument("-o", "--output", required=True, help="the output directory")
    cmd.add_argument(
        "--tokenizer", default="byte", help="'byte' or a tokenizer.json file (default: byte)"
    )
    cmd.add_argument("--text-field", default="text", help="JSONL field holding the text")
    cmd.add_argument("--val-fraction", type=float, default=0.0, help="share of documents held out")
    cmd.add_argument("--seed", type=int, default=0, help="seed of the validation split")
    cmd.add_argument("--workers", type=int, default=1, help="processes tokenizing files")
    cmd.add_argument(
        "--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard"
    )
    cmd.add_argument("--overwrite", action="store_true", help="replace different earlier output")
    cmd.add_argument(
        "--keep-binary",
        action="store_true",
        help="tokenize files that are not UTF-8 text (NUL bytes, mostly invalid UTF-8) instead "
        "of skipping them with a warning; their invalid bytes become U+FFFD",
    )
    cmd.add_argument(
        "--stdlib",
        action="store_true",
        help="also use this Python's standard-library .py files (the embedded default corpus)",
    )
    fine_tuning = cmd.add_argument_group("fine-tuning data (--sft, --dpo)")
    fine_tuning.add_argument(
        "--sft",
        action="store_true",
        help="chat JSONL ('messages', or 'prompt'/'completion') -> sequences with label masks",
    )
    fine_tuning.add_argument(
        "--dpo",
        action="store_true",
        help="preference JSONL ('prompt', 'chosen', 'rejected', text or chat messages) -> "
        "pair rows for DPO (chat rendered with the chat template)",
    )
    fine_tuning.add_argument(
        "--sequence-length", type=int, help="tokens per training sequence (--dpo: per side)"
    )
    fine_tuning.add_argument(
        "--packing",
        choices=PACKING_MODES,
        default="packed",
        help="several examples per sequence, or one padded (default: %(default)s)",
    )
    fine_tuning.add_argument(
        "--overlong",
        choices=OVERLONG_POLICIES,
        default="error",
        help="what to do with an example longer than a sequence (default: %(default)s)",
    )
    fine_tuning.add_argument(
        "--chat-template", help="a Jinja file replacing the tokenizer's template"
    )
    cmd.set_defaults(run=_run)
