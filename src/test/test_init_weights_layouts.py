"""Pretrained weights (``init_weights``) under tensor and pipeline parallelism.

A tiny random Hugging Face OLMo-2 model is loaded into runs on 4 gloo ranks laid out as
TP=2 x FSDP=2, PP=2 x FSDP=2 and TP=2 x PP=2: every rank must hold exactly its part of the imported
weights (under PP only its stage's tensors, and together every tensor), and the run's losses
must equal those of one process that loaded the same folder. Under PP an olmolike checkpoint
as ``init_weights`` is checked the same way. One spawned group runs every layout.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from hf_models import save_hf_model
from testutils import run_distributed_test
from torch.distributed.tensor import DTensor

from olmolike.data import TokenTensorDataLoader
from olmolike.distributed.parallel import DataParallelConfig
from olmolike.distributed.pipeline import PipelineParallelConfig
from olmolike.distributed.tensor_parallel import TensorParallelConfig
from olmolike.distributed.utils import broadcast_object, get_rank
from olmolike.nn import TransformerConfig, load_hf_model
from olmolike.nn.hf_import import read_hf_config, transformer_config_from_hf
from olmolike.optim import AdamWConfig
from olmolike.testing import random_token_instances
from olmolike.train import Callback, Duration, TrainerConfig
from olmolike.train.callbacks import CheckpointerCallback
from olmolike.train.train_module import TransformerTrainModuleConfig

pytest.importorskip("transformers")

SEQ_LEN = 16
VOCAB = 64  # divides over 2 tensor-parallel ranks
STEPS = 2
LAYOUTS: dict[str, dict[str, Any]] = {
    "tp2 x fsdp2": {"tp_config": TensorParallelConfig(degree=2)},
    "pp2 x fsdp2": {"pp_config": PipelineParallelConfig(degree=2)},
    "tp2 x pp2": {
        "tp_config": TensorParallelConfig(degree=2),
        "pp_config": PipelineParallelConfig(degree=2),
    },
}


@dataclass
class Probe(Callback):
    """The tensors this rank holds when the first step starts (full where sharded), and the
    losses."""

    held: dict[str, torch.Tensor] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)
    priority: ClassVar[int] = -10  # after InitWeightsCallback's pre_train

    def pre_train(self) -> None:
        model = self.trainer.train_module.model  # type: ignore[attr-defined]
        for name, tensor in model.state_dict().items():
            whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            self.held[name] = whole.detach().clone()

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.losses.append(metrics["train/CE loss"])


def model_config(hf_dir: str) -> TransformerConfig:
    return transformer_config_from_hf(read_hf_config(hf_dir))


def run(
    hf_dir: str,
    init_weights: str,
    save_folder: str,
    layout: dict[str, Any] | None = None,
    save: bool = False,
) -> Probe:
    """``save``: a checkpoint at the last step (the one other runs load), else none."""
    module = TransformerTrainModuleConfig(
        rank_microbatch_size=2 * SEQ_LEN,
        optim=AdamWConfig(lr=1e-2),
        init_weights=init_weights,
        dp_config=DataParallelConfig(name="fsdp") if layout else None,
        **(layout or {}),
    ).build(model_config(hf_dir).build(init_device="meta"))
    group = getattr(module, "dp_process_group", None)
    loader = TokenTensorDataLoader(
        random_token_instances(32, SEQ_LEN, VOCAB, seed=1),
        global_batch_size=8 * SEQ_LEN,
        seed=0,
        dp_world_size=module.dp_world_size,
        dp_rank=get_rank(group),
    )
    probe = Probe()
    callbacks: dict[str, Callback] = {"probe": probe}
    if save:
        callbacks["checkpointer"] = CheckpointerCallback(
            save_interval=STEPS, pre_train_checkpoint=False
        )
    TrainerConfig(
        save_folder=save_folder,
        max_duration=Duration.steps(STEPS),
        metrics_collect_interval=1,
        device="cpu",
        callbacks=callbacks,
        no_checkpoints=not save,
    ).build(module, loader, dp_process_group=group).fit()
    return probe


def _layouts(hf_dir: str, checkpoint: str) -> dict[str, tuple[dict, list[float]]]:
    results = {}
    for name, layout in LAYOUTS.items():
        probe = run(hf_dir, hf_dir, broadcast_object(tempfile.mkdtemp()), layout)
        results[name] = (probe.held, probe.losses)
    pp = LAYOUTS["pp2 x fsdp2"]
    probe = run(hf_dir, checkpoint, broadcast_object(tempfile.mkdtemp()), pp)
    results["pp2 x fsdp2 from a checkpoint"] = (probe.held, probe.losses)
    return results


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_hf_weights_load_into_tp_and_pp_layouts_as_into_one_process(tmp_path: Path) -> None:
    hf_dir = str(tmp_path / "hf")
    save_hf_model(tmp_path / "hf", "olmo2", vocab_size=VOCAB, eos_token_id=VOCAB - 1)
    hf_state = load_hf_model(hf_dir).state_dict()
    one = run(hf_dir, hf_dir, str(tmp_path / "one"), save=True)
    checkpoint = str(tmp_path / "one" / f"step{STEPS}")
    trained = run(hf_dir, checkpoint, str(tmp_path / "again")).held
    per_rank = run_distributed_test(_layouts, 4, args=(hf_dir, checkpoint), timeout=540)
    for layout in [*LAYOUTS, "pp2 x fsdp2 from a checkpoint"]:
        want = trained if "checkpoint" in layout else hf_state
        held_somewhere: set[str] = set()
        for rank, results in enumerate(per_rank):
            held, losses = results[layout]
            held_somewhere |= held.keys()
            for name, tensor in held.items():
                torch.testing.assert_close(tensor, want[name], rtol=0, atol=0, msg=(layout, name))
            if "checkpoint" not in layout:
                assert losses == pytest.approx(one.losses, rel=1e-5), (layout, rank)
        assert held_somewhere == set(want), layout
        if "pp" in layout:  # each rank holds only its own stage
            assert all(results[layout][0].keys() != want.keys() for results in per_rank)
