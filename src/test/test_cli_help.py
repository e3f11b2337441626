"""``olmolike COMMAND --help`` answers at once: it imports neither torch nor matplotlib (each
costs seconds of CPU, tens of seconds on a busy machine), and it says what the command does
and what each argument means.

Each help runs in a fresh interpreter, so the modules it imported are exactly those left in
``sys.modules``; nothing here times anything (``src/benchmarks/cli_startup.py`` measures).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
from testutils import patient

from olmolike import cli, cli_prepare
from olmolike.cli import COMMANDS, build_parser

HEAVY = ("torch", "matplotlib", "numpy", "transformers")

_IMPORTED_BY_HELP = """
import json, sys
from olmolike.cli import main
try:
    main([sys.argv[1], "--help"])
except SystemExit:
    pass
print(json.dumps(sorted(m for m in {heavy} if m in sys.modules)), file=sys.stderr)
"""


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_imports_no_heavy_module(command: str | None) -> None:
    code = _IMPORTED_BY_HELP.format(heavy=HEAVY)
    args = [command] if command else ["--help"]
    if command is None:  # `olmolike --help`
        code = code.replace('main([sys.argv[1], "--help"])', 'main(["--help"])')
    result = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=patient(60)
    )
    assert result.returncode == 0, result.stderr
    assert "usage: olmolike" in result.stdout
    assert json.loads(result.stderr.splitlines()[-1]) == []


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser(full=True)
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_has_a_description_and_every_argument_help(command: str) -> None:
    parser = _subparsers()[command]
    assert parser.description and len(parser.description) > 30
    assert [a.dest for a in parser._actions if not a.help] == []


def test_the_choices_written_out_for_a_fast_help_are_the_librarys() -> None:
    from olmolike.data.prepare import DEFAULT_SHARD_TOKENS
    from olmolike.data.sft import OverlongPolicy, PackingMode
    from olmolike.distributed.unshard import UnshardStrategyType

    assert tuple(s.value for s in UnshardStrategyType) == cli.UNSHARD_STRATEGIES
    assert cli.UNSHARD_STRATEGIES[0] == UnshardStrategyType.one_file
    assert tuple(m.value for m in PackingMode) == cli_prepare.PACKING_MODES
    assert tuple(p.value for p in OverlongPolicy) == cli_prepare.OVERLONG_POLICIES
    assert cli_prepare.DEFAULT_SHARD_TOKENS == DEFAULT_SHARD_TOKENS
