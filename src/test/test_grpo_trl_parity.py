"""The GRPO loss, its gradients, advantages and clip metrics equal TRL's (``GRPOTrainer``, TRL
1.16) in float64, for every ``loss_type`` TRL and olmolike share, on one rank and on two.

A tiny random Llama (built from a config, saved locally: TRL builds its model from a path) and
a word-level tokenizer stand in for a real model; no download. On identical inputs (prompt and
completion ids, completion mask, advantages, old and reference log-probs) TRL computes its loss
(``_compute_loss``) and ours :func:`grpo_loss` with the denominators of
:func:`update_denominators`, both from the same float64 policy log-probs of the same model, and
the losses and every parameter's gradient agree to 1e-12 (TRL's own log-prob head computes in
float32: with it, and ours, :func:`olmolike.nn.log_probs_of_labels`, they agree in float32).

TRL on W ranks with G accumulation micro-batches is TRL's ``_compute_loss`` on each rank's
micro-batch (with ``accelerator.num_processes = W``), the gradients summed over micro-batches
and averaged over ranks as DDP does: that is computed in this process. Ours runs on two real
(gloo) ranks, agreeing on the denominators with the same all-reduce the train module uses.
TRL's ``bnpo`` divides each accumulation micro-batch by its own tokens; ours divides each
rank's share of an update by that share's tokens, so they are compared without accumulation.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from testutils import run_distributed_test

from olmolike.nn import log_probs_of_labels
from olmolike.train.train_module.grpo import (
    GRPOLossConfig,
    group_advantages,
    grpo_loss,
    update_denominators,
)

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

VOCAB = 32
BATCH, PROMPT, COMPLETION = 8, 3, 6
MAX_COMPLETION = 7
"""TRL's ``max_completion_length`` (our ``sampling.max_new_tokens``): ``dr_grpo``'s constant."""
REWARDS = [1.0, 0.0, 0.5, 0.5, 3.0, 1.0, 2.0, 2.5]
"""Two groups of four: unequal stds, so group and batch scaling differ."""


@dataclasses.dataclass(frozen=True)
class Case:
    ours: str
    """Our ``aggregation``."""
    trl: str
    """TRL's ``loss_type``."""
    beta: float = 0.0
    epsilon_high: float | None = None
    kl_weighting: bool = True
    accumulation: int = 2
    """Micro-batches per rank (TRL's ``gradient_accumulation_steps``)."""

    @property
    def id(self) -> str:
        return f"{self.ours}-beta{self.beta}-eps{self.epsilon_high}-w{int(self.kl_weighting)}"

    def loss_config(self) -> GRPOLossConfig:
        return GRPOLossConfig(
            group_size=4, clip_eps_low=0.2, clip_eps_high=self.epsilon_high, kl_coef=self.beta,
            kl_importance_weighting=self.kl_weighting, aggregation=self.ours,  # type: ignore[arg-type]
        )  # fmt: skip


CASES = [
    Case("dapo", "dapo"),
    Case("dapo", "dapo", 0.1, 0.28),
    Case("token", "dapo", 0.1, None, False),  # one update per step: dapo's normalisation
    Case("grpo", "grpo", 0.1, 0.28),
    Case("sequence", "grpo"),
    Case("dr_grpo", "dr_grpo", 0.1),
    Case("dr_grpo", "dr_grpo", 0.0, 0.28),
    Case("bnpo", "bnpo", 0.1, 0.28, accumulation=1),
    Case("bnpo", "bnpo", accumulation=1),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("tiny-llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def _tokenizer() -> Any:
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="t0", eos_token="t1"
    )


def trl_trainer(
    model_dir: Path, tmp_path: Path, rewards: list[float], float64: bool = True, **args: Any
) -> Any:
    config = trl.GRPOConfig(
        output_dir=str(tmp_path / "trl"), bf16=False, use_cpu=True, report_to=[],
        per_device_train_batch_size=BATCH, num_generations=4, max_completion_length=MAX_COMPLETION,
        **args,
    )  # fmt: skip
    trainer = trl.GRPOTrainer(
        model=str(model_dir),
        reward_funcs=[lambda completions, **_: rewards[: len(completions)]],
        args=config,
        train_dataset=datasets.Dataset.from_dict({"prompt": ["t2 t3 t4"] * BATCH}),
        processing_class=_tokenizer(),
    )
    trainer.model.double()
    if float64:

        def logps_and_entropies(model: Any, input_ids: Any, _: Any, keep: int, **__: Any) -> Any:
            logps = policy_logps(model, input_ids[:, :-keep], input_ids[:, -keep:])
            return logps, torch.zeros_like(logps), None

        trainer._get_per_token_logps_and_entropies = logps_and_entropies
    return trainer


class _Ranks:
    """TRL's accelerator as seen from one of ``num_processes`` ranks (its collectives are the
    identity in one process; TRL's dapo reads the rank count)."""

    def __init__(self, accelerator: Any, num_processes: int) -> None:
        self._accelerator, self.num_processes = accelerator, num_processes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._accelerator, name)


