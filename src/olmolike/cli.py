"""The olmolike command: prepare data, train, sample, evaluate, export and plot.

Only the chosen subcommand's module is imported (most import torch, seconds of CPU), so
``olmolike --help`` and a mistyped command answer at once.
"""

from __future__ import annotations

import argparse
import importlib
import platform
import shlex
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from . import __version__
from .exceptions import ConfigurationError, DiskFullError, OLMoLikeError, RankLostError

if TYPE_CHECKING:
    import torch

__all__ = ["COMMANDS", "build_parser", "main"]

DESCRIPTION = "olmolike: prepare data, train, sample, evaluate, export and plot language models."

COMMANDS: dict[str, tuple[str, str]] = {
    "info": ("print versions and available accelerators", "olmolike.cli:_add_info_command"),
    "check-config": (
        "validate a trainer config file (YAML or JSON) with overrides and print the result",
        "olmolike.cli:_add_check_config_command",
    ),
    "unshard": (
        "write the model (and optimizer) state of a checkpoint as plain torch or safetensors "
        "files, which load without torch.distributed",
        "olmolike.cli:_add_unshard_command",
    ),
    "generate": (
        "sample text from a training checkpoint (stepN folder)",
        "olmolike.cli:_add_generate_command",
    ),
    "export-hf": (
        "write a checkpoint's model in the Hugging Face format, as LlamaForCausalLM or "
        "Olmo2ForCausalLM (model.safetensors + config.json)",
        "olmolike.cli:_add_export_hf_command",
    ),
    "prepare-data": (
        "tokenize text/JSONL files into memory-mappable .npy token shards for training",
        "olmolike.cli_prepare:add_prepare_data_command",
    ),
    "plot": (
        "draw loss / learning rate / throughput curves of one or more runs into a PNG",
        "olmolike.plot:add_plot_command",
    ),
    "evaluate": (
        "print the cross-entropy loss and perplexity of a checkpoint on token data",
        "olmolike.cli_args:add_evaluate_command",
    ),
    "plan": (
        "print a config's memory per GPU (parameters, gradients, optimizer state, "
        "activations) and the parallel layouts that fit N GPUs, cheapest first",
        "olmolike.cli:_add_plan_command",
    ),
    "train": (
        "train from an experiment config file (YAML or JSON) with dotted overrides; under "
        "torchrun: torchrun --nproc-per-node=N -m olmolike train CONFIG.yaml",
        "olmolike.cli_args:add_train_command",
    ),
}
"""Subcommand -> (its one-line help, ``module:function`` that adds its arguments to the
subcommand's parser, made here with that help)."""


def _info(_: argparse.Namespace) -> int:
    import torch

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
    from .train import TrainerConfig

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
    from .distributed.unshard import UnshardStrategy, UnshardStrategyType, unshard_checkpoint

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


# UnshardStrategyType's values, written out: its module imports torch, which would make
# `olmolike unshard --help` take seconds (test_cli_help.py checks they agree).
UNSHARD_STRATEGIES = ("one_file", "one_file_per_tensor", "chunks")


def _add_unshard_command(unshard: argparse.ArgumentParser) -> None:
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
        choices=UNSHARD_STRATEGIES,
        default=UNSHARD_STRATEGIES[0],
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
    if args.tp < 1:
        raise ConfigurationError(f"must be >= 1, got {args.tp}", path="tp")
    if args.nproc_per_node is not None:
        return _launch_generate(args)
    if args.tp == 1:
        return _sample_and_print(args, args.device)
    import torch

    from .distributed.utils import get_local_rank, is_distributed, launched_distributed
    from .train import prepare_training_environment, teardown_training_environment

    if not (is_distributed() or launched_distributed()):
        command = ["olmolike", "generate", f"--nproc-per-node={args.tp}", *_command_args(args)]
        raise ConfigurationError(
            f"splits the model over {args.tp} ranks: start them with {shlex.join(command)}",
            path="tp",
        )
    prepared = not is_distributed()
    if prepared:
        prepare_training_environment()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:  # each rank its own GPU
        device = torch.device("cuda", get_local_rank())
    try:
        return _sample_and_print(args, device)
    finally:
        if prepared:
            teardown_training_environment()


def _command_args(args: argparse.Namespace) -> list[str]:
    """The arguments the subcommand was given (after its name), as typed."""
    argv: list[str] = args.argv
    return argv[argv.index(args.command) + 1 :]


