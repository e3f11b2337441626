"""olmolike.inference: finding checkpoints and configs, loading, sampling, exporting; the CLI's errors."""

from __future__ import annotations

import copy
import json
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from testutils import patient

from olmolike.cli import main
from olmolike.data import TokenTensorDataLoader
from olmolike.data.tokenizer import ByteTokenizer, TokenizerConfig
from olmolike.exceptions import CheckpointError
from olmolike.inference import (
    LoadedCheckpoint,
    export_checkpoint_to_hf,
    find_experiment_config,
    generate_text,
    load_checkpoint_model,
    resolve_checkpoint,
)
from olmolike.nn import TransformerConfig
from olmolike.optim import AdamWConfig
from olmolike.testing import random_token_instances
from olmolike.train import Callback, Duration, TrainerConfig
from olmolike.train.callbacks import CheckpointerCallback, ConfigSaverCallback
from olmolike.train.train_module import TransformerTrainModuleConfig

SEQ_LEN = 16
# Padded past the byte tokenizer's 258 ids, as the train_lm example pads it: rows no text uses.
MODEL = TransformerConfig(
    vocab_size=384, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_sequence_length=64
)


@dataclass
class ParamsAfterStep(Callback):
    """Copies of the model's weights at the end of every step."""

    params: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)

    def post_step(self) -> None:
        model = self.trainer.train_module.model  # type: ignore[attr-defined]
        self.params[self.step] = {k: v.detach().clone() for k, v in model.state_dict().items()}


@dataclass
class Run:
    save: Path
    config: dict[str, Any]
    params: dict[int, dict[str, torch.Tensor]]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """Two trained steps, a checkpoint after each, config.json, and a half-written step9."""
    save = tmp_path_factory.mktemp("run")
    config = {"model": MODEL.as_config_dict(), "tokenizer": TokenizerConfig().as_config_dict()}
    module = TransformerTrainModuleConfig(
        rank_microbatch_size=4 * SEQ_LEN, optim=AdamWConfig(lr=1e-2)
    ).build(MODEL.build(seed=0))
    loader = TokenTensorDataLoader(
        random_token_instances(32, SEQ_LEN, ByteTokenizer.VOCAB_SIZE, seed=1),
        global_batch_size=4 * SEQ_LEN,
    )
    params = ParamsAfterStep()
    trainer = TrainerConfig(
        save_folder=str(save),
        device="cpu",
        max_duration=Duration.steps(2),
        callbacks={
            "checkpointer": CheckpointerCallback(save_interval=1, pre_train_checkpoint=False),
            "config_saver": ConfigSaverCallback(config=config),
            "params": params,
        },
    ).build(module, loader)
    trainer.fit()
    # A save that died before its marker was written: never a checkpoint to use.
    (save / "step9" / "model_and_optim").mkdir(parents=True)
    return Run(save, config, params.params)


@pytest.fixture(scope="module")
def loaded(run: Run) -> LoadedCheckpoint:
    return load_checkpoint_model(run.save)


# -- finding checkpoints and configs ---------------------------------------------------------


def test_resolve_a_step_folder(run: Run) -> None:
    assert resolve_checkpoint(str(run.save / "step1")) == str(run.save / "step1")


def test_resolve_a_save_folder_takes_the_newest_complete_checkpoint(run: Run) -> None:
    assert (run.save / "step9").is_dir()
    assert resolve_checkpoint(str(run.save)) == str(run.save / "step2")


@pytest.mark.parametrize("which", ["empty", "missing", "incomplete"])
def test_resolve_without_a_checkpoint_is_a_clear_error(
    run: Run, tmp_path: Path, which: str
) -> None:
    path = {"empty": tmp_path, "missing": tmp_path / "nope", "incomplete": run.save / "step9"}
    with pytest.raises(CheckpointError, match="neither a complete checkpoint nor a save folder"):
        resolve_checkpoint(str(path[which]))


def test_config_found_in_the_save_folder_above_the_checkpoint(run: Run) -> None:
    assert find_experiment_config(str(run.save / "step2")) == run.config
    assert find_experiment_config(str(run.save / "step2") + "/") == run.config


def test_config_in_the_checkpoint_folder_comes_first(tmp_path: Path) -> None:
    (tmp_path / "step5").mkdir()
    (tmp_path / "config.json").write_text(json.dumps({"where": "save folder"}))
    assert find_experiment_config(str(tmp_path / "step5")) == {"where": "save folder"}
    (tmp_path / "step5" / "config.json").write_text(json.dumps({"where": "checkpoint"}))
    assert find_experiment_config(str(tmp_path / "step5")) == {"where": "checkpoint"}


def test_missing_config_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "step5").mkdir()
    with pytest.raises(CheckpointError, match=r"no config\.json in .*ConfigSaverCallback"):
        find_experiment_config(str(tmp_path / "step5"))


# -- loading ---------------------------------------------------------------------------------


def test_loads_the_trained_weights_exactly(run: Run, loaded: LoadedCheckpoint) -> None:
    got = loaded.model.state_dict()
    assert set(got) == set(run.params[2])
    assert all(torch.equal(got[k], v) for k, v in run.params[2].items())
    assert not loaded.model.training
    assert loaded.config == run.config
    assert isinstance(loaded.tokenizer, ByteTokenizer)


def test_loads_the_step_asked_for(run: Run) -> None:
    got = load_checkpoint_model(run.save / "step1").model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in run.params[1].items())
    assert not all(torch.equal(got[k], v) for k, v in run.params[2].items())