def inputs(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(2, VOCAB, (BATCH, PROMPT), generator=g)
    completion_ids = torch.randint(2, VOCAB, (BATCH, COMPLETION), generator=g)
    lengths = torch.tensor([6, 4, 1, 3, 2, 6, 5, 1])  # uneven over ranks and micro-batches
    completion_mask = (torch.arange(COMPLETION) < lengths[:, None]).long()
    with torch.no_grad():
        current = policy_logps(model, prompt_ids, completion_ids)
    # Old and reference log-probs away from the current ones, so that ratios are clipped on
    # both sides and the KL is not 0.
    old = current + 0.4 * torch.randn(current.shape, generator=g, dtype=current.dtype)
    ref = current + 0.5 * torch.randn(current.shape, generator=g, dtype=current.dtype)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor([1.2, -0.7, 0.3, -1.5, 0.9, -0.2, 1.1, -0.4]).double(),
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": completion_mask.sum(),
    }


def policy_logps(
    model: Any, prompt_ids: torch.Tensor, completion_ids: torch.Tensor, float64: bool = True
) -> Any:
    ids = torch.cat((prompt_ids, completion_ids), dim=1)
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    logits = logits[:, prompt_ids.shape[1] - 1 : -1]
    if not float64:  # as the GRPO train module computes them
        return log_probs_of_labels(logits, completion_ids)
    return torch.log_softmax(logits, -1).gather(-1, completion_ids[..., None]).squeeze(-1)


def _rows(batch: dict[str, Any], rows: slice) -> dict[str, Any]:
    return {k: v if k == "num_items_in_batch" else v[rows] for k, v in batch.items()}


def trl_reference(trainer: Any, case: Case, world: int) -> tuple[Any, list[Any], dict[str, Any]]:
    """TRL's loss and gradients of one optimizer step over the whole batch, run on ``world``
    ranks with ``case.accumulation`` micro-batches each, and its metrics of a one-micro-batch
    step over the whole batch."""
    model = trainer.model
    batch = inputs(model)
    model.train()
    trainer.current_gradient_accumulation_steps = case.accumulation
    trainer.args.steps_per_generation = case.accumulation
    trainer.accelerator = _Ranks(trainer.accelerator, world)
    micro = BATCH // (world * case.accumulation)
    total = torch.zeros((), dtype=torch.float64)
    for start in range(0, BATCH, micro):
        loss = trainer._compute_loss(model, _rows(batch, slice(start, start + micro)))
        (loss / world).backward()  # DDP averages over ranks; accumulation sums
        total += loss.detach() / world
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    trainer.accelerator = trainer.accelerator._accelerator
    model.eval()  # one micro-batch of everything, for the metrics
    trainer._metrics["eval"].clear()
    trainer._compute_loss(model, batch)
    metrics = {k: v[-1] for k, v in trainer._metrics["eval"].items()}
    return total, grads, metrics


