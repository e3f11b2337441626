"""``olmolike train CONFIG.yaml`` for every kind of run: SFT, DPO and GRPO (pretraining is in
test_train_command), with GRPO's reward functions from installed packages' entry points."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import preloaded_python
import pytest
from testutils import free_port, patient

import olmolike
from olmolike.cli import main
from olmolike.config import registered_name
from olmolike.data import prepare_sft_data
from olmolike.data.numpy_data_loader import NumpyDataLoaderConfig
from olmolike.data.numpy_dataset import NumpyDatasetConfig
from olmolike.data.post_training_data import PreferenceDatasetConfig
from olmolike.data.preference_prepare import prepare_preference_data
from olmolike.data.sft_dataset import SFTDatasetConfig
from olmolike.data.tokenizer import ByteTokenizer
from olmolike.exceptions import ConfigurationError
from olmolike.experiment import ExperimentConfig, load_experiment
from olmolike.experiment_kinds import kind_of
from olmolike.nn import TransformerConfig
from olmolike.train import Duration, TrainerConfig
from olmolike.train.callbacks import MetricSaverCallback
from olmolike.train.train_module import TransformerTrainModuleConfig
from olmolike.train.train_module.dpo import DPOTrainModuleConfig
from olmolike.train.train_module.grpo import GRPOTrainModuleConfig

SEQ = 64
VOCAB = ByteTokenizer().vocab_size

GRPO_YAML = """\
run_name: grpo
model: {{vocab_size: {vocab}, d_model: 16, n_layers: 1, n_heads: 2, max_sequence_length: 32}}
dataset:
  _CLASS_: prompts
  path: {folder}/prompts.jsonl
data_loader: {{global_batch_size: 4}}
train_module:
  _CLASS_: grpo
  rank_microbatch_size: 256
  optim: {{_CLASS_: AdamWConfig, lr: 1.0e-3}}
  loss: {{group_size: 2}}
  sampling: {{max_new_tokens: 4}}
  rewards: [{{name: exact_answer}}]
trainer:
  save_folder: {folder}/run
  max_duration: {{value: 2, unit: steps}}
  no_checkpoints: true
  metrics_collect_interval: 1
  callbacks: {{metric_saver: {{_CLASS_: metric_saver}}}}