def _launch_generate(args: argparse.Namespace) -> int:
    """``generate --nproc-per-node N``: start N ranks here, each running ``generate --tp N``."""
    from .distributed.utils import launched_distributed
    from .launch import launch, without_option

    nproc = args.nproc_per_node
    if nproc < 1:
        raise ConfigurationError(f"must be >= 1, got {nproc}", path="--nproc-per-node")
    if launched_distributed():
        raise ConfigurationError(
            "starts the ranks itself: drop it under torchrun (or drop torchrun)",
            path="--nproc-per-node",
        )
    if args.tp not in (1, nproc):
        raise ConfigurationError(
            f"is {args.tp} but --nproc-per-node starts {nproc} ranks, one per part of the "
            f"model: give both the same number",
            path="--tp",
        )
    rest = without_option(_command_args(args), "--nproc-per-node", len("--np"))
    tp = [] if args.tp == nproc else ["--tp", str(nproc)]
    return launch(nproc, ["generate", *rest, *tp])


def _sample_and_print(args: argparse.Namespace, device: str | torch.device) -> int:
    """Load the checkpoint (split over ``args.tp`` ranks) and print the samples; under tensor
    parallelism every rank samples the same text and rank 0 prints it."""
    from .distributed.utils import get_rank
    from .inference import generate_text, load_checkpoint_model

    try:
        loaded = load_checkpoint_model(args.checkpoint, device=device, tensor_parallel=args.tp)
        printing = get_rank() == 0
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
            if printing:
                print(args.prompt + text)
            if printing and i + 1 < args.num_samples:
                print("-" * 40)
    except ValueError as e:  # bad sampling arguments
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _add_generate_command(generate: argparse.ArgumentParser) -> None:
    generate.description = (
        "Sample text from a checkpoint, with a KV cache (one forward call per new "
        "token over that token alone)."
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
    generate.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="N",
        help="split the model over N ranks with tensor parallelism, for a model too large for "
        "one device: start them with --nproc-per-node N (or run under torchrun "
        "--nproc-per-node=N -m olmolike generate ...); loads a checkpoint of any layout and "
        "prints the text one process prints (default: %(default)s)",
    )
    generate.add_argument(
        "--nproc-per-node",
        type=int,
        metavar="N",
        help="start N ranks on this machine that split the model (--tp N), without torchrun",
    )
    generate.set_defaults(run=_generate)


def _export_hf(args: argparse.Namespace) -> int:
    from .inference import export_checkpoint_to_hf

    out = export_checkpoint_to_hf(args.checkpoint, args.output, overwrite=args.overwrite)
    print(out)
    return 0


def _add_export_hf_command(export: argparse.ArgumentParser) -> None:
    export.add_argument("checkpoint", help="a checkpoint folder, e.g. runs/my-run/step600")
    export.add_argument("output", help="the directory to write into")
    export.add_argument("--overwrite", action="store_true", help="replace existing files")
    export.set_defaults(run=_export_hf)


def _plan(args: argparse.Namespace) -> int:
    from .experiment import load_experiment
    from .plan.report import config_layout, plan_report

    # Options may follow the config file too (`plan CONFIG --gpus 8`): the rest are overrides.
    parser = argparse.ArgumentParser(prog="olmolike plan", add_help=False)
    _add_plan_options(parser)
    args, overrides = parser.parse_known_args(args.overrides, namespace=args)
    if args.gpus is None or args.gpu_memory is None:
        raise ConfigurationError("olmolike plan needs --gpus N and --gpu-memory GB (per GPU)")
    if args.gpus < 1:
        raise ConfigurationError(f"--gpus must be at least 1, got {args.gpus}")
    config = load_experiment(args.config, overrides)
    module = config.train_module
    # The config's own tp_config/pp_config/cp_config unless the flags say otherwise.
    tp = args.tp if args.tp is not None else (module.tp_config.degree if module.tp_config else 1)
    pp = args.pp if args.pp is not None else (module.pp_config.degree if module.pp_config else 1)
    cp = args.cp if args.cp is not None else (module.cp_config.degree if module.cp_config else 1)
    ep = args.ep if args.ep is not None else (module.ep_config.degree if module.ep_config else 1)
    layout = config_layout(module, args.gpus, args.gpus_per_node, tp, pp, cp, ep)
    batch = config.data_loader.global_batch_size
    print(plan_report(config.model, module, layout, args.gpu_memory, args.reserve, batch), end="")
    return 0


def _add_plan_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpus", type=int, metavar="N", help="GPUs in the job (required)")
    parser.add_argument(
        "--gpu-memory",
        type=float,
        metavar="GB",
        help="memory of one GPU in GiB, e.g. 80 for an H100 80GB (required)",
    )
    parser.add_argument(
        "--reserve",
        type=float,
        default=2.0,
        metavar="GB",
        help="GiB per GPU kept back for the CUDA context, NCCL and allocator fragmentation "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--gpus-per-node",
        type=int,
        default=8,
        metavar="N",
        help="for HSDP without num_replicas: one replica group per node (default: %(default)s)",
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=None,
        help="tensor-parallel degree of the layout (default: the config's "
        "train_module.tp_config.degree, else 1)",
    )
    parser.add_argument(
        "--pp",
        type=int,
        default=None,
        help="pipeline ranks of the layout, with the config's pp_config schedule, else 1F1B "
        "(default: the config's train_module.pp_config.degree, else 1)",
    )
    parser.add_argument(
        "--cp",
        type=int,
        default=None,
        help="context-parallel degree of the layout: each sequence split over that many ranks "
        "(default: the config's train_module.cp_config.degree, else 1)",
    )
    parser.add_argument(
        "--ep",
        type=int,
        default=None,
        help="expert-parallel degree of the layout: each MoE layer's experts split over that "
        "many of the ranks FSDP/HSDP shard over (default: the config's "
        "train_module.ep_config.degree, else 1)",
    )


