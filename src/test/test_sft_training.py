"""SFT training: masked loss normalised over the global trained tokens, exact resume, evaluator."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from testutils import run_distributed_test

from olmolike.data import ByteTokenizer, NumpyDataLoaderConfig, SFTDataset, prepare_sft_data
from olmolike.data.sft_dataset import SFTDatasetConfig
from olmolike.distributed.parallel import DataParallelConfig, DataParallelType
from olmolike.distributed.utils import broadcast_object
from olmolike.nn import TransformerConfig
from olmolike.nn.functional import cross_entropy_loss
from olmolike.optim import AdamWConfig, CosWithWarmup
from olmolike.train import Callback, Duration, Trainer, TrainerConfig
from olmolike.train.callbacks import LMEvaluator, SFTEvaluatorCallbackConfig
from olmolike.train.train_module import TransformerTrainModuleConfig

SEQ = 64
BATCH = 8  # sequences per global batch


def _write(path: Path, completion_lengths: list[int]) -> Path:
    lines = []
    for i, n in enumerate(completion_lengths):
        completion = "".join(chr(97 + (i * 7 + j) % 26) for j in range(n))
        lines.append(json.dumps({"prompt": f"q{i}", "completion": completion}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def uneven(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Padded, in input order: the first half of a batch (rank 0 of 2) has 1-character completions,
    the second half 20-character ones, so the ranks train on very different token counts."""
    root = tmp_path_factory.mktemp("uneven")
    source = _write(root / "train.jsonl", [1] * 4 + [20] * 4 + [3] * 4 + [18] * 4)
    prepare_sft_data([source], root / "data", sequence_length=SEQ, packing="padded")
    return root / "data"


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("packed")
    lengths = [3 + (i * 11) % 19 for i in range(120)]
    source = _write(root / "train.jsonl", lengths)
    prepare_sft_data([source], root / "data", sequence_length=SEQ, val_fraction=0.2, seed=1)
    return root / "data"


@dataclass
class Recorder(Callback):
    losses: dict[int, float] = field(default_factory=dict)
    metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    grads: list[torch.Tensor] = field(default_factory=list)

    def pre_optim_step(self) -> None:
        if not self.grads:
            from torch.distributed.tensor import DTensor

            model = self.trainer.train_module.model  # type: ignore[attr-defined]
            for p in model.parameters():
                grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                self.grads.append(grad.detach().clone())

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.metrics[step] = dict(metrics)
        self.losses[step] = metrics["train/CE loss"]


