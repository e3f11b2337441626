"""Our DPO losses equal TRL's DPOTrainer loss and gradients on identical inputs (fp32, 1e-6).

TRL 1.16 computes the loss inside ``DPOTrainer._compute_loss``; we build a tiny Llama from a
config (no download), let TRL tokenize and collate four pairs, hand both implementations the
same batch and the same reference log-probs, and compare. Conservative DPO (sigmoid with
label smoothing) has no TRL 1.16 counterpart and is checked against its formula elsewhere.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from olmolike.nn.functional import DPOLossType, dpo_loss, sequence_log_probs

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

TRL_NAMES = {
    DPOLossType.sigmoid: "sigmoid",
    DPOLossType.hinge: "hinge",
    DPOLossType.ipo: "ipo",
    DPOLossType.length_normalized: "sigmoid_norm",
}
BETA = 0.3


def _tokenizer() -> Any:
    vocab = {f"t{i}": i for i in range(30)} | {"<pad>": 30, "<eos>": 31}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>"
    )


def _trl_setup(loss_type: DPOLossType, tmp_path: Path) -> tuple[Any, Any, dict[str, Any]]:
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
        output_dir=str(tmp_path), bf16=False, beta=BETA, loss_type=[TRL_NAMES[loss_type]],
        report_to=[], per_device_train_batch_size=4, use_cpu=True,
    )  # fmt: skip
    trainer = trl.DPOTrainer(
        model=model, ref_model=copy.deepcopy(model), args=args, train_dataset=data,
        processing_class=_tokenizer(),
    )  # fmt: skip
    trainer.precompute_ref_logps = True  # the reference log-probs come with the batch
    batch = dict(next(iter(trainer.get_train_dataloader())))
    g = torch.Generator().manual_seed(1)
    batch["ref_chosen_logps"] = -torch.rand(4, generator=g) * 8
    batch["ref_rejected_logps"] = -torch.rand(4, generator=g) * 8
    return trainer, model, batch


@pytest.mark.timeout(300)
@pytest.mark.parametrize("loss_type", list(TRL_NAMES))
def test_loss_and_gradients_equal_trl(loss_type: DPOLossType, tmp_path: Path) -> None:
    trainer, model, batch = _trl_setup(loss_type, tmp_path)
    model.train()
    trl_loss = trainer._compute_loss(model, dict(batch), False)
    trl_loss.backward()
    trl_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)

    ids, completion = batch["input_ids"], batch["completion_mask"]
    # Position t predicts token t + 1: trained where that token is part of the response.
    labels = torch.where(completion[:, 1:] == 1, ids[:, 1:], -100)
    labels = torch.nn.functional.pad(labels, (0, 1), value=-100)
    logits = model(input_ids=ids, attention_mask=batch["attention_mask"]).logits
    logps, lengths = sequence_log_probs(logits, labels)
    ours = dpo_loss(
        *logps.chunk(2), batch["ref_chosen_logps"], batch["ref_rejected_logps"], beta=BETA,
        loss_type=loss_type, chosen_lengths=lengths.chunk(2)[0],
        rejected_lengths=lengths.chunk(2)[1],
    )  # fmt: skip
    ours.loss.backward()
    torch.testing.assert_close(ours.loss, trl_loss.float(), rtol=0, atol=1e-6)
    for mine, theirs in zip([p.grad for p in model.parameters()], trl_grads):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)
