"""Our DPO losses equal TRL's DPOTrainer loss, gradients and logged rewards on identical inputs
(fp32, 1e-6), on one rank and split over two.

TRL 1.16 computes the loss inside ``DPOTrainer._compute_loss``; we build a tiny Llama from a
config (no download), let TRL tokenize and collate four pairs, hand both implementations the
same batch and the same reference log-probs, and compare. Each case is spelt as a user would
(``sigmoid_norm`` is TRL's name for ``length_normalized``). Conservative DPO (``cdpo``) has no
TRL 1.16 counterpart and is checked against its formula in test_post_training_losses.py.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from testutils import run_distributed_test

from olmolike.nn.functional import DPOOutput, dpo_loss, sequence_log_probs

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

CASES = {
    "sigmoid": ("sigmoid", 0.0),
    "hinge": ("hinge", 0.0),
    "ipo": ("ipo", 0.0),
    "length_normalized": ("sigmoid_norm", 0.0),
    "sigmoid_norm": ("sigmoid_norm", 0.0),
    "robust": ("robust", 0.2),
}
"""Our ``loss_type`` -> TRL's ``loss_type`` and the ``label_smoothing`` both are given."""
BETA = 0.3
PAIRS = 4


def _tokenizer() -> Any:
    vocab = {f"t{i}": i for i in range(30)} | {"<pad>": 30, "<eos>": 31}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>"
    )


def _trl_setup(trl_loss: str, label_smoothing: float, tmp_path: Path) -> tuple[Any, Any, Any]:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=30, eos_token_id=31,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).float()
    data = datasets.Dataset.from_dict({
        "prompt": ["t1 t2", "t3", "t11 t12 t13", "t14"],
        "chosen": [" t4 t5", " t6", " t15", " t16 t17 t18 t19"],
        "rejected": [" t7", " t8 t9 t10", " t20 t21", " t22"],
    })  # fmt: skip
    args = trl.DPOConfig(
        output_dir=str(tmp_path), bf16=False, beta=BETA, loss_type=[trl_loss],
        label_smoothing=label_smoothing, report_to=[], per_device_train_batch_size=PAIRS,
        use_cpu=True,
    )  # fmt: skip
    trainer = trl.DPOTrainer(
        model=model, ref_model=copy.deepcopy(model), args=args, train_dataset=data,
        processing_class=_tokenizer(),
    )  # fmt: skip
    trainer.precompute_ref_logps = True  # the reference log-probs come with the batch
    batch = dict(next(iter(trainer.get_train_dataloader())))
    g = torch.Generator().manual_seed(1)
    batch["ref_chosen_logps"] = -torch.rand(PAIRS, generator=g) * 8
    batch["ref_rejected_logps"] = -torch.rand(PAIRS, generator=g) * 8
    return trainer, model, batch


def _trl_loss_and_grads(trainer: Any, model: Any, batch: Any) -> tuple[Any, list[Any]]:
    model.train()
    loss = trainer._compute_loss(model, dict(batch), False)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.detach().float(), grads


def _ours(
    model: Any, batch: Any, loss_type: str, label_smoothing: float, pairs: slice
) -> DPOOutput:
    """Our loss on ``pairs`` of the batch (rows: the chosen responses, then the rejected)."""
    rows = list(range(PAIRS))[pairs]
    rows += [PAIRS + r for r in rows]
    ids, completion = batch["input_ids"][rows], batch["completion_mask"][rows]
    # Position t predicts token t + 1: trained where that token is part of the response.
    labels = torch.where(completion[:, 1:] == 1, ids[:, 1:], -100)
    labels = torch.nn.functional.pad(labels, (0, 1), value=-100)
    logits = model(input_ids=ids, attention_mask=batch["attention_mask"][rows]).logits
    logps, lengths = sequence_log_probs(logits, labels)
    return dpo_loss(
        *logps.chunk(2), batch["ref_chosen_logps"][pairs], batch["ref_rejected_logps"][pairs],
        beta=BETA, loss_type=loss_type, label_smoothing=label_smoothing,  # type: ignore[arg-type]
        chosen_lengths=lengths.chunk(2)[0], rejected_lengths=lengths.chunk(2)[1],
    )  # fmt: skip


