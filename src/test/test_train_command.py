"""``olmolike train CONFIG.yaml [--overrides]``: a run from a file, in one process or torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import preloaded_python
import pytest
from testutils import free_port, patient

from olmolike.cli import main
from olmolike.data import prepare_data
from olmolike.data.numpy_data_loader import NumpyDataLoaderConfig
from olmolike.data.numpy_dataset import NumpyDatasetConfig
from olmolike.experiment import ExperimentConfig, load_experiment
from olmolike.inference import load_checkpoint_model
from olmolike.nn import TransformerConfig
from olmolike.optim import AdamWConfig
from olmolike.train import Duration, TrainerConfig
from olmolike.train.callbacks import CheckpointerCallback, LMEvaluatorCallbackConfig
from olmolike.train.train_module import TransformerTrainModuleConfig

SEQ = 32


@pytest.fixture
def config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A tiny experiment over prepared text, saved as YAML with the file's own class name."""
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # the command installs its own
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(300)))
    data = prepare_data([text], tmp_path / "data")
    dataset = NumpyDatasetConfig(paths=data.paths("train"), sequence_length=SEQ)
    config = ExperimentConfig(
        run_name="from-file",
        model=TransformerConfig(
            vocab_size=data.vocab_size, d_model=16, n_layers=1, n_heads=2, max_sequence_length=SEQ
        ),
        dataset=dataset,
        data_loader=NumpyDataLoaderConfig(global_batch_size=4 * SEQ, seed=0),
        train_module=TransformerTrainModuleConfig(
            rank_microbatch_size=2 * SEQ, optim=AdamWConfig(lr=1e-3)
        ),
        trainer=TrainerConfig(
            save_folder=str(tmp_path / "run"),
            max_duration=Duration.steps(100),
            callbacks={
                "checkpointer": CheckpointerCallback(save_interval=2),
                "lm_evaluator": LMEvaluatorCallbackConfig(
                    eval_dataset=dataset, eval_interval=2, max_batches=1
                ),
            },
        ),
    )
    path = tmp_path / "experiment.yaml"
    path.write_text(config.to_yaml().replace("olmolike.experiment.", "__main__."))
    return path


def test_a_run_from_a_file_with_overrides(config_file: Path, tmp_path: Path) -> None:
    assert main(["train", str(config_file), "--trainer.max_duration.value=4"]) == 0
    assert sorted(p.name for p in (tmp_path / "run").glob("step*")) == ["step0", "step2", "step4"]
    loaded = load_checkpoint_model(tmp_path / "run")  # the run saved its config.json
    assert loaded.config["run_name"] == "from-file" and loaded.model.config.d_model == 16


def test_dry_run_prints_the_config_with_the_overrides(
    config_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", str(config_file), "--dry-run", "--model.n_layers=3"]) == 0
    printed = capsys.readouterr().out
    assert "n_layers: 3" in printed and "run_name: from-file" in printed


def test_a_mistake_in_the_overrides_is_one_line(
    config_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", str(config_file), "--model.n_layers", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err == "error: model.n_layers: got '--model.n_layers' then '4'; overrides take '=': "
        "write --model.n_layers=4"
    )
    with pytest.raises(Exception, match="no config file"):
        load_experiment(str(config_file) + ".missing", [])


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "layout",
    [
        ["--train_module.dp_config.name=fsdp"],
        # Two pipeline stages: the loader and trainer must use the data-parallel group.
        ["--train_module.pp_config.degree=2", "--model.n_layers=2"],
        # Expert parallelism, turned on from the command line for a model made MoE there.
        [
            "--train_module.dp_config.name=fsdp",
            "--train_module.ep_config.degree=2",
            "--model.moe.num_experts=4",
            "--model.moe.top_k=2",
            "--model.moe.hidden_size=16",
        ],
    ],
    ids=["fsdp", "pp", "ep"],
)
def test_under_torchrun(config_file: Path, tmp_path: Path, layout: list[str]) -> None:
    torchrun = preloaded_python.torchrun("--nproc-per-node=2", f"--master-port={free_port()}")
    command = ["-m", "olmolike", "train", str(config_file), "--trainer.max_duration.value=2"]
    result = subprocess.run(
        [*torchrun, *command, *layout],
        capture_output=True,
        text=True,
        timeout=patient(200),
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rank 0 of 2" in result.stderr
    assert (tmp_path / "run" / "step2").is_dir()
    if any("ep_config" in arg for arg in layout):  # the EP checkpoint loads in one process
        loaded = load_checkpoint_model(tmp_path / "run")
        assert loaded.config["train_module"]["ep_config"]["degree"] == 2
        assert loaded.model.config.moe is not None and loaded.model.config.moe.num_experts == 4


def test_a_run_refused_when_it_is_built_leaves_no_empty_folder(
    config_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A micro-batch that does not divide the rank's batch is refused before anything is
    written: the run's folder (and its parent, both made for it) is gone again; a folder that
    existed before stays."""
    run = tmp_path / "new" / "run"
    refused = ["--train_module.rank_microbatch_size=96", f"--trainer.save_folder={run}"]
    assert main(["train", str(config_file), *refused]) == 2
    assert "rank_microbatch_size" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    run.mkdir(parents=True)
    assert main(["train", str(config_file), *refused]) == 2
    assert run.is_dir()
