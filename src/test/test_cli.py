"""The ``olmolike`` command: ``info``, ``check-config`` and ``--version``, run in-process."""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import pytest
import torch
import yaml

import olmolike
from olmolike.cli import main
from olmolike.train import Duration, LoadStrategy, StepSkipRange, TrainerConfig
from olmolike.train.callbacks import ConsoleLoggerCallback


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


@pytest.fixture
def config_file(tmp_path: Path) -> str:
    return write(
        tmp_path / "trainer.yaml",
        "save_folder: /tmp/run\n"
        "max_duration: {value: 10, unit: steps}\n"
        "callbacks:\n"
        "  log: {_CLASS_: console_logger, log_interval: 2}\n",
    )


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"olmolike {olmolike.__version__}"


def test_a_command_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    assert "command" in capsys.readouterr().err


def test_info_prints_versions(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line.split(maxsplit=1)[1] for line in out.splitlines()}
    assert lines["olmolike"] == olmolike.__version__
    assert lines["python"] == platform.python_version()
    assert lines["torch"] == torch.__version__
    assert {"cuda", "gloo"} <= set(lines)


def test_check_config_prints_the_validated_yaml(
    config_file: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check-config", config_file]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    printed = TrainerConfig.from_dict(yaml.safe_load(captured.out))
    assert printed == TrainerConfig(
        save_folder="/tmp/run",
        max_duration=Duration.steps(10),
        callbacks={"log": ConsoleLoggerCallback(log_interval=2)},
    )
    # defaults are filled in, so the output is the complete config
    assert "metrics_collect_interval: 5" in captured.out
    assert "_CLASS_: olmolike.train.callbacks.console_logger.ConsoleLoggerCallback" in captured.out


def test_check_config_applies_overrides(
    config_file: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "check-config",
        config_file,
        "--max_duration.value=100",
        "--load_strategy=always",
        "--no_evals",
        "--steps_to_skip=[{start: 3, stop: 5}]",
        "callbacks.log.log_interval=7",
    ]
    assert main(argv) == 0
    cfg = TrainerConfig.from_dict(yaml.safe_load(capsys.readouterr().out))
    assert cfg.max_duration == Duration.steps(100)
    assert cfg.load_strategy is LoadStrategy.always
    assert cfg.no_evals is True
    assert cfg.steps_to_skip == [StepSkipRange(3, 5)]
    assert cfg.callbacks["log"] == ConsoleLoggerCallback(log_interval=7)


def test_check_config_reads_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = TrainerConfig(save_folder="gs://bucket/run", hard_stop=Duration.tokens(5))
    path = write(tmp_path / "trainer.json", cfg.to_json())
    assert main(["check-config", path, "--hard_stop.value=6"]) == 0
    assert TrainerConfig.from_dict(yaml.safe_load(capsys.readouterr().out)) == cfg.replace(
        hard_stop=Duration.tokens(6)
    )


def test_check_config_output_is_accepted_back(
    config_file: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check-config", config_file, "--device=cpu"]) == 0
    first = capsys.readouterr().out
    again = write(tmp_path / "again.yaml", first)
    assert main(["check-config", again]) == 0
    assert capsys.readouterr().out == first


@pytest.mark.parametrize(
    ("override", "path"),
    [
        ("--max_duration.valu=5", "max_duration.valu"),
        ("--max_duraton.value=5", "max_duraton"),
        ("--max_duration.value=abc", "max_duration.value"),
        ("--metrics_collect_interval=0", "metrics_collect_interval"),
        ("--callbacks.log.log_intervall=3", "callbacks.log.log_intervall"),
        ("--load_strategy=sometimes", "load_strategy"),
    ],
)
def test_check_config_bad_override_exits_2_and_names_the_path(
    config_file: str, override: str, path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check-config", config_file, override]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"error: {path}: ")


def test_check_config_lists_valid_keys(
    config_file: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check-config", config_file, "--max_duration.valu=5"]) == 2
    assert "valid keys of Duration are: value, unit" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("name", "text", "words"),
    [
        ("list.yaml", "- 1\n", "must hold a mapping at the top level"),
        ("bad.yaml", "save_folder: [1\n", "is not valid YAML"),
        ("bad.json", '{"save_folder": ', "is not valid JSON"),
        ("missing.yaml", None, "No such file"),
        ("unknown.yaml", "save_folder: /s\nbogus: 1\n", "bogus: unknown key 'bogus'"),
        ("required.yaml", "work_dir: /w\n", "missing required key: save_folder"),
    ],
)
def test_check_config_bad_file_exits_2(
    tmp_path: Path, name: str, text: str | None, words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    assert main(["check-config", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: ")
    assert words in captured.err


def test_check_config_never_imports_a_named_class(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    module = next(
        (m for m in ("ftplib", "smtplib", "imaplib", "poplib") if m not in sys.modules), None
    )
    if module is None:
        pytest.skip("every candidate module is already imported")
    path = write(
        tmp_path / "evil.yaml", f"save_folder: /s\ncallbacks:\n  x: {{_CLASS_: {module}.Thing}}\n"
    )
    assert main(["check-config", path]) == 2
    assert f"error: callbacks.x: unknown class '{module}.Thing'" in capsys.readouterr().err
    assert module not in sys.modules