"""
"""Written by hand, with the short class names, as the docs show it."""


@pytest.fixture(autouse=True)
def _keep_excepthook(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # the command installs its own


def experiment(tmp_path: Path, dataset: object, train_module: object, batch: int) -> Path:
    """A 2-step run of a tiny model, saved as YAML; its metrics go to run/metrics.jsonl."""
    config = ExperimentConfig(
        run_name="kind",
        model=TransformerConfig(
            vocab_size=VOCAB, d_model=16, n_layers=1, n_heads=2, max_sequence_length=SEQ
        ),
        dataset=dataset,  # type: ignore[arg-type]
        data_loader=NumpyDataLoaderConfig(global_batch_size=batch, seed=0),
        train_module=train_module,  # type: ignore[arg-type]
        trainer=TrainerConfig(
            save_folder=str(tmp_path / "run"),
            max_duration=Duration.steps(2),
            no_checkpoints=True,
            metrics_collect_interval=1,
            callbacks={"metric_saver": MetricSaverCallback()},
        ),
    )
    path = tmp_path / "experiment.yaml"
    path.write_text(config.to_yaml())
    return path


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_sft_from_a_file(tmp_path: Path) -> None:
    source = tmp_path / "sft.jsonl"
    lines = (json.dumps({"prompt": f"add {i}", "completion": f"x+{i}"}) for i in range(40))
    source.write_text("\n".join(lines) + "\n")
    prepare_sft_data([source], tmp_path / "sft", sequence_length=SEQ)
    module = TransformerTrainModuleConfig(rank_microbatch_size=2 * SEQ)
    path = experiment(tmp_path, SFTDatasetConfig(str(tmp_path / "sft")), module, 4 * SEQ)
    assert main(["train", str(path)]) == 0
    assert [m["step"] for m in metrics(tmp_path / "run")] == [1, 2]


def preference_pairs(tmp_path: Path) -> Path:
    source = tmp_path / "pairs.jsonl"
    pairs = ({"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": "no"} for i in range(32))
    source.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    prepare_preference_data([source], tmp_path / "pairs", sequence_length=SEQ)
    return tmp_path / "pairs"


def test_dpo_from_a_file_with_overrides(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dataset = PreferenceDatasetConfig(str(preference_pairs(tmp_path)))
    module = DPOTrainModuleConfig(rank_microbatch_size=2 * SEQ, precompute_reference_logps=True)
    path = experiment(tmp_path, dataset, module, 4 * 4 * SEQ)  # 4 pairs
    assert main(["train", str(path), "--dry-run", "--train_module.beta=0.25"]) == 0
    printed = capsys.readouterr().out
    assert "beta: 0.25" in printed and "_CLASS_: olmolike.data.post_training_data." in printed
    assert main(["train", str(path), "--train_module.beta=0.25"]) == 0
    steps = metrics(tmp_path / "run")
    assert [m["step"] for m in steps] == [1, 2]
    assert any("DPO" in key or "preference" in key for key in steps[-1]["metrics"])


def pretraining(tmp_path: Path) -> Path:
    dataset = NumpyDatasetConfig(paths=["tokens"], sequence_length=SEQ)
    module = TransformerTrainModuleConfig(rank_microbatch_size=SEQ)
    return experiment(tmp_path, dataset, module, 4 * SEQ)


def test_a_train_module_with_the_wrong_data_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = pretraining(tmp_path)
    text = path.read_text().replace(
        f"_CLASS_: {registered_name(TransformerTrainModuleConfig)}", "_CLASS_: dpo"
    )
    path.write_text(text)  # a DPO train module over a pretraining data section
    assert main(["train", str(path)]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: dataset: a DPOTrainModuleConfig trains on preference pairs, not on a "
        "NumpyDatasetConfig: set dataset._CLASS_ to preference_pairs (a prepare-data --dpo "
        "folder), or train_module._CLASS_ to transformer"
    )
    # An override that changes a class keeps the fields both classes have.
    grpo = ["--train_module._CLASS_=grpo", "--train_module.rewards=[{name: x}]"]
    with pytest.raises(ConfigurationError, match=r"^dataset: a GRPOTrainModuleConfig trains on "):
        load_experiment(str(path), grpo)
    grpo += ["--dataset={_CLASS_: prompts, path: p.jsonl}", "--data_loader.global_batch_size=4"]
    config = load_experiment(str(path), grpo)
    assert isinstance(config.train_module, GRPOTrainModuleConfig)
    assert config.train_module.rank_microbatch_size == SEQ


def test_the_dataset_section_is_picked_by_its_class_name(tmp_path: Path) -> None:
    path = pretraining(tmp_path)
    text = path.read_text()
    start = text.index("dataset:")
    end = text.index("data_loader:")
    without = text[:start] + "dataset:\n  paths: [tokens]\n  sequence_length: 64\n" + text[end:]
    path.write_text(without)  # no _CLASS_: token data, as files written before post-training
    assert isinstance(load_experiment(str(path), []).dataset, NumpyDatasetConfig)
    sft = ["--dataset={_CLASS_: sft, path: data, splitt: val}"]
    with pytest.raises(ConfigurationError, match=r"^dataset.splitt: unknown key 'splitt'; valid"):
        load_experiment(str(path), sft)
    with pytest.raises(
        ConfigurationError,
        match=r"^dataset: _CLASS_ 'sfft' is none of: numpy, sft, preference_pairs, prompts$",
    ):
        load_experiment(str(path), ["--dataset={_CLASS_: sfft, path: data}"])
    loaded = load_experiment(str(path), ["--dataset={_CLASS_: sft, path: data}"])
    assert loaded.dataset == SFTDatasetConfig("data")


# -- GRPO, its rewards from entry points (in subprocesses, so this process's sys.path and
# -- importlib.metadata caches never see the test package) ------------------------------


@pytest.fixture
def grpo_run(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A GRPO experiment file, and an environment whose sys.path holds a package that offers
    ``exact_answer`` (and a ``broken`` reward that cannot be imported) as entry points."""
    site = tmp_path / "site"
    (site / "my_rewards-1.0.dist-info").mkdir(parents=True)
    (site / "my_rewards.py").write_text(
        "def exact(completions, answer, **_):\n"
        "    return [float(c == a) for c, a in zip(completions, answer)]\n"
    )
    info = site / "my_rewards-1.0.dist-info"
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-rewards\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[olmolike.rewards]\nexact_answer = my_rewards:exact\nbroken = not_installed:reward\n"
    )
    prompts = (json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) for i in range(16))
    (tmp_path / "prompts.jsonl").write_text("\n".join(prompts) + "\n")
    path = tmp_path / "grpo.yaml"
    path.write_text(GRPO_YAML.format(vocab=VOCAB, folder=tmp_path))
    src = str(Path(olmolike.__file__).parents[1])
    paths = [str(site), src, os.environ.get("PYTHONPATH", "")]
    preloaded_python.command()  # its server started: the environment below names it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "OMP_NUM_THREADS": "1"}
    return path, env


