"""The GRPO loss and its gradients equal TRL's (``GRPOTrainer._compute_loss``, TRL 1.16).

A tiny random Llama (built from a config, saved locally: TRL builds its reference model from a
path) and a word-level tokenizer stand in for a real model; no download. On identical inputs
(prompt and completion ids, completion mask, advantages, old and reference log-probs) TRL
computes the policy's log-probs with that model and its loss; ours computes the log-probs with
:func:`olmolike.nn.log_probs_of_labels` from the same model's logits and applies
:func:`grpo_loss`. The losses and every parameter's gradient must agree in float32.
Our ``token`` aggregation is TRL's ``loss_type="bnpo"``, ``sequence`` is its ``"grpo"``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer

from olmolike.nn import log_probs_of_labels
from olmolike.train.train_module.grpo import GRPOLossConfig, LossAggregation, grpo_loss

VOCAB = 32
BATCH, PROMPT, COMPLETION = 4, 3, 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def trl_trainer(model_dir: Path, tmp_path: Path, **grpo_args: Any) -> GRPOTrainer:
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t0")),
        pad_token="t0",
        eos_token="t1",
    )
    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        bf16=False,
        use_cpu=True,
        report_to=[],
        per_device_train_batch_size=BATCH,
        num_generations=BATCH,
        **grpo_args,
    )
    return GRPOTrainer(
        model=str(model_dir),
        reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["t2 t3 t4"] * BATCH}),
        processing_class=tokenizer,
    )


def inputs(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(2, VOCAB, (BATCH, PROMPT), generator=g)
    completion_ids = torch.randint(2, VOCAB, (BATCH, COMPLETION), generator=g)
    lengths = torch.tensor([6, 4, 1, 3])
    completion_mask = (torch.arange(COMPLETION) < lengths[:, None]).long()
    with torch.no_grad():
        current = policy_logps(model, prompt_ids, completion_ids)
    # Old and reference log-probs away from the current ones, so that ratios are clipped on
    # both sides and the KL is not 0.
    old = current + 0.4 * torch.randn(current.shape, generator=g)
    ref = current + 0.5 * torch.randn(current.shape, generator=g)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor([1.2, -0.7, 0.3, -1.5]),
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
    }


def policy_logps(
    model: torch.nn.Module, prompt_ids: torch.Tensor, completion_ids: torch.Tensor
) -> torch.Tensor:
    ids = torch.cat((prompt_ids, completion_ids), dim=1)
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    return log_probs_of_labels(logits[:, PROMPT - 1 : -1], completion_ids)


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("aggregation", "loss_type", "beta", "epsilon_high", "kl_weighting"),
    [
        (LossAggregation.token, "bnpo", 0.0, None, True),
        (LossAggregation.token, "bnpo", 0.1, 0.28, True),
        (LossAggregation.token, "bnpo", 0.1, None, False),
        (LossAggregation.sequence, "grpo", 0.0, None, True),
        (LossAggregation.sequence, "grpo", 0.1, 0.28, True),
        (LossAggregation.sequence, "grpo", 0.1, None, False),
    ],
)
def test_loss_and_gradients_equal_trl(
    model_dir: Path,
    tmp_path: Path,
    aggregation: LossAggregation,
    loss_type: str,
    beta: float,
    epsilon_high: float | None,
    kl_weighting: bool,
) -> None:
    trainer = trl_trainer(
        model_dir,
        tmp_path,
        loss_type=loss_type,
        beta=beta,
        epsilon=0.2,
        epsilon_high=epsilon_high,
        use_bias_correction_kl=kl_weighting,
    )
    model = trainer.model
    assert model is not None and not model.training  # eval: TRL divides by no accumulation
    batch = inputs(model)

    trl_loss = trainer._compute_loss(model, batch)
    trl_loss.backward()
    trl_grads = gradients(model)

    config = GRPOLossConfig(
        group_size=BATCH,
        clip_eps_low=0.2,
        clip_eps_high=epsilon_high,
        kl_coef=beta,
        kl_importance_weighting=kl_weighting,
        aggregation=aggregation,
    )
    logps = policy_logps(model, batch["prompt_ids"], batch["completion_ids"])
    loss, stats = grpo_loss(
        logps,
        batch["old_per_token_logps"],
        batch["advantages"],
        batch["completion_mask"],
        config,
        ref_logps=batch["ref_per_token_logps"],
    )
    loss.backward()
    grads = gradients(model)

    torch.testing.assert_close(loss, trl_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == trl_grads.keys() and len(grads) > 10
    for name, grad in grads.items():
        torch.testing.assert_close(grad, trl_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    # The metrics TRL logs for the same step.
    metrics = trainer._metrics["eval"]
    assert 0 < float(stats.clip_fraction) < 1
    assert float(stats.clip_fraction) == pytest.approx(
        metrics["clip_ratio/region_mean"][-1], abs=1e-6
    )
    if beta:
        assert float(stats.kl) == pytest.approx(metrics["kl"][-1], rel=1e-5)
