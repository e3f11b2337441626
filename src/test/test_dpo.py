"""Preference data and the DPO train module: one forward per pair, resume, ranks, bad inputs."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import preloaded_python
import pytest
import torch
from testutils import patient, run_distributed_test
from torch.distributed.tensor import DTensor

from olmolike.data.preference import (
    PreferenceDataLoader,
    PreferencePair,
    encode_preference_pairs,
    read_preference_jsonl,
)
from olmolike.data.tokenizer import ByteTokenizer
from olmolike.distributed.parallel import DataParallelConfig, DataParallelType
from olmolike.distributed.utils import broadcast_object, get_world_size
from olmolike.exceptions import CheckpointError, ConfigurationError, DataError
from olmolike.nn import TransformerConfig
from olmolike.nn.functional import DPOLossType, dpo_loss, sequence_log_probs
from olmolike.optim import AdamWConfig
from olmolike.train import Callback, Duration, Trainer, TrainerConfig
from olmolike.train.callbacks import StabilityMonitorCallback
from olmolike.train.train_module.dpo import DPOTrainModuleConfig

SEQ = 24
PAIRS_PER_STEP = 4
STEPS = 5
TOK = ByteTokenizer()


def _pairs(n: int = 32) -> list[PreferencePair]:
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma"]
    return [
        PreferencePair(
            prompt=f"Q{i}: ", chosen=words[i % 6] * 2, rejected=words[(i + 1) % 6], where=f"x:{i}"
        )
        for i in range(n)
    ]


def test_encoding_masks_everything_but_the_response() -> None:
    rows = encode_preference_pairs([PreferencePair("ab", "cd", "e", "x:1")], TOK, seq_len=8)
    c_ids, c_labels, r_ids, r_labels = rows[0].chunk(4)
    a, b, c, d = (TOK.encode(ch)[0] for ch in "abcd")
    eos = TOK.eos_token_id
    assert c_ids[:4].tolist() == [a, b, c, d]
    # Position 0 predicts "b" (prompt): ignored; position 1 predicts "c": trained.
    assert c_labels[:5].tolist() == [-100, TOK.encode("c")[0], d, eos, -100]
    assert r_labels[:4].tolist() == [-100, TOK.encode("e")[0], eos, -100]
    assert (r_ids[4:] == TOK.pad_token_id).all()


def test_jsonl_strings_and_chat_messages(tmp_path: Path) -> None:
    path = tmp_path / "prefs.jsonl"
    records = [
        {"prompt": "hi", "chosen": "yes", "rejected": "no"},
        {
            "prompt": [{"role": "user", "content": "hi"}],
            "chosen": [{"role": "assistant", "content": "good"}],
            "rejected": [{"role": "assistant", "content": "bad"}],
        },
    ]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    pairs = read_preference_jsonl(path)
    assert [(p.chosen, p.rejected) for p in pairs] == [
        ("yes", "no"),
        ([{"role": "assistant", "content": "good"}], [{"role": "assistant", "content": "bad"}]),
    ]
    assert not pairs[0].is_chat and pairs[1].is_chat and pairs[1].where.endswith(", line 2")


def test_bad_pairs_name_the_record(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"x:7: 'chosen' and 'rejected' are identical"):
        encode_preference_pairs([PreferencePair("p", "same", "same", "x:7")], TOK, 8)
    with pytest.raises(DataError, match=r"x:3: the prompt has 9 tokens.*raise seq_len"):
        encode_preference_pairs([PreferencePair("p" * 9, "a", "b", "x:3")], TOK, 8)
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "chosen": "b"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl, line 1: .*'rejected'"):
        read_preference_jsonl(path)


@dataclass
class Log(Callback):
    metrics: dict[int, dict[str, float]] = field(default_factory=dict)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.metrics[step] = dict(metrics)


def model_config() -> TransformerConfig:
    return TransformerConfig(
        vocab_size=TOK.vocab_size, d_model=32, n_layers=2, n_heads=2, max_sequence_length=SEQ
    )


def build(
    folder: str | Path, *, dp: str | None = None, micro_pairs: int | None = None,
    reference_seed: int | None = None, precompute: bool = False, **trainer_kwargs: Any,
) -> tuple[Trainer, Log]:  # fmt: skip
    rank_pairs = PAIRS_PER_STEP // get_world_size()
    config = DPOTrainModuleConfig(
        rank_microbatch_size=(micro_pairs or rank_pairs) * SEQ,
        optim=AdamWConfig(lr=3e-3),
        max_grad_norm=1.0,
        beta=0.5,
        dp_config=DataParallelConfig(name=DataParallelType(dp)) if dp else None,
        precompute_reference_logps=precompute,
    )
    reference = None
    if reference_seed is not None:
        reference = model_config().build(seed=reference_seed)
    module = config.build(model_config().build(seed=0), reference=reference)
    loader = PreferenceDataLoader(
        encode_preference_pairs(_pairs(), TOK, SEQ),
        global_batch_size=PAIRS_PER_STEP * 4 * SEQ,
        seed=0,
    )
    log = Log()
    trainer_kwargs.setdefault("max_duration", Duration.steps(STEPS))
    trainer = TrainerConfig(
        save_folder=str(folder), metrics_collect_interval=1, device="cpu",
        **{"callbacks": {"log": log}, **trainer_kwargs},
    ).build(module, loader)  # fmt: skip
    return trainer, log


def losses(log: Log) -> list[float]:
    return [log.metrics[s]["train/DPO loss"] for s in sorted(log.metrics)]


def test_first_step_is_log2_and_metrics_are_consistent(tmp_path: Path) -> None:
    trainer, log = build(tmp_path, no_checkpoints=True)
    trainer.fit()
    first = log.metrics[1]
    # The reference is the initial policy: every margin is 0 at step 1.
    assert first["train/DPO loss"] == pytest.approx(0.6931472, abs=1e-6)
    assert first["train/rewards/margin"] == pytest.approx(0.0, abs=1e-6)
    last = log.metrics[STEPS]
    assert last["train/DPO loss"] < first["train/DPO loss"]
    assert last["train/rewards/margin"] == pytest.approx(
        last["train/rewards/chosen"] - last["train/rewards/rejected"], abs=1e-5
    )
    assert 0.0 <= last["train/rewards/accuracy"] <= 1.0


def test_the_loss_is_named_for_what_it_is_and_watched_by_default(tmp_path: Path) -> None:
    """The DPO loss is logged as ``train/DPO loss`` only (no ``train/CE loss`` holding it),
    and a stability monitor left at its default watches it."""
    monitor = StabilityMonitorCallback(window=5, warmup_steps=2)
    log = Log()
    trainer, _ = build(tmp_path, no_checkpoints=True, callbacks={"log": log, "mon": monitor})
    trainer.fit()
    assert trainer.train_module.loss_metric == "train/DPO loss"
    assert all("train/CE loss" not in m and "train/DPO loss" in m for m in log.metrics.values())
    assert monitor._loss_stats.count == STEPS  # it judged every step's DPO loss


def test_one_forward_matches_the_loss_function() -> None:
    """The module's step equals dpo_loss on separately computed log-probs (same gradients)."""
    trainer, _ = build(tempfile.mkdtemp(), no_checkpoints=True, reference_seed=5)
    module = trainer.train_module
    trainer.data_loader.reshuffle(1)
    batch = next(iter(trainer.data_loader))
    module.train_batch(batch, dry_run=True)
    got = [p.grad.clone() for p in module.model.parameters()]
    module.zero_grads()
    ids, labels = batch["input_ids"], batch["labels"]
    pol, _ = sequence_log_probs(module.model(ids), labels)
    ref, _ = module.reference.sequence_log_probs(ids, labels)
    out = dpo_loss(*pol.chunk(2), *ref.chunk(2), beta=0.5, loss_type=DPOLossType.sigmoid)
    out.loss.backward()
    for g, p in zip(got, module.model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-7)


