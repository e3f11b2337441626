"""Context parallelism (:mod:`olmolike.nn.context_parallel`) on gloo ranks equals one process.

The model-level checks run a whole sequence through a model split over 2 and 4 ranks: the
logits gathered back, the loss (z-loss, label smoothing) and every parameter's gradient summed
over the ranks equal one process's, for plain sequences, packed documents whose borders cut
through the ranks' chunks, and a length that is not a multiple of ``2 cp`` (padded).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from testutils import run_distributed_test
from torch.distributed.tensor import DTensor

from olmolike.data import TokenTensorDataLoader
from olmolike.distributed.parallel import DataParallelConfig, DataParallelType
from olmolike.distributed.pipeline import PipelineParallelConfig
from olmolike.distributed.tensor_parallel import ContextParallelConfig, TensorParallelConfig
from olmolike.distributed.utils import get_rank
from olmolike.nn import TransformerConfig
from olmolike.nn.context_parallel import ContextParallel, apply_context_parallel
from olmolike.nn.functional import cross_entropy_loss
from olmolike.optim import SGDConfig
from olmolike.testing import random_token_instances
from olmolike.train import Callback, Duration, TrainerConfig
from olmolike.train.callbacks import CheckpointerCallback
from olmolike.train.train_module import (
    ActivationCheckpointingConfig,
    ActivationCheckpointingMode,
    TransformerTrainModuleConfig,
)

SEQ, VOCAB = 30, 64
TOLERANCE = dict(rtol=0, atol=1e-5)


def model_config(**overrides: Any) -> TransformerConfig:
    """OLMo-2 blocks (QK-norm, reordered norms) with grouped-query attention."""
    shape = dict(
        vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, qk_norm=True,
        block_type="reordered_norm", max_sequence_length=32,
    )  # fmt: skip
    return TransformerConfig(**{**shape, **overrides})  # type: ignore[arg-type]


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two rows of 30 tokens (not a multiple of 4 or 8), their labels, and documents that
    start and end inside chunks, with padding (-1) at the end of the second row."""
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    docs = torch.tensor([[0] * 7 + [1] * 12 + [2] * 11, [5] * 3 + [6] * 20 + [-1] * 7])
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    return ids, labels, docs


def forward_backward(
    model: torch.nn.Module, doc_ids: torch.Tensor | None, cp: ContextParallel | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """Logits of the whole batch, the gradients, and the loss (CE + z-loss, summed)."""
    ids, labels, _ = batch()
    model.zero_grad()
    logits = model(ids, doc_ids=doc_ids)
    if cp is not None:
        labels = cp.shard(labels, pad_value=-100)
    ce, z = cross_entropy_loss(
        logits, labels, reduction="sum", z_loss_multiplier=1e-3, label_smoothing=0.1
    )
    assert z is not None
    (ce + z).backward()
    loss = (ce + z).detach()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    if cp is not None:
        logits = cp.gather(logits.detach(), SEQ)
        for grad in [loss, *grads.values()]:
            dist.all_reduce(grad)
    return logits.detach(), grads, loss


def _split_model() -> list[tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]]:
    model = model_config().build(seed=0)
    apply_context_parallel(model, dist.group.WORLD)
    assert model.context_parallel is not None
    return [forward_backward(model, docs, model.context_parallel) for docs in (None, batch()[2])]


@pytest.mark.parametrize("degree", [2, 4])
def test_split_model_equals_one_process(degree: int) -> None:
    model = model_config().build(seed=0)
    want = [forward_backward(model, docs, None) for docs in (None, batch()[2])]
    for got in run_distributed_test(_split_model, degree, timeout=120):
        for (logits, grads, loss), (w_logits, w_grads, w_loss) in zip(got, want, strict=True):
            torch.testing.assert_close(logits, w_logits, **TOLERANCE)
            torch.testing.assert_close(loss, w_loss, rtol=1e-6, atol=1e-5)
            assert grads.keys() == w_grads.keys()
            for name, grad in w_grads.items():
                torch.testing.assert_close(grads[name], grad, **TOLERANCE, msg=name)


# -- training: every layout equals one process ------------------------------------------------

ROWS, STEPS = 8, 3


