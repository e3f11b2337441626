"""The frozen reference model shared by DPO and two-stage KL training."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from testutils import run_distributed_test

from olmolike.distributed.parallel import DataParallelConfig, DataParallelType
from olmolike.exceptions import CheckpointError, ConfigurationError
from olmolike.nn import TransformerConfig
from olmolike.nn.functional import sequence_log_probs
from olmolike.train.train_module.layout import ParallelLayout
from olmolike.train.train_module.reference import (
    ReferenceModel,
    check_same_architecture,
    model_fingerprint,
)

CPU = torch.device("cpu")


def _config(**overrides: Any) -> TransformerConfig:
    base: dict[str, Any] = dict(vocab_size=32, d_model=16, n_layers=2, n_heads=2)
    base.update(overrides)
    return TransformerConfig(**base)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32, (4, 8), generator=g)
    labels = torch.randint(0, 32, (4, 8), generator=g)
    labels[:, :3] = -100
    return ids, labels


def test_snapshot_is_frozen_independent_and_identified() -> None:
    policy = _config().build(seed=1)
    ref = ReferenceModel.snapshot_of(policy, source="policy@step 0", device=CPU)
    assert not ref.model.training
    assert all(not p.requires_grad for p in ref.model.parameters())
    assert ref.fingerprint == model_fingerprint(policy)
    ids, labels = _batch()
    before = ref.sequence_log_probs(ids, labels)
    assert torch.equal(before[0], sequence_log_probs(policy(ids), labels)[0].detach())
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.1)  # training the policy must not move the snapshot
    assert torch.equal(ref.sequence_log_probs(ids, labels)[0], before[0])
    assert ref.fingerprint != model_fingerprint(policy)
    ref.check_identity(ref.identity())
    with pytest.raises(CheckpointError, match="fingerprint"):
        ref.check_identity({"source": "other", "fingerprint": "0" * 16})


def test_reference_ignores_autocast() -> None:
    ref = ReferenceModel.snapshot_of(_config().build(seed=1), source="s", device=CPU)
    ids, labels = _batch()
    plain = ref.sequence_log_probs(ids, labels)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = ref.sequence_log_probs(ids, labels)[0]
    assert torch.equal(plain, under_autocast)


def test_reference_of_another_shape_names_the_fields() -> None:
    policy = _config().build(seed=1)
    check_same_architecture(policy, _config().build(seed=2))
    with pytest.raises(ConfigurationError, match=r"d_model: policy 16 vs reference 32") as info:
        check_same_architecture(policy, _config(d_model=32, n_layers=3).build(seed=2))
    assert "n_layers: policy 2 vs reference 3" in str(info.value)


def _sharded_reference(dp_name: str) -> tuple[str, torch.Tensor, bool]:
    torch.manual_seed(0)
    policy = _config().build(seed=1)
    dp = DataParallelConfig(name=DataParallelType(dp_name))
    layout = ParallelLayout.build(dp.degrees(2), dp, CPU)
    ref = ReferenceModel.snapshot_of(policy, source="s", device=CPU, layout=layout)
    ids, labels = _batch()
    logps, _ = ref.sequence_log_probs(ids, labels)
    frozen = all(not p.requires_grad for p in ref.model.parameters())
    return model_fingerprint(ref.model), logps, frozen


@pytest.mark.parametrize("dp_name", ["ddp", "fsdp"])
def test_reference_sharded_like_policy_on_two_ranks(dp_name: str) -> None:
    single = ReferenceModel.snapshot_of(_config().build(seed=1), source="s", device=CPU)
    ids, labels = _batch()
    expected = single.sequence_log_probs(ids, labels)[0]
    results = run_distributed_test(_sharded_reference, 2, args=(dp_name,), timeout=180)
    for fingerprint, logps, frozen in results:
        assert fingerprint == single.fingerprint
        assert torch.allclose(logps, expected, atol=1e-6)
        assert frozen