def test_micro_batches_match_one(tmp_path: Path) -> None:
    one, one_log = build(tmp_path / "a", no_checkpoints=True)
    one.fit()
    split, split_log = build(tmp_path / "b", micro_pairs=1, no_checkpoints=True)
    split.fit()
    torch.testing.assert_close(torch.tensor(losses(split_log)), torch.tensor(losses(one_log)))


def test_resume_is_exact_and_checks_the_reference(tmp_path: Path) -> None:
    full, full_log = build(tmp_path / "full")
    full.fit()
    first, _ = build(tmp_path / "resumed", hard_stop=Duration.steps(2))
    first.fit()
    second, second_log = build(tmp_path / "resumed")
    second.fit()
    assert losses(second_log) == losses(full_log)[2:]
    for a, b in zip(full.train_module.model.parameters(), second.train_module.model.parameters()):
        assert torch.equal(a, b)
    other, _ = build(tmp_path / "resumed", reference_seed=9, max_duration=Duration.steps(STEPS + 1))
    with pytest.raises(CheckpointError, match="fingerprint"):
        other.fit()


def test_precomputed_reference_logps_give_the_same_losses_with_one_forward_less(
    tmp_path: Path,
) -> None:
    plain, plain_log = build(tmp_path / "plain", no_checkpoints=True, reference_seed=5)
    plain.fit()
    cached, cached_log = build(tmp_path / "cached", precompute=True, reference_seed=5)
    forwards = []
    reference = cached.train_module.reference.model
    reference.register_forward_hook(lambda *_: forwards.append(cached.global_step))
    cached.fit()
    # All reference forwards ran in step 1 (32 pairs, 4 per forward), none in later steps.
    assert forwards == [1] * 8
    assert len(list(cached.work_dir.glob("dpo-reference-logps-*.pt"))) == 1
    for name in ("train/DPO loss", "train/rewards/chosen", "train/rewards/margin"):
        got = [cached_log.metrics[s][name] for s in sorted(cached_log.metrics)]
        want = [plain_log.metrics[s][name] for s in sorted(plain_log.metrics)]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-6, atol=1e-7)
    # A resumed run reads the cache back instead of scoring the pairs again.
    resumed, resumed_log = build(
        tmp_path / "cached", precompute=True, reference_seed=5, max_duration=Duration.steps(6)
    )
    resumed.train_module.reference.model.register_forward_hook(
        lambda *_: pytest.fail("the reference ran")
    )
    resumed.fit()
    assert list(resumed_log.metrics) == [6]