class Loader(TokenTensorDataLoader):
    """Plain sequences, or (``packed``) SFT-shaped batches: labels masked unevenly and packed
    documents whose borders fall anywhere, different in every row."""

    packed = False

    def _iter_batches(self) -> Iterator[dict[str, Any]]:
        for batch in super()._iter_batches():
            if not self.packed:
                yield batch
                continue
            ids = batch["input_ids"]
            labels = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
            labels = torch.where(ids % 3 == 0, torch.full_like(labels, -100), labels)
            doc_ids = (ids % 7 == 0).long().cumsum(1)
            yield {"input_ids": ids, "labels": labels, "doc_ids": doc_ids}


@dataclass
class Record(Callback):
    """Every logged metric, and every parameter's gradient before the first optimizer step."""

    metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)

    def pre_optim_step(self) -> None:
        if self.trainer.global_step == 1:
            model = self.trainer.train_module.model  # type: ignore[attr-defined]
            self.grads = {
                n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None
            }

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.metrics[step] = dict(metrics)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return whole.detach().clone()


@dataclass
class Run:
    metrics: dict[int, dict[str, float]]
    grads: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]
    eval_loss: float
    eval_logits: torch.Tensor


def train(
    save: str | Path,
    *,
    cp: int = 1,
    tp: int = 1,
    pp: int = 1,
    dp: str | None = None,
    ac: bool = False,
    packed: bool = False,
    steps: int = STEPS,
    save_interval: int | None = None,
    load_path: str | None = None,
) -> Run:
    """The same run (SGD with momentum, clipping, z-loss, label smoothing) under a layout."""
    module = TransformerTrainModuleConfig(
        rank_microbatch_size=2 * SEQ,
        optim=SGDConfig(lr=0.1, momentum=0.9),
        max_grad_norm=1.0,
        z_loss_multiplier=1e-3,
        label_smoothing=0.1,
        dp_config=_data_parallel(dp),
        ac_config=ActivationCheckpointingConfig(mode=ActivationCheckpointingMode.full)
        if ac
        else None,
        cp_config=ContextParallelConfig(degree=cp) if cp > 1 else None,
        tp_config=TensorParallelConfig(degree=tp) if tp > 1 else None,
        pp_config=PipelineParallelConfig(degree=pp) if pp > 1 else None,
    ).build(model_config().build(init_device="meta"))
    degrees = module.layout.degrees
    loader = Loader(
        random_token_instances(64, SEQ, VOCAB, seed=1),
        global_batch_size=ROWS * SEQ,
        dp_rank=degrees.dp_rank(get_rank()),
        dp_world_size=degrees.dp,
    )
    loader.packed = packed
    record = Record()
    callbacks: dict[str, Callback] = {"record": record}
    if save_interval is not None:
        callbacks["checkpointer"] = CheckpointerCallback(
            save_interval=save_interval, pre_train_checkpoint=False
        )
    TrainerConfig(
        save_folder=str(save),
        max_duration=Duration.steps(steps),
        metrics_collect_interval=1,
        device="cpu",
        callbacks=callbacks,
        no_checkpoints=save_interval is None,
        load_path=load_path,
    ).build(module, loader).fit()
    params = {n: _full(p) for n, p in module.model.state_dict().items()}
    ids, labels, docs = batch()
    eval_batch = {"input_ids": ids, **({"doc_ids": docs} if packed else {})}
    eval_loss = float(module.eval_batch(eval_batch, labels))
    return Run(
        record.metrics, record.grads, params, eval_loss, _full(module.eval_batch(eval_batch))
    )


def _data_parallel(name: str | None) -> DataParallelConfig | None:
    """``hsdp`` here means two replicas (of the context-parallel pair's shards)."""
    if name is None:
        return None
    replicas = 2 if name == "hsdp" else None
    return DataParallelConfig(name=DataParallelType(name), num_replicas=replicas)


def assert_same_run(got: Run, want: Run, exact: bool = False) -> None:
    """The same metrics (names and values), first-step gradients, SGD weights and evaluation,
    within 1e-5 (``exact``: bit for bit)."""
    tolerance = dict(rtol=0, atol=0) if exact else TOLERANCE
    # A resumed run logs the steps after its checkpoint only.
    assert got.metrics and set(got.metrics) == set(want.metrics) - set(range(min(got.metrics)))
    for step, metrics in got.metrics.items():
        metrics = want.metrics[step]
        assert got.metrics[step].keys() == metrics.keys()
        for name, value in metrics.items():
            assert got.metrics[step][name] == pytest.approx(value, abs=0 if exact else 1e-5), (
                step,
                name,
            )
    for name, grad in got.grads.items():  # a pipeline rank holds its stages' parameters
        torch.testing.assert_close(grad, want.grads[name], **tolerance, msg=name)
    for name, param in got.params.items():
        torch.testing.assert_close(param, want.params[name], **tolerance, msg=name)
    assert got.eval_loss == pytest.approx(want.eval_loss, abs=0 if exact else 1e-5)
    torch.testing.assert_close(got.eval_logits, want.eval_logits, **tolerance)


