"""Two "nodes" on one machine: ``torchrun --nnodes=2`` twice, two ranks each, c10d rendezvous.

The layout is the one docs/multi-node.md recommends for a model too large for FSDP on one
node: tensor parallelism inside each node, HSDP replicas across the nodes. The test checks
where the mesh puts each dimension (every tensor-parallel group on one node, every replica
group across both), that ``olmolike train`` trains and saves there, and that a second launch
resumes from the checkpoint.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from testutils import launch_two_nodes

from olmolike.data import prepare_data
from olmolike.data.numpy_data_loader import NumpyDataLoaderConfig
from olmolike.data.numpy_dataset import NumpyDatasetConfig
from olmolike.experiment import ExperimentConfig
from olmolike.nn import TransformerConfig
from olmolike.train import Duration, TrainerConfig
from olmolike.train.callbacks import CheckpointerCallback
from olmolike.train.checkpoint import Checkpointer
from olmolike.train.train_module import TransformerTrainModuleConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SEQ = 32

NODE_SCRIPT = """
import os
import sys

import torch.distributed as dist

from olmolike.experiment import load_experiment, train
from olmolike.train import prepare_training_environment, teardown_training_environment

prepare_training_environment()
trainer = train(load_experiment(sys.argv[1], sys.argv[2:]))
mesh = trainer.train_module.layout.mesh
node = int(os.environ["GROUP_RANK"])  # torchrun's node rank
nodes = [None] * dist.get_world_size()
dist.all_gather_object(nodes, node)
for dim in ("tp", "dp_replicate"):
    members = dist.get_process_group_ranks(mesh[dim].get_group())
    # One write per line: the ranks of a node share a pipe, and print() writes the text and
    # its newline apart, so two ranks' lines could interleave.
    sys.stdout.write(f"RANK {dist.get_rank()} {dim} nodes {sorted(nodes[r] for r in members)}\\n")
    sys.stdout.flush()
sys.stdout.write(f"NODE DONE step={trainer.global_step}\\n")
sys.stdout.flush()
teardown_training_environment()
"""


def _experiment(tmp_path: Path) -> Path:
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"line {i}: the quick brown fox jumps over {i}\n" for i in range(400)))
    prepare_data([text], tmp_path / "tokens")
    config = ExperimentConfig(
        run_name="two-nodes",
        model=TransformerConfig(
            vocab_size=272, d_model=32, n_layers=2, n_heads=4, max_sequence_length=SEQ
        ),
        dataset=NumpyDatasetConfig(paths=[str(tmp_path / "tokens")], sequence_length=SEQ),
        data_loader=NumpyDataLoaderConfig(global_batch_size=4 * SEQ, seed=0),
        train_module=TransformerTrainModuleConfig(rank_microbatch_size=2 * SEQ),
        trainer=TrainerConfig(
            save_folder=str(tmp_path / "run"),
            max_duration=Duration.steps(2),
            callbacks={"checkpointer": CheckpointerCallback(save_interval=2)},
        ),
    )
    path = tmp_path / "experiment.yaml"
    path.write_text(config.to_yaml())
    return path


def _launch(script: Path, experiment: Path, overrides: list[str], work: Path) -> list[str]:
    """Both nodes' output; each node is one ``torchrun`` with two ranks, launcher and ranks
    forked from the preloaded server (the test is about the layout and the resume, not how an
    interpreter starts)."""
    return launch_two_nodes(
        lambda node: [
            str(script), str(experiment), *overrides, f"--trainer.work_dir={work / f'node{node}'}"
        ],
        nproc_per_node=2,
        env={"OLMOLIKE_SHARED_FILESYSTEM": "1"},
        preloaded=True,
    )  # fmt: skip


def test_tensor_parallel_within_nodes_and_hsdp_across_them(tmp_path: Path) -> None:
    script = tmp_path / "node.py"
    script.write_text(textwrap.dedent(NODE_SCRIPT))
    experiment = _experiment(tmp_path)
    layout = ["--train_module.tp_config.degree=2", "--train_module.dp_config.name=hsdp"]
    lines = "".join(_launch(script, experiment, layout, tmp_path)).splitlines()
    placement = sorted(line for line in lines if line.startswith("RANK "))
    assert placement == sorted(
        [f"RANK {r} tp nodes {[r // 2] * 2}" for r in range(4)]
        + [f"RANK {r} dp_replicate nodes [0, 1]" for r in range(4)]
    ), "\n".join(lines[-60:])
    assert sum("NODE DONE step=2" in line for line in lines) == 4
    assert [step for step, _ in Checkpointer.find_checkpoints(str(tmp_path / "run"))] == [0, 2]

    longer = [*layout, "--trainer.max_duration.value=3"]
    lines = "".join(_launch(script, experiment, longer, tmp_path)).splitlines()
    assert sum("NODE DONE step=3" in line for line in lines) == 4, "\n".join(lines[-60:])
    assert [step for step, _ in Checkpointer.find_checkpoints(str(tmp_path / "run"))] == [0, 2, 3]
