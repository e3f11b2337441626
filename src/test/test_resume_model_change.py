"""Resuming under a model config that changes what the saved weights compute is refused.

Another ``n_heads`` keeps every tensor's shape: the checkpoint would load and train on, its
weights read as other heads. The refusal names each field (checkpoint -> this run), the
overrides that resume, and the overrides that start a new run from those weights on purpose:
both are run here as the message writes them.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest

from olmolike.cli import main
from olmolike.data import prepare_data
from olmolike.data.numpy_data_loader import NumpyDataLoaderConfig
from olmolike.data.numpy_dataset import NumpyDatasetConfig
from olmolike.experiment import ExperimentConfig
from olmolike.nn import TransformerConfig
from olmolike.nn.transformer_config import computation_changes
from olmolike.optim import AdamWConfig
from olmolike.train import Duration, TrainerConfig
from olmolike.train.callbacks import CheckpointerCallback
from olmolike.train.train_module import TransformerTrainModuleConfig
from olmolike.train.weights import check_allowed_changes

SEQ = 16


@pytest.fixture
def trained(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """An experiment file and its run, trained 2 steps (checkpoint step2)."""
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # the command installs its own
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(60)))
    data = prepare_data([text], tmp_path / "data")
    config = ExperimentConfig(
        run_name="heads",
        model=TransformerConfig(
            vocab_size=data.vocab_size, d_model=16, n_layers=1, n_heads=2, max_sequence_length=SEQ
        ),
        dataset=NumpyDatasetConfig(paths=data.paths("train"), sequence_length=SEQ),
        data_loader=NumpyDataLoaderConfig(global_batch_size=2 * SEQ, seed=0),
        train_module=TransformerTrainModuleConfig(
            rank_microbatch_size=2 * SEQ, optim=AdamWConfig(lr=1e-3)
        ),
        trainer=TrainerConfig(
            save_folder=str(tmp_path / "run"),
            max_duration=Duration.steps(2),
            callbacks={"checkpointer": CheckpointerCallback(save_interval=2)},
        ),
    )
    path = tmp_path / "experiment.yaml"
    path.write_text(config.to_yaml())
    assert main(["train", str(path)]) == 0
    return path, tmp_path / "run"


def _refusal(capsys: pytest.CaptureFixture[str]) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, lines
    return lines[0]


def test_another_n_heads_is_refused_and_both_suggested_ways_run(
    trained: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config, run = trained
    more = "--trainer.max_duration.value=4"
    assert main(["train", str(config), "--model.n_heads=4", more]) == 2
    message = _refusal(capsys)
    assert "model.n_heads: 2 -> 4" in message and "same shapes" in message
    assert not (run / "step4").exists()
    # The way back, as written: the checkpoint's settings resume it.
    restore = re.search(r"build the model as the checkpoint was: (.*?)\. To start", message)
    assert restore is not None and restore[1] == "--model.n_heads=2"
    assert main(["train", str(config), "--model.n_heads=4", *shlex.split(restore[1]), more]) == 0
    assert (run / "step4").is_dir()
    # The way forward on purpose, as written, in a new save folder: it starts from step 0
    # with those weights.
    start = re.search(r"(--train_module\.init_weights=\S+ --train_module\.\S+)$", message)
    assert start is not None
    # init_weights alone refuses the difference too, naming the same allowance.
    alone = [start[1].split()[0], f"--trainer.save_folder={tmp_path / 'alone'}"]
    assert main(["train", str(config), "--model.n_heads=4", *alone]) == 2
    assert start[1].split()[1] in _refusal(capsys)
    new = tmp_path / "new"
    args = [*shlex.split(start[1]), f"--trainer.save_folder={new}"]
    assert main(["train", str(config), "--model.n_heads=4", *args]) == 0
    assert (new / "step2").is_dir()
    assert "under other model settings, as allowed" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("--model.rope_theta=10000", "model.rope_theta: 500000.0 -> 10000.0"),
        ("--model.qk_norm=true", "model.qk_norm"),  # new tensors: the shape line names it
        ("--model.block_type=reordered_norm", "model.block_type: 'default' -> 'reordered_norm'"),
        ("--model.norm_eps=1e-5", "model.norm_eps: 1e-06 -> 1e-05"),
    ],
)
def test_fields_that_change_the_computation_are_refused(
    trained: tuple[Path, Path], capsys: pytest.CaptureFixture[str], override: str, named: str
) -> None:
    config, _ = trained
    assert main(["train", str(config), override, "--trainer.max_duration.value=3"]) == 2
    assert named in _refusal(capsys)


def test_fields_that_leave_the_computation_alone_resume(trained: tuple[Path, Path]) -> None:
    config, run = trained
    same = ["--model.n_kv_heads=2", "--model.init_std=0.01", "--model.max_sequence_length=32"]
    assert main(["train", str(config), *same, "--trainer.max_duration.value=3"]) == 0
    assert (run / "step3").is_dir()


def test_a_derived_size_counts_only_when_it_changes() -> None:
    base = TransformerConfig(vocab_size=64, d_model=64, n_layers=1, n_heads=4)
    same = TransformerConfig(
        vocab_size=64, d_model=64, n_layers=1, n_heads=4, n_kv_heads=4,
        mlp_hidden_size=base.hidden_size, max_sequence_length=64, init_std=0.1,
    )  # fmt: skip
    assert computation_changes(base, same) == {}
    gqa = TransformerConfig(vocab_size=64, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2)
    assert computation_changes(base, gqa) == {"n_kv_heads": (None, 2)}


def test_another_d_model_names_the_field_first_in_a_short_line(
    trained: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    config, _ = trained
    assert main(["train", str(config), "--model.d_model=32", "--trainer.max_duration.value=3"]) == 2
    message = _refusal(capsys)
    assert message.index("model.d_model: 16 -> 32") < message.index("saved,")
    assert "and " in message and len(message) < 600, message


def test_a_mixture_of_experts_counts_its_routing_not_its_loss_weights() -> None:
    from olmolike.nn.moe import ExpertCompute, MoEConfig

    def moe(**kwargs: object) -> TransformerConfig:
        return TransformerConfig(
            vocab_size=64,
            d_model=64,
            n_layers=2,
            n_heads=4,
            moe=MoEConfig(**kwargs),  # type: ignore[arg-type]
        )

    base = moe(num_experts=4, top_k=2)
    # The losses' weights and how the matmuls run change training only; an unset width or
    # layer list written out is the same model.
    same = moe(
        num_experts=4, top_k=2, load_balancing_loss_coefficient=0.0,
        router_z_loss_coefficient=0.1, expert_compute=ExpertCompute.loop,
        hidden_size=base.hidden_size, layers=[0, 1],
    )  # fmt: skip
    assert computation_changes(base, same) == {}
    assert computation_changes(base, moe(num_experts=4, top_k=1)) == {"moe.top_k": (2, 1)}
    assert computation_changes(base, moe(num_experts=4, top_k=2, layers=[1])) == {
        "moe.layers": (None, [1])
    }
    dense = TransformerConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4)
    assert set(computation_changes(base, dense)) == {"moe"}
    check_allowed_changes(["moe.top_k", "n_heads"])
