"""Messages a command-line user reads name the command-line flag."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from testutils import patient

from olmolike.cli import COMMANDS, build_parser, main


def test_export_hf_refusal_names_the_command_line_flag(tmp_path: Path) -> None:
    """A CLI user is told the flag (``--overwrite``), not only the Python argument."""
    from olmolike.nn import TransformerConfig
    from olmolike.nn.hf_export import export_hf

    config = TransformerConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2)
    state = config.build(seed=0).state_dict()
    export_hf(state, config, tmp_path)
    with pytest.raises(FileExistsError, match=r"pass --overwrite \(overwrite=True from Python\)"):
        export_hf(state, config, tmp_path)


def test_prepare_data_refusal_names_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "doc.txt").write_text("some text")
    args = ["prepare-data", str(tmp_path / "doc.txt"), "-o", str(tmp_path / "out")]
    assert main(args) == 0
    assert main([*args, "--val-fraction", "0.5"]) == 2
    assert "pass --overwrite" in capsys.readouterr().err


def test_top_level_help_imports_no_torch_and_has_no_markup() -> None:
    code = (
        "import sys\nfrom olmolike.cli import main\ntry:\n    main(['--help'])\n"
        "except SystemExit:\n    pass\nprint('torch imported:', 'torch' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=patient(60),
        check=True,
    )
    assert result.stdout.rstrip().endswith("torch imported: False")
    assert "``" not in result.stdout and ":class:" not in result.stdout
    assert all(name in result.stdout for name in COMMANDS)


def test_the_listed_help_is_each_command_s_own() -> None:
    full = build_parser(full=True)
    (subparsers,) = [a for a in full._actions if a.dest == "command"]
    helps = {action.dest: action.help for action in subparsers._choices_actions}
    assert helps == {name: help for name, (help, _) in COMMANDS.items()}


def test_generate_help_shows_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: 200)" in out and "(default: 0.8)" in out and "(default: 40)" in out