def build(
    save: str | Path,
    data: Path,
    *,
    steps: int,
    shuffle: bool = True,
    dp: str | None = None,
    **kwargs: Any,
) -> tuple[Trainer, Recorder]:
    from olmolike.distributed.utils import get_world_size

    model = TransformerConfig(
        vocab_size=ByteTokenizer.VOCAB_SIZE, d_model=32, n_layers=2, n_heads=4,
        max_sequence_length=SEQ,
    ).build(seed=0)  # fmt: skip
    rank_rows = BATCH // get_world_size()
    module = TransformerTrainModuleConfig(
        rank_microbatch_size=max(rank_rows // 2, 1) * SEQ,
        optim=AdamWConfig(lr=1e-2, weight_decay=0.1),
        scheduler=CosWithWarmup(warmup=min(2, steps)),
        max_grad_norm=1.0,
        dp_config=None if dp is None else DataParallelConfig(name=DataParallelType(dp)),
    ).build(model)
    loader = NumpyDataLoaderConfig(global_batch_size=BATCH * SEQ, seed=0, shuffle=shuffle).build(
        SFTDatasetConfig(str(data)).build()
    )
    recorder = Recorder()
    config = TrainerConfig(
        save_folder=str(save),
        max_duration=Duration.steps(steps),
        metrics_collect_interval=1,
        device="cpu",
        callbacks={"recorder": recorder, **kwargs.pop("callbacks", {})},
        **kwargs,
    )
    return config.build(module, loader), recorder


def _one_step(data: Path, dp: str | None = None) -> tuple[float, list[torch.Tensor], float]:
    save = broadcast_object(tempfile.mkdtemp())
    trainer, recorder = build(save, data, steps=1, shuffle=False, no_checkpoints=True, dp=dp)
    trainer.fit()
    return recorder.losses[1], recorder.grads, recorder.metrics[1]["train/padding fraction"]


def test_masked_loss_is_a_mean_over_the_global_trained_tokens(uneven: Path) -> None:
    """One process: the loss and gradient equal a plain full-batch mean over trained tokens."""
    loss, grads, padding = _one_step(uneven)
    dataset = SFTDataset(uneven)
    batch = [dataset[i] for i in range(BATCH)]
    ids = torch.stack([b["input_ids"] for b in batch])
    labels = torch.stack([b["labels"] for b in batch])
    model = TransformerConfig(
        vocab_size=ByteTokenizer.VOCAB_SIZE, d_model=32, n_layers=2, n_heads=4,
        max_sequence_length=SEQ,
    ).build(seed=0)  # fmt: skip
    logits = model(ids, doc_ids=torch.stack([b["doc_ids"] for b in batch]))
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    want.backward()
    assert loss == pytest.approx(want.item(), rel=1e-6)
    for got, p in zip(grads, model.parameters()):
        torch.testing.assert_close(got, p.grad, rtol=1e-5, atol=1e-7)
    # Rank 0's half of this batch trains on 9 tokens per row, rank 1's on 28: a per-rank mean
    # would weigh them alike, so the check above would fail for it.
    counts = (labels != -100).sum(dim=1)
    assert counts[:4].sum() * 2 < counts[4:].sum()
    doc_ids = torch.stack([b["doc_ids"] for b in batch])
    assert padding == pytest.approx((doc_ids < 0).float().mean().item())


@pytest.mark.timeout(240)
@pytest.mark.parametrize("dp", ["ddp", "fsdp"])
def test_two_ranks_with_uneven_masks_match_one_process(uneven: Path, dp: str) -> None:
    loss, grads, _ = _one_step(uneven)
    for rank_loss, rank_grads, _ in run_distributed_test(_one_step, 2, args=(uneven, dp)):
        assert rank_loss == pytest.approx(loss, rel=1e-5)
        for got, want in zip(rank_grads, grads):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_interrupted_sft_run_resumes_bit_for_bit(packed: Path, tmp_path: Path) -> None:
    full, full_log = build(tmp_path / "full", packed, steps=6)
    full.fit()
    first, _ = build(tmp_path / "resumed", packed, steps=6, hard_stop=Duration.steps(3))
    first.fit()
    second, second_log = build(tmp_path / "resumed", packed, steps=6)
    second.fit()
    assert min(second_log.losses) == 4  # it resumed, it did not start over
    assert [second_log.losses[s] for s in range(4, 7)] == [full_log.losses[s] for s in range(4, 7)]
    full_model = full.train_module.model  # type: ignore[attr-defined]
    resumed_model = second.train_module.model  # type: ignore[attr-defined]
    for a, b in zip(full_model.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b)


def _alone_loss(model: torch.nn.Module, dataset: SFTDataset) -> float:
    """Mean CE over the trained tokens, each packed example run alone through the model."""
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(len(dataset)):
            item = dataset[i]
            for doc in item["doc_ids"].unique().tolist():
                if doc < 0:
                    continue
                where = item["doc_ids"] == doc
                logits = model(item["input_ids"][where].unsqueeze(0))[0]
                loss, _ = cross_entropy_loss(logits, item["labels"][where], reduction="sum")
                total += loss.item()
                count += int((item["labels"][where] != -100).sum())
    return total / count


def test_evaluator_scores_completions_only_with_documents_apart(
    packed: Path, tmp_path: Path
) -> None:
    trainer, recorder = build(
        tmp_path / "run", packed, steps=2, no_checkpoints=True,
        callbacks={"sft_evaluator": SFTEvaluatorCallbackConfig(
            eval_dataset=SFTDatasetConfig(str(packed), split="val"), eval_interval=2,
            eval_batch_size=3,
        )},
    )  # fmt: skip
    trainer.fit()
    assert "eval/sft/CE loss" in recorder.metrics[2]
    val = SFTDataset(packed, "val")
    model = trainer.train_module.model  # type: ignore[attr-defined]
    evaluator = LMEvaluator("sft", val, rank_batch_instances=3, device=torch.device("cpu"))
    got = evaluator.evaluate(trainer.train_module)["CE loss"].item()
    assert got == pytest.approx(_alone_loss(model, val), rel=1e-5)
    assert recorder.metrics[2]["eval/sft/CE loss"] == pytest.approx(got, rel=1e-6)


def test_basic_train_module_refuses_packed_batches(packed: Path) -> None:
    from olmolike.exceptions import ConfigurationError
    from olmolike.testing import TinyCausalLM
    from olmolike.train import BasicTrainModule

    model = TinyCausalLM(vocab_size=ByteTokenizer.VOCAB_SIZE, d_model=16, n_layers=1, n_heads=2)
    module = BasicTrainModule(model, torch.optim.SGD(model.parameters()), rank_microbatch_size=SEQ)
    item = SFTDataset(packed)[0]
    batch = {key: item[key].unsqueeze(0) for key in ("input_ids", "labels", "doc_ids")}
    with pytest.raises(ConfigurationError, match="TransformerTrainModule"):
        module.train_batch(batch)