@pytest.mark.parametrize("section", ["model", "tokenizer"])
def test_config_without_a_section_is_an_error(run: Run, tmp_path: Path, section: str) -> None:
    checkpoint = tmp_path / "step1"
    shutil.copytree(run.save / "step1", checkpoint)
    (checkpoint / "config.json").unlink()  # so the save folder's copy, written next, is used
    partial = {k: v for k, v in run.config.items() if k != section}
    (tmp_path / "config.json").write_text(json.dumps(partial))
    with pytest.raises(CheckpointError, match=f"no '{section}' section"):
        load_checkpoint_model(checkpoint)


# -- sampling --------------------------------------------------------------------------------


def greedy_reference(loaded: LoadedCheckpoint, prompt: str, max_new_tokens: int) -> str:
    """Argmax over the tokenizer's ids, one token at a time, stopping after EOS."""
    tokenizer = loaded.tokenizer
    ids = [tokenizer.eos_token_id, *tokenizer.encode(prompt)]
    new: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = loaded.model(torch.tensor([ids + new]))[0, -1, : tokenizer.vocab_size]
            new.append(int(logits.argmax()))
            if new[-1] == tokenizer.eos_token_id:
                break
    return tokenizer.decode(new)


def test_greedy_is_the_argmax_continuation(loaded: LoadedCheckpoint) -> None:
    got = generate_text(loaded, "abc", max_new_tokens=8, temperature=0.0)
    assert got == greedy_reference(loaded, "abc", 8)
    assert not loaded.model.training  # sampling leaves the model's mode as it was


def test_same_seed_same_text(loaded: LoadedCheckpoint) -> None:
    def sample(seed: int) -> str:
        return generate_text(loaded, "x", max_new_tokens=6, temperature=1.5, seed=seed)

    first = sample(3)
    assert sample(3) == first
    assert sample(4) != first


def test_never_samples_an_id_the_tokenizer_cannot_decode(loaded: LoadedCheckpoint) -> None:
    # Logits of 0 for every byte id, random ones for the 126 padding ids: unrestricted, greedy
    # would pick a padding id (which the byte tokenizer cannot decode) at every step.
    model = copy.deepcopy(loaded.model)
    with torch.no_grad():
        model.lm_head.weight[: ByteTokenizer.VOCAB_SIZE] = 0.0
    padded = LoadedCheckpoint(model, loaded.tokenizer, loaded.config)
    assert generate_text(padded, "", max_new_tokens=3, temperature=0.0) == "\x00" * 3
    assert isinstance(generate_text(padded, "", max_new_tokens=3, temperature=1.0), str)


# -- exporting ------------------------------------------------------------------------------


def test_export_refuses_to_overwrite(run: Run, tmp_path: Path) -> None:
    out = export_checkpoint_to_hf(run.save / "step2", tmp_path / "hf")
    assert {p.name for p in out.iterdir()} == {"model.safetensors", "config.json"}
    weights = (out / "model.safetensors").read_bytes()
    with pytest.raises(FileExistsError, match="overwrite"):
        export_checkpoint_to_hf(run.save / "step1", tmp_path / "hf")
    assert (out / "model.safetensors").read_bytes() == weights
    export_checkpoint_to_hf(run.save / "step1", tmp_path / "hf", overwrite=True)
    assert (out / "model.safetensors").read_bytes() != weights


# -- the command line -----------------------------------------------------------------------


@pytest.mark.parametrize("command", [["generate"], ["export-hf"]])
def test_cli_missing_checkpoint_is_an_error_line(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [*command, str(tmp_path / "no-such-run")]
    if command == ["export-hf"]:
        args.append(str(tmp_path / "hf"))
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: ") and "no-such-run" in captured.err
    assert not (tmp_path / "hf").exists()


def test_cli_export_refusing_to_overwrite_is_an_error_line(
    run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert main(["export-hf", str(run.save), str(tmp_path / "hf")]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    assert (tmp_path / "hf" / "config.json").read_text() == "{}"


def test_cli_greedy_generate_prints_prompt_and_continuation(
    run: Run, loaded: LoadedCheckpoint, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["generate", str(run.save), "--prompt", "ab", "--max-new-tokens", "6"]
    assert main([*args, "--temperature", "0"]) == 0
    assert capsys.readouterr().out == "ab" + greedy_reference(loaded, "ab", 6) + "\n"


def test_cli_generate_without_the_cache_prints_the_same_text(
    run: Run, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["generate", str(run.save), "--prompt", "ab", "--max-new-tokens", "12", "--seed", "3"]
    assert main(args) == 0
    cached = capsys.readouterr().out
    assert main([*args, "--no-kv-cache"]) == 0
    assert capsys.readouterr().out == cached


def test_cli_generate_help_shows_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for default in ("(default: 200)", "(default: 0.8)", "(default: 40)", "default: cache on"):
        assert default in text


@pytest.mark.slow
def test_cli_generate_split_without_a_launcher_says_how_and_that_command_samples_alike(
    run: Run, capsys: pytest.CaptureFixture[str]
) -> None:
    """The error names the command that starts the ranks; run as written, it loads the
    one-process checkpoint into a model split over 2 ranks (DCP reshards it) and samples the
    text one process samples; rank 0 prints it, once."""
    args = ["--prompt", "ab", "--max-new-tokens", "12", "--seed", "3", "--num-samples", "2"]
    assert main(["generate", str(run.save), *args]) == 0
    alone = capsys.readouterr().out
    assert main(["generate", str(run.save), "--tp", "2", *args]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: tp: splits the model over 2 ranks: start them with ")
    command = shlex.split(error.split("start them with ", 1)[1])
    assert command[:3] == ["olmolike", "generate", "--nproc-per-node=2"]
    olmolike = str(Path(sys.executable).with_name("olmolike"))
    split = subprocess.run(
        [olmolike, *command[1:]], capture_output=True, text=True, timeout=patient(180)
    )
    assert split.returncode == 0, split.stderr
    assert split.stdout == alone
