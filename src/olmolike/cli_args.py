"""The arguments of the subcommands whose modules import torch: ``train``, ``evaluate``.

They are defined here, in a module that imports nothing heavy, so that ``olmolike train
--help`` answers in a few hundredths of a second instead of the seconds that importing torch
takes; the command itself imports its module when it runs (:func:`deferred`).
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable

__all__ = ["add_evaluate_command", "add_train_command", "deferred"]


def deferred(target: str) -> Callable[[argparse.Namespace], int]:
    """The subcommand function ``module:function``, imported only when it is called."""
    module, function = target.split(":")

    def run(args: argparse.Namespace) -> int:
        return int(getattr(importlib.import_module(module), function)(args))

    return run


def add_train_command(cmd: argparse.ArgumentParser) -> None:
    """The arguments of ``olmolike train`` (its parser and help come from :mod:`olmolike.cli`)."""
    cmd.description = (
        "Train from an experiment config file: model, train_module, dataset, "
        "data_loader, trainer (the train_lm example's --dry-run prints one). The train "
        "module's _CLASS_ picks pretraining or SFT (transformer), dpo or grpo, and the "
        "dataset's _CLASS_ its data (numpy, sft, preference_pairs, prompts). GRPO's reward "
        "functions come from installed packages' olmolike.rewards entry points. Any field can "
        "be overridden: --trainer.max_duration.value=100."
    )
    cmd.add_argument(
        "--nproc-per-node",
        type=int,
        metavar="N",
        help="start N ranks on this machine (gloo on CPU, NCCL on GPUs) instead of one process, "
        "without torchrun; give it before the config file",
    )
    cmd.add_argument(
        "--max-restarts",
        type=int,
        metavar="K",
        help="when a rank fails, start all ranks again from the latest checkpoint, up to K "
        "times (as torchrun --max-restarts; not after Ctrl-C); give it before the config file",
    )
    cmd.add_argument("config", help="the experiment config file (.yaml, .yml or .json)")
    cmd.add_argument(
        "--dry-run", action="store_true", help="print the config with the overrides; train nothing"
    )
    cmd.add_argument("overrides", nargs=argparse.REMAINDER, help="--dotted.key=value ...")
    cmd.set_defaults(run=deferred("olmolike.experiment:train_command"))


def add_evaluate_command(evaluate: argparse.ArgumentParser) -> None:
    """The arguments of ``olmolike evaluate`` (held-out loss and perplexity of a checkpoint)."""
    evaluate.description = (
        "Print the cross-entropy loss (nats per token) and perplexity of a checkpoint's model "
        "on token data, such as the validation split that prepare-data wrote: every "
        "instance of --sequence-length tokens, --batch-size at a time. Example: olmolike "
        "evaluate runs/my-run --data data/stdlib/val"
    )
    evaluate.add_argument(
        "checkpoint", help="a checkpoint folder (runs/my-run/step600) or a save folder (its newest)"
    )
    evaluate.add_argument(
        "--data",
        nargs="+",
        action="extend",
        required=True,
        metavar="PATH_OR_GLOB",
        help="token files (.npy/.bin), folders of them, or globs, as prepare-data writes them "
        "(repeatable; put the checkpoint first or it is taken for data)",
    )
    evaluate.add_argument(
        "--sequence-length",
        type=int,
        metavar="N",
        help="tokens per instance (default: the experiment config's dataset.sequence_length)",
    )
    evaluate.add_argument(
        "--batch-size",
        type=int,
        default=8,
        metavar="N",
        help="instances per forward pass (default: %(default)s)",
    )
    evaluate.add_argument(
        "--max-batches",
        type=int,
        metavar="N",
        help="evaluate at most this many batches (default: all data)",
    )
    evaluate.add_argument(
        "--device",
        default="cpu",
        help="where the model runs: cpu, cuda, cuda:1, mps, ... (default: %(default)s)",
    )
    evaluate.set_defaults(run=deferred("olmolike.inference:evaluate_command"))