@pytest.mark.timeout(300)
@pytest.mark.parametrize("loss_type", list(CASES))
def test_loss_gradients_and_rewards_equal_trl(loss_type: str, tmp_path: Path) -> None:
    trl_loss, label_smoothing = CASES[loss_type]
    trainer, model, batch = _trl_setup(trl_loss, label_smoothing, tmp_path)
    theirs, trl_grads = _trl_loss_and_grads(trainer, model, batch)
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    ours = _ours(model, batch, loss_type, label_smoothing, slice(None))
    ours.loss.backward()
    torch.testing.assert_close(ours.loss, theirs, rtol=0, atol=1e-6)
    for mine, their_grad in zip([p.grad for p in model.parameters()], trl_grads):
        torch.testing.assert_close(mine, their_grad, rtol=0, atol=1e-6)
    # TRL logs beta * (summed) log-ratios for every loss type, also where the loss averages.
    margins = ours.chosen_rewards - ours.rejected_rewards
    assert ours.chosen_rewards.mean().item() == pytest.approx(logged["rewards/chosen"], abs=1e-6)
    assert ours.rejected_rewards.mean().item() == pytest.approx(
        logged["rewards/rejected"], abs=1e-6
    )
    assert margins.mean().item() == pytest.approx(logged["rewards/margins"], abs=1e-6)
    assert (margins > 0).float().mean().item() == logged["rewards/accuracies"]


@pytest.mark.timeout(300)
def test_trl_sigmoid_ignores_label_smoothing_and_we_refuse_it(tmp_path: Path) -> None:
    smoothed, _ = _trl_loss_and_grads(*_trl_setup("sigmoid", 0.2, tmp_path / "a"))
    plain, _ = _trl_loss_and_grads(*_trl_setup("sigmoid", 0.0, tmp_path / "b"))
    assert smoothed == plain
    _, model, batch = _trl_setup("sigmoid", 0.0, tmp_path / "c")
    with pytest.raises(ValueError, match="loss_type=cdpo for conservative DPO"):
        _ours(model, batch, "sigmoid", 0.2, slice(None))


def _two_ranks(model: Any, batch: Any, expected: dict[str, tuple[Any, list[Any]]]) -> None:
    """Each rank scores half of the pairs; averaged as data-parallel training averages them,
    loss and gradients are TRL's on the whole batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    half = PAIRS // world
    for loss_type, (trl_loss, trl_grads) in expected.items():
        model.zero_grad(set_to_none=True)
        out = _ours(
            model, batch, loss_type, CASES[loss_type][1], slice(rank * half, (rank + 1) * half)
        )
        out.loss.backward()
        loss = out.loss.detach().clone()
        dist.all_reduce(loss)
        torch.testing.assert_close(loss / world, trl_loss, rtol=0, atol=1e-6, msg=loss_type)
        for p, their_grad in zip(model.parameters(), trl_grads):
            dist.all_reduce(p.grad)
            torch.testing.assert_close(p.grad / world, their_grad, rtol=0, atol=1e-6)


@pytest.mark.timeout(600)
def test_two_ranks_equal_trl_on_the_whole_batch(tmp_path: Path) -> None:
    expected, model, batch = {}, None, None
    for loss_type, (trl_loss, label_smoothing) in CASES.items():
        trainer, model, batch = _trl_setup(trl_loss, label_smoothing, tmp_path / loss_type)
        expected[loss_type] = _trl_loss_and_grads(trainer, model, batch)
    # _trl_setup seeds the same model and batch every time: the last serves every case.
    # Ranks from the fork server (as if spawned), not forked from here: the TRL trainer above
    # has started threads, and a forked child of a threaded process can hang on a lock one of
    # them held.
    run_distributed_test(_two_ranks, 2, args=(model, batch, expected), timeout=300)