def _two_ranks(save: str) -> dict[str, Run]:
    """CP2 on plain and packed sequences; a run stopped at step 2 and resumed (which leaves
    its step-2 checkpoint for the one-process step of the move across layouts)."""
    runs = {f"packed={p}": train(Path(save) / f"cp2-{p}", cp=2, packed=p) for p in (False, True)}
    train(Path(save) / "stopped", cp=2, steps=2, save_interval=2)
    runs["resumed"] = train(Path(save) / "stopped", cp=2, steps=4, save_interval=2)
    runs["straight"] = train(Path(save) / "straight", cp=2, steps=4)
    return runs


LAYOUTS: dict[str, dict[str, Any]] = {
    "cp4": dict(cp=4),
    "cp2 x fsdp2": dict(cp=2, dp="fsdp", ac=True),
    "cp2 x tp2": dict(cp=2, tp=2, dp="fsdp"),
    "cp2 x pp2": dict(cp=2, pp=2),
}
"""Layouts run on plain sequences and packed documents (CP2 x FSDP2 with full activation
checkpointing: its backward gathers the keys and values again)."""
PLAIN_ONLY: dict[str, dict[str, Any]] = {
    "cp2 x ddp2": dict(cp=2, dp="ddp"),
    "cp2 x hsdp2": dict(cp=2, dp="hsdp"),
}
"""Layouts whose gradient reduction differs only: DDP over the data x context ranks, and HSDP
replicated over the data ranks, sharded over the context pair."""


def _four_ranks(save: str, moved: str) -> dict[str, Run]:
    """Every layout on plain and packed sequences, and CP2 x FSDP2 going on from the
    one-process checkpoint (which went on from CP2's)."""
    cases = [(n, layout, p) for n, layout in LAYOUTS.items() for p in (False, True)]
    cases += [(n, layout, False) for n, layout in PLAIN_ONLY.items()]
    runs = {
        f"{name} packed={p}": train(Path(save) / f"{name}-{p}".replace(" ", ""), packed=p, **layout)
        for name, layout, p in cases
    }
    runs["moved"] = train(Path(save) / "moved", cp=2, dp="fsdp", steps=4, load_path=moved)
    return runs


@pytest.mark.slow
def test_training_under_context_parallelism_equals_one_process(tmp_path: Path) -> None:
    """CP2, CP4, CP2 x FSDP2, CP2 x TP2 and CP2 x PP2, on plain sequences and packed documents
    (30 tokens: padded to a multiple of 2 cp x tp), and CP2 x DDP2 and CP2 x HSDP2 on plain
    sequences: every metric, the first step's gradients,
    the weights after SGD and the evaluation equal one process's. A CP2 run stopped and
    resumed equals the straight run bit for bit, and a checkpoint moves from CP2 to one process
    to CP2 x FSDP2 with the optimizer's momentum."""
    want = {p: train(tmp_path / f"one-{p}", packed=p) for p in (False, True)}
    two = run_distributed_test(_two_ranks, 2, args=(str(tmp_path / "two"),), timeout=300)[0]
    for p in (False, True):
        assert_same_run(two[f"packed={p}"], want[p])
    assert_same_run(two["resumed"], two["straight"], exact=True)
    # One process goes on from CP2's step-2 checkpoint to step 3 and saves it.
    stopped = tmp_path / "two" / "stopped" / "step2"
    train(tmp_path / "middle", steps=3, save_interval=3, load_path=str(stopped))
    four = run_distributed_test(
        _four_ranks,
        4,
        args=(str(tmp_path / "four"), str(tmp_path / "middle" / "step3")),
        timeout=600,
    )[0]
    for name in LAYOUTS:
        for p in (False, True):
            assert_same_run(four[f"{name} packed={p}"], want[p])
    for name in PLAIN_ONLY:
        assert_same_run(four[f"{name} packed=False"], want[False])
    straight = train(tmp_path / "one-straight", steps=4)
    assert_same_run(four["moved"], straight)