def ours(model: Any, batch: dict[str, Any], case: Case, rows: slice, group: Any = None) -> Any:
    """Our loss of this rank's ``rows`` (backward done: the world size times the gradient, as
    the train module does for data-parallel averaging), in ``case.accumulation`` micro-batches."""
    config = case.loss_config()
    denominator = update_denominators(
        [batch["completion_mask"][rows]], config, max_completion_length=MAX_COMPLETION,
        process_group=group,
    )[0]  # fmt: skip
    world = 1 if group is None else dist.get_world_size(group)
    total = torch.zeros((), dtype=torch.float64)
    n = rows.stop - rows.start
    micro = n // case.accumulation
    for start in range(rows.start, rows.stop, micro):
        part = _rows(batch, slice(start, start + micro))
        logps = policy_logps(model, part["prompt_ids"], part["completion_ids"])
        loss, _ = grpo_loss(
            logps, part["old_per_token_logps"], part["advantages"], part["completion_mask"],
            config, ref_logps=part["ref_per_token_logps"], denominator=denominator,
        )  # fmt: skip
        (loss * world).backward()
        total += loss.detach()
    return total


def _close(a: Any, b: Any, msg: str = "") -> None:
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14, msg=msg)


@pytest.mark.timeout(600)
def test_one_rank_loss_gradients_and_metrics_equal_trl(model_dir: Path, tmp_path: Path) -> None:
    for case in CASES:
        trainer = trl_trainer(
            model_dir, tmp_path / case.id, [0.0] * BATCH, loss_type=case.trl, beta=case.beta,
            epsilon=0.2, epsilon_high=case.epsilon_high, use_bias_correction_kl=case.kl_weighting,
        )  # fmt: skip
        trl_loss, trl_grads, metrics = trl_reference(trainer, case, world=1)
        model = trainer.model
        batch = inputs(model)
        loss = ours(model, batch, case, slice(0, BATCH))
        _close(loss, trl_loss, case.id)
        for p, theirs in zip(model.parameters(), trl_grads, strict=True):
            _close(p.grad, theirs, case.id)
        model.zero_grad(set_to_none=True)
        # The clip metrics of the whole batch as one micro-batch.
        logps = policy_logps(model, batch["prompt_ids"], batch["completion_ids"])
        _, stats = grpo_loss(
            logps, batch["old_per_token_logps"], batch["advantages"], batch["completion_mask"],
            case.loss_config(), ref_logps=batch["ref_per_token_logps"],
            max_completion_length=MAX_COMPLETION,
        )  # fmt: skip
        assert 0 < metrics["clip_ratio/region_mean"] < 1
        for ours_value, name in (
            (stats.clip_fraction, "region_mean"), (stats.clip_low_fraction, "low_mean"),
            (stats.clip_high_fraction, "high_mean"), (stats.clip_low_min, "low_min"),
            (stats.clip_high_max, "high_max"),
        ):  # fmt: skip
            # TRL reduces its metrics in float32.
            assert float(ours_value) == pytest.approx(metrics[f"clip_ratio/{name}"], abs=1e-7)
        if case.beta:
            assert float(stats.kl) == pytest.approx(metrics["kl"], rel=1e-6)


@pytest.mark.timeout(300)
def test_our_log_probs_equal_trls_own_head_in_float32(model_dir: Path, tmp_path: Path) -> None:
    trainer = trl_trainer(model_dir, tmp_path, [0.0] * BATCH, float64=False, loss_type="dapo")
    model = trainer.model.float()
    batch = inputs(model)
    theirs = trainer._compute_loss(model, batch)
    logps = policy_logps(model, batch["prompt_ids"], batch["completion_ids"], float64=False)
    mine, _ = grpo_loss(
        logps, batch["old_per_token_logps"], batch["advantages"], batch["completion_mask"],
        Case("dapo", "dapo").loss_config(), ref_logps=batch["ref_per_token_logps"],
    )  # fmt: skip
    torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7, check_dtype=False)


