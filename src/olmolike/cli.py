"""The ``olmolike`` command."""

from __future__ import annotations

import argparse
import platform
import sys
from collections.abc import Sequence

import torch

from . import __version__
from .data.prepare import add_prepare_data_command
from .distributed.unshard import UnshardStrategy, UnshardStrategyType, unshard_checkpoint
from .exceptions import ConfigurationError, OLMoLikeError
from .inference import add_evaluate_command
from .plot import add_plot_command
from .train import TrainerConfig

__all__ = ["main"]


def _info(_: argparse.Namespace) -> int:
    print(f"olmolike {__version__}")
    print(f"python   {platform.python_version()}")
    print(f"torch    {torch.__version__}")
    cuda = (
        f"{torch.cuda.device_count()} device(s)" if torch.cuda.is_available() else "not available"
    )
    print(f"cuda     {cuda}")
    print(f"gloo     {'available' if torch.distributed.is_gloo_available() else 'not available'}")
    return 0


def _check_config(args: argparse.Namespace) -> int:
    try:
        config = (
            TrainerConfig.from_json(args.path, args.overrides)
            if args.path.endswith(".json")
            else TrainerConfig.from_yaml(args.path, args.overrides)
        )
    except (ConfigurationError, OSError) as e:  # OSError: a missing or unreadable file
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(config.to_yaml(), end="")
    return 0


def _unshard(args: argparse.Namespace) -> int:
    strategy = UnshardStrategy(
        name=UnshardStrategyType(args.strategy), chunk_size_bytes=args.chunk_size
    )
    model_path, optim_path = unshard_checkpoint(
        args.checkpoint,
        args.output,
        optim=args.optim,
        save_overwrite=args.overwrite,
        use_safetensors=args.safetensors,
        unshard_strategy=strategy,
        quiet=False,
    )
    print(model_path)
    if optim_path is not None:
        print(optim_path)
    return 0


def _add_unshard_command(commands: argparse._SubParsersAction) -> None:
    unshard = commands.add_parser(
        "unshard",
        help="write the model (and optimizer) state of a checkpoint as plain torch or "
        "safetensors files, which load without torch.distributed",
    )
    unshard.add_argument("checkpoint", help="a train checkpoint folder (stepN) or a DCP directory")
    unshard.add_argument("output", help="the directory to write the files into")
    unshard.add_argument(
        "--safetensors", action="store_true", help="write the model weights as safetensors"
    )
    unshard.add_argument(
        "--optim", action="store_true", help="also write the optimizer state (optim.pt)"
    )
    unshard.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    unshard.add_argument(
        "--strategy",
        choices=[s.value for s in UnshardStrategyType],
        default=UnshardStrategyType.one_file.value,
        help="one model file, one file per tensor, or chunks of whole tensors (default: %(default)s)",
    )
    unshard.add_argument(
        "--chunk-size",
        type=int,
        metavar="BYTES",
        help="with --strategy chunks: the most tensor bytes per file",
    )
    unshard.set_defaults(run=_unshard)


def _generate(args: argparse.Namespace) -> int:
    from .inference import generate_text, load_checkpoint_model

    try:
        loaded = load_checkpoint_model(args.checkpoint, device=args.device)
        for i in range(args.num_samples):
            text = generate_text(
                loaded,
                args.prompt,
                max_new_tokens=args.max_new_tokens,
                temperature=args.temperature,
                top_k=args.top_k,
                top_p=args.top_p,
                seed=args.seed + i,
                use_cache=args.use_cache,
            )
            print(args.prompt + text)
            if i + 1 < args.num_samples:
                print("-" * 40)
    except ValueError as e:  # bad sampling arguments
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _add_generate_command(commands: argparse._SubParsersAction) -> None:
    generate = commands.add_parser(
        "generate",
        help="sample text from a training checkpoint (stepN folder)",
        description="Sample text from a checkpoint, with a KV cache (one forward call per new "
        "token over that token alone).",
    )
    generate.add_argument(
        "checkpoint", help="a checkpoint folder (runs/my-run/step600) or a save folder (its newest)"
    )
    generate.add_argument(
        "--prompt", default="", help="text to continue (default: none, the start of a document)"
    )
    generate.add_argument(
        "--max-new-tokens", type=int, default=200, help="tokens to sample (default: %(default)s)"
    )
    generate.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        help="0 picks the likeliest token (greedy) (default: %(default)s)",
    )
    generate.add_argument(
        "--top-k",
        type=int,
        default=40,
        help="sample among the k likeliest tokens only (default: %(default)s)",
    )
    generate.add_argument(
        "--top-p",
        type=float,
        default=None,
        help="sample from the smallest set of likeliest tokens reaching this probability "
        "(default: off)",
    )
    generate.add_argument(
        "--seed", type=int, default=0, help="same seed, same text (default: %(default)s)"
    )
    generate.add_argument(
        "--num-samples",
        type=int,
        default=1,
        help="samples to print, with seeds seed, seed+1, ... (default: %(default)s)",
    )
    generate.add_argument(
        "--device", default="cpu", help="where the model runs (default: %(default)s)"
    )
    generate.add_argument(
        "--no-kv-cache",
        dest="use_cache",
        action="store_false",
        help="recompute the whole context for every token instead of caching keys and values "
        "(slower, the same text; default: cache on)",
    )
    generate.set_defaults(run=_generate)


def _export_hf(args: argparse.Namespace) -> int:
    from .inference import export_checkpoint_to_hf

    out = export_checkpoint_to_hf(args.checkpoint, args.output, overwrite=args.overwrite)
    print(out)
    return 0


def _add_export_hf_command(commands: argparse._SubParsersAction) -> None:
    export = commands.add_parser(
        "export-hf",
        help="write a checkpoint's model in the Hugging Face format, as LlamaForCausalLM or "
        "Olmo2ForCausalLM (model.safetensors + config.json)",
    )
    export.add_argument("checkpoint", help="a checkpoint folder, e.g. runs/my-run/step600")
    export.add_argument("output", help="the directory to write into")
    export.add_argument("--overwrite", action="store_true", help="replace existing files")
    export.set_defaults(run=_export_hf)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="olmolike", description=__doc__)
    parser.add_argument("--version", action="version", version=f"olmolike {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="print versions and available accelerators")
    info.set_defaults(run=_info)
    check = commands.add_parser(
        "check-config",
        help="validate a trainer config file (YAML or JSON) with overrides and print the result",
    )
    check.add_argument("path")
    check.add_argument("overrides", nargs=argparse.REMAINDER, help="--dotted.key=value ...")
    check.set_defaults(run=_check_config)
    _add_unshard_command(commands)
    _add_generate_command(commands)
    _add_export_hf_command(commands)
    add_prepare_data_command(commands)
    add_plot_command(commands)
    add_evaluate_command(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except (OLMoLikeError, FileExistsError) as e:
        # Mistakes the user can fix get one line naming the problem, not a traceback.
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