def _add_plan_command(plan: argparse.ArgumentParser) -> None:
    plan.description = (
        "Plan the memory of a training run without a GPU. For the config's layout "
        "on --gpus GPUs (dp_config: DDP replicates, FSDP shards over all, HSDP over groups; "
        "with --tp, --pp, --cp and --ep), print the bytes of the busiest rank: parameters, gradients and "
        "optimizer state (exactly what the ranks hold), buffers, communication buffers, and "
        "activations of one micro-batch (rank_microbatch_size tokens) with and without "
        "activation checkpointing, by the formula printed below them, and the longest sequence "
        "that would fit. Then list every layout pp x dp_replicate x dp_shard x cp x tp of "
        "--gpus that fits in --gpu-memory, cheapest first: fewer pipeline stages, then less "
        "tensor parallelism, then less context parallelism, then no activation "
        "checkpointing, then less sharding, each with its longest sequence. Example: olmolike "
        "plan run.yaml --gpus 8 --gpu-memory 80 --train_module.rank_microbatch_size=8192. See "
        "docs/memory-planner.md."
    )
    plan.add_argument("config", help="the experiment config file that olmolike train reads")
    _add_plan_options(plan)
    plan.add_argument("overrides", nargs=argparse.REMAINDER, help="--dotted.key=value ...")
    plan.set_defaults(run=_plan)


def _add_info_command(info: argparse.ArgumentParser) -> None:
    info.description = (
        "Print the versions of olmolike, Python and torch, the CUDA devices torch sees and "
        "whether the gloo backend (distributed training on CPUs) is available: what a bug "
        "report needs."
    )
    info.set_defaults(run=_info)


def _add_check_config_command(check: argparse.ArgumentParser) -> None:
    check.description = (
        "Read a TrainerConfig file (YAML or JSON), apply dotted overrides, check every field "
        "and print the result as YAML with every default filled in; a mistake is one line "
        "naming the field. For a whole experiment file (model, data, trainer), use olmolike "
        "train CONFIG --dry-run."
    )
    check.add_argument(
        "path", help="the trainer config file (.yaml, .yml or .json; local or a URL)"
    )
    check.add_argument("overrides", nargs=argparse.REMAINDER, help="--dotted.key=value ...")
    check.set_defaults(run=_check_config)


def _adder(name: str) -> Callable[[argparse.ArgumentParser], None]:
    module, function = COMMANDS[name][1].split(":")
    adder: Callable[[argparse.ArgumentParser], None] = getattr(
        importlib.import_module(module), function
    )
    return adder


def build_parser(command: str | None = None, *, full: bool = False) -> argparse.ArgumentParser:
    """The parser, with the full arguments of ``command`` (or of every command, ``full``).

    The other commands are listed by name and help only, without importing their modules.
    """
    parser = argparse.ArgumentParser(prog="olmolike", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"olmolike {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (help, _) in COMMANDS.items():
        if full or name == command:
            # The one-line help is the description, unless the command writes a longer one.
            description = f"{help[0].upper()}{help[1:]}."
            _adder(name)(commands.add_parser(name, help=help, description=description))
        else:
            commands.add_parser(name, help=help, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command if command in COMMANDS else None).parse_args(argv)
    args.argv = argv  # as typed, for the commands an error suggests
    try:
        return int(args.run(args))
    except (OLMoLikeError, FileExistsError) as e:
        # Mistakes the user can fix get one line naming the problem, not a traceback; under
        # torchrun only from the job's first failing rank (the others usually fail alike),
        # except a lost rank's, which every rank left says. torchrun's summary shows it too.
        from .distributed.failure import print_uncaught, report_rank_failure, tell_torchrun

        if _explained_failure(e):  # the error it explains goes to a file the line names
            print_uncaught(type(e), e, e.__traceback__)
        elif report_rank_failure(e):
            print(f"error: {e}", file=sys.stderr)
            tell_torchrun(f"error: {e}")
        return 2


def _explained_failure(error: BaseException) -> bool:
    """Whether ``error`` stands for another one: a lost rank's, a full disk's (from a run)."""
    return isinstance(error, (RankLostError, DiskFullError))


if __name__ == "__main__":
    sys.exit(main())
