"""Resuming with a model of another structure names the config fields that differ.

Another ``d_model`` changes tensor shapes; another ``n_layers`` changes which tensors exist.
Both used to differ in their messages: the second gave only DCP's "Missing key ...".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from testutils import SEQ_LEN, VOCAB

from olmolike.data import TokenTensorDataLoader
from olmolike.exceptions import CheckpointError
from olmolike.testing import TinyCausalLM, random_token_instances
from olmolike.train import BasicTrainModule, Duration, TrainerConfig
from olmolike.train.callbacks import ConfigSaverCallback


def trainer(save: Path, n_layers: int, **config: Any) -> Any:
    torch.manual_seed(0)
    model = TinyCausalLM(
        vocab_size=VOCAB, d_model=32, n_layers=n_layers, n_heads=2, max_seq_len=SEQ_LEN
    )
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = TokenTensorDataLoader(
        random_token_instances(32, SEQ_LEN, VOCAB, seed=1), global_batch_size=8 * SEQ_LEN
    )
    experiment = {"model": {"d_model": 32, "n_layers": n_layers}, "run_name": f"l{n_layers}"}
    callbacks = {"config_saver": ConfigSaverCallback(config=experiment)}
    config = TrainerConfig(save_folder=str(save), callbacks=callbacks, **config)
    return config.build(BasicTrainModule(model, optim, rank_microbatch_size=8 * SEQ_LEN), loader)


@pytest.mark.parametrize(
    ("saved", "now", "where"), [(2, 3, "not in the checkpoint"), (3, 2, "not in this model")]
)
def test_another_n_layers_names_the_field_and_the_tensors(
    tmp_path: Path, saved: int, now: int, where: str
) -> None:
    trainer(tmp_path / "a", saved, max_duration=Duration.steps(1)).fit()
    with pytest.raises(CheckpointError) as error:
        trainer(tmp_path / "b", now, load_path=str(tmp_path / "a")).fit()
    message = str(error.value)
    assert "another shape" in message and where in message
    assert "blocks.2." in message
    assert f"model.n_layers: {saved} -> {now}" in message
    assert "Missing key" not in message
