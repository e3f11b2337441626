"""The ``olmolike`` command."""

from __future__ import annotations

import argparse
import platform
import sys
from collections.abc import Sequence

import torch

from . import __version__
from .exceptions import ConfigurationError
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