@pytest.mark.timeout(300)
def test_dapo_divides_each_update_by_the_generated_batch_share(
    model_dir: Path, tmp_path: Path
) -> None:
    """Two updates per generated batch (TRL: ``steps_per_generation`` twice the accumulation):
    each update's loss is divided by half the tokens of the whole batch, not by its own."""
    trainer = trl_trainer(model_dir, tmp_path, [0.0] * BATCH, loss_type="dapo")
    model = trainer.model
    batch = inputs(model)
    model.train()
    trainer.current_gradient_accumulation_steps = 1
    trainer.args.steps_per_generation = 2
    halves = [slice(0, BATCH // 2), slice(BATCH // 2, BATCH)]
    config = Case("dapo", "dapo").loss_config()
    denominators = update_denominators(
        [batch["completion_mask"][h] for h in halves], config
    )  # fmt: skip
    assert denominators.tolist() == [batch["completion_mask"].sum() / 2] * 2
    for half, denominator in zip(halves, denominators):
        part = _rows(batch, half)
        theirs = trainer._compute_loss(model, part)
        logps = policy_logps(model, part["prompt_ids"], part["completion_ids"])
        mine, _ = grpo_loss(
            logps, part["old_per_token_logps"], part["advantages"], part["completion_mask"],
            config, ref_logps=part["ref_per_token_logps"], denominator=denominator,
        )  # fmt: skip
        _close(mine, theirs)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_equal_trl(model_dir: Path, tmp_path: Path, scale: str) -> None:
    """TRL samples and scores completions of 2 prompts x 4; its advantages from our rewards."""
    trainer = trl_trainer(model_dir, tmp_path, REWARDS, scale_rewards=scale)
    prompts = [{"prompt": "t2 t3"}] * 4 + [{"prompt": "t5 t6 t7"}] * 4
    out = trainer._generate_and_score_completions(prompts)
    mine, _ = group_advantages(torch.tensor(REWARDS, dtype=torch.float64), 4, scale=scale)  # type: ignore[arg-type]
    # TRL holds rewards in float32: compared at float32's precision.
    torch.testing.assert_close(mine.float(), out["advantages"], rtol=1e-6, atol=1e-7)


def _two_ranks(model: Any, expected: dict[str, tuple[Any, list[Any]]]) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    # Each rank's groups, scaled by the std of every rank's rewards: the whole batch's.
    rewards = torch.tensor(REWARDS, dtype=torch.float64)
    for scale in ("group", "batch", "none"):
        whole, _ = group_advantages(rewards, 4, scale=scale)  # type: ignore[arg-type]
        mine, _ = group_advantages(rewards[rows], 4, scale=scale, process_group=dist.group.WORLD)  # type: ignore[arg-type]
        _close(mine, whole[rows], scale)
    batch = inputs(model)
    for case in CASES:
        trl_loss, trl_grads = expected[case.id]
        model.zero_grad(set_to_none=True)
        loss = ours(model, batch, case, rows, group=dist.group.WORLD)
        dist.all_reduce(loss)  # the update's loss: the parts of every rank add up to it
        _close(loss, trl_loss, case.id)
        for p, theirs in zip(model.parameters(), trl_grads, strict=True):
            dist.all_reduce(p.grad)  # as DDP does: the mean over ranks
            _close(p.grad / world, theirs, case.id)
        if case.ours == "dapo":
            # The global-token normalisation: 2 ranks x 2 micro-batches give the one-process
            # loss and gradient of the whole batch.
            single = dataclasses.replace(case, accumulation=1)
            model.zero_grad(set_to_none=True)
            whole = ours(model, batch, single, slice(0, BATCH))
            _close(loss, whole, case.id)
            for p, theirs in zip(model.parameters(), trl_grads, strict=True):
                _close(p.grad, theirs, case.id)


@pytest.mark.timeout(600)
def test_two_ranks_equal_trl_on_two_ranks(model_dir: Path, tmp_path: Path) -> None:
    expected, model = {}, None
    for case in CASES:
        trainer = trl_trainer(
            model_dir, tmp_path / case.id, [0.0] * BATCH, loss_type=case.trl, beta=case.beta,
            epsilon=0.2, epsilon_high=case.epsilon_high, use_bias_correction_kl=case.kl_weighting,
        )  # fmt: skip
        loss, grads, _ = trl_reference(trainer, case, world=2)
        expected[case.id] = (loss, grads)
        model = trainer.model
    # Every trainer loads the same saved model: the last serves every case. Ranks from the
    # fork server (as if spawned), not forked from here: the TRL trainers above have started
    # threads, and a forked child of a threaded process can hang on a lock one of them held.
    run_distributed_test(_two_ranks, 2, args=(model, expected), timeout=300)
