"""Tensor parallelism on gloo ranks equals one process: losses, gradients, clipping, resume.

Each distributed test spawns one group and runs several cases in it (spawning gloo groups is
the slow part). The model is OLMo-2 shaped (QK-norm, reordered norms, grouped-query
attention) so every piece of the tensor-parallel plan is exercised; the loss has z-loss and
label smoothing, which the vocabulary-parallel cross-entropy computes from sharded logits.
"""

from __future__ import annotations

import datetime
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from testutils import assert_within_adam_reach, run_distributed_test, whole_tensors

from olmolike.data import TokenTensorDataLoader
from olmolike.distributed.parallel import DataParallelConfig, DataParallelType
from olmolike.distributed.tensor_parallel import TensorParallelConfig
from olmolike.distributed.utils import broadcast_object, get_rank, group_timeout
from olmolike.exceptions import ConfigurationError
from olmolike.nn import TransformerConfig
from olmolike.optim import AdamWConfig
from olmolike.testing import random_token_instances
from olmolike.train import Callback, Duration, TrainerConfig
from olmolike.train.train_module import TransformerTrainModuleConfig

SEQ, VOCAB, ROWS, STEPS, LR = 16, 64, 8, 3, 1e-3
TOLERANCE = dict(rtol=0, atol=1e-5)


def model_config(**overrides: Any) -> TransformerConfig:
    shape = dict(
        vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, qk_norm=True,
        block_type="reordered_norm", max_sequence_length=SEQ,
    )  # fmt: skip
    return TransformerConfig(**{**shape, **overrides})  # type: ignore[arg-type]


@dataclass
class Recorder(Callback):
    losses: dict[int, float] = field(default_factory=dict)
    grad_norms: dict[int, float] = field(default_factory=dict)
    z_losses: dict[int, float] = field(default_factory=dict)
    first_grads: dict[str, torch.Tensor] = field(default_factory=dict)
    """Every gradient of step 1, whole (before clipping): taken from the same weights on the
    same data, they agree across layouts up to summation order, unlike weights after Adam."""

    def pre_optim_step(self) -> None:
        if self.step == 1:
            model = self.trainer.train_module.model  # type: ignore[attr-defined]
            self.first_grads = whole_tensors(model, grads=True)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.losses[step] = metrics["train/CE loss"]
        self.z_losses[step] = metrics["train/Z loss"]
        self.grad_norms[step] = metrics["optim/total grad norm"]


def train(
    save: str | Path,
    *,
    tp: int = 1,
    dp: str | DataParallelConfig | None = None,
    steps: int = STEPS,
    model: TransformerConfig | None = None,
    **trainer_kwargs: Any,
) -> dict[str, Any]:
    """Train ``steps`` steps of the same run under a layout; returns losses and weights."""
    module = TransformerTrainModuleConfig(
        rank_microbatch_size=2 * SEQ,
        optim=AdamWConfig(lr=LR),
        max_grad_norm=0.5,
        z_loss_multiplier=1e-3,
        label_smoothing=0.1,
        dp_config=DataParallelConfig(name=DataParallelType(dp)) if isinstance(dp, str) else dp,
        tp_config=TensorParallelConfig(degree=tp) if tp > 1 else None,
    ).build((model or model_config()).build(init_device="meta"))
    degrees = module.layout.degrees
    loader = TokenTensorDataLoader(
        random_token_instances(64, SEQ, VOCAB),
        global_batch_size=ROWS * SEQ,
        dp_rank=degrees.dp_rank(get_rank()),
        dp_world_size=degrees.dp,
    )
    recorder = Recorder()
    trainer = TrainerConfig(
        save_folder=str(save),
        max_duration=Duration.steps(steps),
        metrics_collect_interval=1,
        device="cpu",
        callbacks={"recorder": recorder},
        **trainer_kwargs,
    ).build(module, loader)
    trainer.callbacks["checkpointer"].save_interval = 2  # type: ignore[attr-defined]
    trainer.callbacks["checkpointer"].pre_train_checkpoint = False  # type: ignore[attr-defined]
    trainer.fit()
    mesh = module.layout.mesh
    return {
        "tp_group_timeout": None if mesh is None else group_timeout(mesh["tp"].get_group()),
        "losses": recorder.losses,
        "z_losses": recorder.z_losses,
        "grad_norms": recorder.grad_norms,
        "first_grads": recorder.first_grads,
        "params": whole_tensors(module.model),
        "loaded": trainer.checkpoint_loaded,
    }