def run(command: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=patient(timeout)
    )


@pytest.mark.timeout(300)
def test_grpo_from_a_file_with_rewards_from_entry_points(
    grpo_run: tuple[Path, dict[str, str]],
) -> None:
    path, env = grpo_run
    train = [*preloaded_python.command(), "-m", "olmolike", "train", str(path)]
    result = run(train, env, 200)
    # `broken` is never imported: only the rewards a run names are loaded.
    assert result.returncode == 0, result.stderr[-3000:]
    steps = metrics(path.parent / "run")
    assert [m["step"] for m in steps] == [1, 2]
    assert any("exact_answer" in key for key in steps[-1]["metrics"])

    result = run([*train, "--train_module.rewards=[{name: exact_answr}]"], env, 100)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: train_module.rewards[0].name: unknown reward function 'exact_answr'; "
        "registered: broken, exact_answer. Register it under "
        '[project.entry-points."olmolike.rewards"] in your package\'s pyproject.toml '
        '(exact_answr = "your_package.module:function") and reinstall the package, or call '
        "RewardRegistry.register in a training script"
    )
    result = run([*train, "--train_module.rewards=[{name: broken}]"], env, 100)
    assert result.returncode == 2
    assert result.stderr.strip().startswith(
        "error: train_module.rewards[0].name: the reward function 'broken' (not_installed:reward "
        "from my-rewards) "
        "failed to load: ModuleNotFoundError"
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_grpo_under_torchrun(grpo_run: tuple[Path, dict[str, str]]) -> None:
    path, env = grpo_run
    torchrun = preloaded_python.torchrun("--nproc-per-node=2", f"--master-port={free_port()}")
    command = [*torchrun, "-m", "olmolike", "train", str(path)]
    result = run(command, env, 250)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rank 0 of 2" in result.stderr
    assert [m["step"] for m in metrics(path.parent / "run")] == [1, 2]


def test_the_docs_example_configs_load(tmp_path: Path) -> None:
    docs = Path(__file__).parents[2] / "docs" / "post-training.md"
    section = docs.read_text().split("## Any kind of run from a config file")[1]
    blocks = re.findall(r"```yaml\n(.*?)```", section, flags=re.S)
    kinds = []
    for i, block in enumerate(blocks):
        path = tmp_path / f"{i}.yaml"
        path.write_text(block)
        config = load_experiment(str(path), [])
        kinds.append(kind_of(config.train_module, config.dataset))
    assert kinds == ["SFT", "DPO", "GRPO"]