def test_precomputed_logps_need_a_preference_loader(tmp_path: Path) -> None:
    from olmolike.data import TokenTensorDataLoader

    config = DPOTrainModuleConfig(rank_microbatch_size=SEQ, precompute_reference_logps=True)
    loader = TokenTensorDataLoader(
        encode_preference_pairs(_pairs(), TOK, SEQ), global_batch_size=PAIRS_PER_STEP * 4 * SEQ
    )
    trainer = TrainerConfig(save_folder=str(tmp_path), max_duration=Duration.steps(1), device="cpu")
    with pytest.raises(ConfigurationError, match="needs a PreferenceDataLoader"):
        trainer.build(config.build(model_config().build(seed=0)), loader)


def test_reference_of_another_shape_is_refused() -> None:
    config = DPOTrainModuleConfig(rank_microbatch_size=SEQ)
    small = TransformerConfig(vocab_size=TOK.vocab_size, d_model=16, n_layers=2, n_heads=2)
    with pytest.raises(ConfigurationError, match="d_model: policy 32 vs reference 16"):
        config.build(model_config().build(seed=0), reference=small.build(seed=0))


def _full_state(trainer: Trainer) -> list[torch.Tensor]:
    return [
        (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for p in trainer.train_module.model.parameters()
    ]


def _two_rank_resume(dp: str, precompute: bool) -> tuple[list[float], list[float], bool]:
    """Losses of a full run and of one stopped after step 2 and resumed; equal weights?"""
    root = Path(broadcast_object(tempfile.mkdtemp()))
    full, full_log = build(root / "full", dp=dp, precompute=precompute)
    full.fit()
    build(root / "resumed", dp=dp, precompute=precompute, hard_stop=Duration.steps(2))[0].fit()
    second, second_log = build(root / "resumed", dp=dp, precompute=precompute)
    second.fit()
    same = all(torch.equal(a, b) for a, b in zip(_full_state(full), _full_state(second)))
    return losses(full_log), losses(second_log), same


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("dp", "precompute"), [("ddp", False), ("fsdp", True)])
def test_two_ranks_match_one_and_resume_exactly(tmp_path: Path, dp: str, precompute: bool) -> None:
    one, one_log = build(tmp_path, no_checkpoints=True)
    one.fit()
    results = run_distributed_test(_two_rank_resume, 2, args=(dp, precompute), timeout=280)
    for full, resumed, same_weights in results:
        assert resumed == full[2:] and len(resumed) == STEPS - 2
        assert same_weights
        # Two ranks compute what one does (with precompute: the log-probs the ranks scored and
        # gathered are the uncached ones).
        torch.testing.assert_close(
            torch.tensor(full), torch.tensor(losses(one_log)), rtol=1e-5, atol=1e-6
        )


@pytest.mark.timeout(300)
def test_dpo_example_runs_and_reports_accuracy(tmp_path: Path) -> None:
    """One process (test_example_post_training.py runs it under torchrun)."""
    import os
    import subprocess

    script = Path(__file__).parents[1] / "examples" / "dpo" / "train.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [*preloaded_python.command(), str(script), "--trainer.max_duration.value=3", "--pretrain_steps=1"],
        capture_output=True, text=True, timeout=patient(280), env=env, check=True, cwd=tmp_path,
    )  # fmt: skip
    assert "held-out preference accuracy" in out.stdout
    assert "before DPO 0.500" in out.stdout