def assert_same_run(got: dict[str, Any], want: dict[str, Any], exact: bool = False) -> None:
    """The same losses, z-losses and grad norms at every step, and the same gradients at step 1
    (``want``'s, unless it starts later), to 1e-5; the final weights within what the AdamW
    updates can move them apart (:func:`testutils.assert_within_adam_reach`). ``exact``: all
    bit for bit."""
    for key in ("losses", "z_losses", "grad_norms"):
        assert sorted(got[key]) == sorted(want[key])
        for step, value in want[key].items():
            assert got[key][step] == pytest.approx(value, abs=0 if exact else 1e-5), (key, step)
    if want["first_grads"]:
        assert got["first_grads"].keys() == want["first_grads"].keys()
        for name, value in want["first_grads"].items():
            torch.testing.assert_close(got["first_grads"][name], value, **TOLERANCE, msg=name)
    assert got["params"].keys() == want["params"].keys()
    if exact:
        for name, value in want["params"].items():
            assert torch.equal(got["params"][name], value), name
    else:
        assert_within_adam_reach(got["params"], want["params"], lr=LR, updates=STEPS)


PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9]]


def greedy(model: torch.nn.Module) -> list[list[int]]:
    """Greedy tokens with the KV cache (left-padded prompts, then one token per step) and
    without it (the whole context every step)."""
    from olmolike.nn.generation import sample

    return [
        sample(model, PROMPTS, max_new_tokens=6, temperature=0.0, use_cache=cache).completions()
        for cache in (True, False)
    ]


def _tensor_parallel_two_ranks() -> tuple[list[dict[str, Any]], list[list[list[int]]], str]:
    from torch.distributed.device_mesh import init_device_mesh

    from olmolike.nn.parallel_plan import apply_tensor_parallel

    save = broadcast_object(tempfile.mkdtemp())
    runs = [train(Path(save) / "olmo2", tp=2, no_checkpoints=True)]
    llama = model_config(qk_norm=False, block_type="default", tie_weights=True, n_kv_heads=None)
    runs.append(train(Path(save) / "llama", tp=2, model=llama, no_checkpoints=True))
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = model_config().build(init_device="meta")
    apply_tensor_parallel(model, mesh)
    model.materialize("cpu", seed=3)
    # A model split after it was materialised (as a reference model is) keeps its tied
    # embedding tied.
    tied = llama.build(seed=3)
    apply_tensor_parallel(tied, mesh)
    assert tied.lm_head.weight is tied.embeddings.weight
    return runs, greedy(model) + greedy(tied), _loader_of_global_ranks_refused(save)


def _loader_of_global_ranks_refused(save: str) -> str:
    """A loader that splits batches over the global ranks would feed the two halves of one
    tensor-parallel group different data: the trainer refuses it."""
    module = TransformerTrainModuleConfig(
        rank_microbatch_size=SEQ, tp_config=TensorParallelConfig(degree=2)
    ).build(model_config().build(init_device="meta"))
    loader = TokenTensorDataLoader(
        random_token_instances(64, SEQ, VOCAB), global_batch_size=ROWS * SEQ
    )
    try:
        TrainerConfig(save_folder=save, max_duration=Duration.steps(1)).build(module, loader)
    except ConfigurationError as e:
        return str(e)
    return "accepted"


@pytest.mark.slow
def test_tensor_parallel_equals_one_process(tmp_path: Path) -> None:
    """TP=2 alone: OLMo-2 blocks (QK-norm over the full width) and Llama blocks with a tied
    embedding; every step's loss, z-loss and clipped grad norm, the first step's gradients,
    and the final weights (as far as AdamW lets them agree: :func:`assert_same_run`). Greedy
    generation (with and without the KV cache) gives the unsplit model's tokens, and a data
    loader over the global ranks is refused."""
    llama = model_config(qk_norm=False, block_type="default", tie_weights=True, n_kv_heads=None)
    want = [
        train(tmp_path / "olmo2", no_checkpoints=True),
        train(tmp_path / "llama", model=llama, no_checkpoints=True),
    ]
    tokens = greedy(model_config().build(seed=3)) + greedy(llama.build(seed=3))
    outcomes = run_distributed_test(_tensor_parallel_two_ranks, 2, timeout=300)
    for results, generated, refusal in outcomes:
        for got, expected in zip(results, want, strict=True):
            assert_same_run(got, expected)
        assert generated == tokens
        assert "build the loader with dp_" in refusal, refusal


def test_degrees_that_do_not_fit_the_model_are_refused() -> None:
    from olmolike.nn.parallel_plan import check_tensor_parallel_degree

    with pytest.raises(ConfigurationError, match=r"n_kv_heads \(2\)") as kv:
        check_tensor_parallel_degree(model_config(), 4)
    # Each cause names its own fix: padding the vocabulary is the fix of vocab_size alone.
    assert "change model.n_kv_heads to a multiple of 4" in str(kv.value)
    assert "vocab_size" not in str(kv.value)
    odd_vocab = model_config(vocab_size=255, n_kv_heads=None)
    with pytest.raises(ConfigurationError, match=r"vocab_size \(255\)") as vocab:
        check_tensor_parallel_degree(odd_vocab, 2)
    assert "pad model.vocab_size to a multiple of 2 (e.g. 256)" in str(vocab.value)


def test_tensor_parallel_degrees_must_divide_the_world() -> None:
    config = TransformerTrainModuleConfig(
        rank_microbatch_size=SEQ, tp_config=TensorParallelConfig(degree=2)
    )
    with pytest.raises(ConfigurationError, match=r"tp \(2\) = 2 does not divide the world size"):
        config.parallel_degrees(3)
    with pytest.raises(ConfigurationError, match=r"^train_module.tp_config.degree: "):
        config.parallel_degrees(3)  # the field, named in full as other errors name theirs
    degrees = config.parallel_degrees(8)
    assert (degrees.dp_shard, degrees.tp, degrees.dp_replicate) == (1, 2, 4)  # DDP replicates
    fsdp = TransformerTrainModuleConfig(
        rank_microbatch_size=SEQ,
        tp_config=TensorParallelConfig(degree=2),
        dp_config=DataParallelConfig(name=DataParallelType.fsdp),
    )
    assert fsdp.parallel_degrees(8).as_dict() == dict(pp=1, dp_replicate=1, dp_shard=4, cp=1, tp=2)
    assert [fsdp.parallel_degrees(8).dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


def _four_ranks(root: str) -> dict[str, Any]:
    """TP=2 x FSDP=2: the whole run, a run stopped at step 2 and resumed, and the step-2
    checkpoints of other layouts (TPxFSDP -> FSDP alone, one process -> TPxFSDP) resumed."""
    runs = {"full": train(Path(root) / "full", tp=2, dp="fsdp", no_checkpoints=True)}
    hsdp = DataParallelConfig(name=DataParallelType.hsdp, num_replicas=2)
    runs["tp_hsdp"] = train(Path(root) / "hsdp", tp=2, dp=hsdp, no_checkpoints=True)
    train(Path(root) / "tp_fsdp", tp=2, dp="fsdp", hard_stop=Duration.steps(2))
    runs["resumed"] = train(Path(root) / "tp_fsdp", tp=2, dp="fsdp", no_checkpoints=True)
    tp_step2 = str(Path(root) / "tp_fsdp" / "step2")
    # The runs that go on from a checkpoint save none of their own (they need none).
    runs["fsdp_from_tp"] = train(
        Path(root) / "fsdp", dp="fsdp", load_path=tp_step2, no_checkpoints=True
    )
    one_step2 = str(Path(root) / "single" / "step2")
    runs["tp_from_single"] = train(
        Path(root) / "tp_from_single", tp=2, dp="fsdp", load_path=one_step2, no_checkpoints=True
    )
    return runs


@pytest.mark.slow
def test_tensor_parallel_with_fsdp_equals_one_process_and_checkpoints_move(
    tmp_path: Path,
) -> None:
    """TP=2 x FSDP=2 on 4 ranks equals one process, and so does TP=2 x HSDP (2 replicas);
    TP x FSDP stops and resumes exactly; its
    checkpoint (model and optimizer) continues the run under one process and under FSDP
    alone, and one process's checkpoint continues it under TPxFSDP."""
    want = train(tmp_path / "want", no_checkpoints=True)
    train(tmp_path / "single", hard_stop=Duration.steps(2))
    results = run_distributed_test(_four_ranks, 4, args=(str(tmp_path),), timeout=600)
    for runs in results:
        assert_same_run(runs["full"], want)
        # The mesh's groups (here a tensor-parallel pair of 4 ranks, not the default group)
        # had their timeout shortened with the others after step 1.
        assert runs["full"]["tp_group_timeout"] == datetime.timedelta(seconds=300)
        assert_same_run(runs["tp_hsdp"], want)
        assert runs["resumed"]["loaded"] and sorted(runs["resumed"]["losses"]) == [3]
        assert_same_run(runs["resumed"], _from_step(runs["full"], 3), exact=True)
        for name in ("fsdp_from_tp", "tp_from_single"):
            assert runs[name]["loaded"]
            assert_same_run(runs[name], _from_step(want, 3))
    single_from_tp = train(
        tmp_path / "single_from_tp",
        load_path=str(tmp_path / "tp_fsdp" / "step2"),
        no_checkpoints=True,
    )
    assert_same_run(single_from_tp, _from_step(want, 3))


def _from_step(run: dict[str, Any], first: int) -> dict[str, Any]:
    """``run``'s metrics from step ``first`` on (a resumed run logs only those)."""
    metrics = ("losses", "z_losses", "grad_norms")
    kept = {key: {s: v for s, v in run[key].items() if s >= first} for key in metrics}
    return {**run, **kept, "first_grads": {}}
