"""Loss helpers: cross-entropy against PyTorch's, z-loss against its formula, log-probs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from olmolike.nn import cross_entropy_loss, log_probs_of_labels

VOCAB = 11


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (2, 6, V) and labels (2, 6) with three ignored positions."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 6, VOCAB, generator=generator) * 3
    labels = torch.randint(0, VOCAB, (2, 6), generator=generator)
    labels[0, 0] = labels[1, 4] = labels[1, 5] = -100
    return logits, labels


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_matches_torch_cross_entropy(reduction: str, label_smoothing: float) -> None:
    logits, labels = batch()
    ce, z = cross_entropy_loss(
        logits,
        labels,
        reduction=reduction,  # type: ignore[arg-type]
        label_smoothing=label_smoothing,
    )
    expected = F.cross_entropy(
        logits.reshape(-1, VOCAB),
        labels.reshape(-1),
        reduction=reduction,
        label_smoothing=label_smoothing,
    )
    torch.testing.assert_close(ce, expected.view_as(ce))
    assert z is None
    if reduction == "none":
        assert ce.shape == labels.shape
        assert (ce[labels == -100] == 0).all()


def test_custom_ignore_index() -> None:
    logits, labels = batch()
    labels = labels.masked_fill(labels == -100, 3)
    ce, _ = cross_entropy_loss(logits, labels, ignore_index=3)
    keep = labels != 3
    torch.testing.assert_close(ce, F.cross_entropy(logits[keep], labels[keep]))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_z_loss_is_the_squared_log_normaliser(reduction: str) -> None:
    logits, labels = batch(1)
    ce, z = cross_entropy_loss(
        logits,
        labels,
        reduction=reduction,  # type: ignore[arg-type]
        z_loss_multiplier=1e-4,
    )
    keep = labels != -100
    per_token = torch.zeros(labels.shape)
    for index in keep.nonzero():
        row = logits[tuple(index)]
        per_token[tuple(index)] = 1e-4 * torch.log(torch.exp(row).sum()) ** 2
    expected = {"sum": per_token.sum(), "mean": per_token.sum() / keep.sum(), "none": per_token}
    assert z is not None
    torch.testing.assert_close(z, expected[reduction])
    plain, _ = cross_entropy_loss(logits, labels, reduction=reduction)  # type: ignore[arg-type]
    torch.testing.assert_close(ce, plain)  # the z-loss is reported apart, never added in


def test_bf16_logits_are_computed_in_float32() -> None:
    logits, labels = batch(2)
    low = logits.to(torch.bfloat16)
    ce, z = cross_entropy_loss(low, labels, z_loss_multiplier=1.0)
    assert ce.dtype == torch.float32
    assert z is not None and z.dtype == torch.float32
    expected_ce, expected_z = cross_entropy_loss(low.float(), labels, z_loss_multiplier=1.0)
    torch.testing.assert_close(ce, expected_ce, rtol=0, atol=0)
    assert z is not None and expected_z is not None
    torch.testing.assert_close(z, expected_z, rtol=0, atol=0)


def test_all_ignored_batch_is_zero_not_nan() -> None:
    logits, labels = batch()
    ignored = torch.full_like(labels, -100)
    ce, z = cross_entropy_loss(logits, ignored, z_loss_multiplier=1e-4)
    assert ce.item() == 0.0
    assert z is not None and z.item() == 0.0
    ce, _ = cross_entropy_loss(logits, ignored, label_smoothing=0.1)
    assert ce.item() == 0.0


def test_gradients_flow_to_logits() -> None:
    logits, labels = batch()
    logits.requires_grad_(True)
    ce, z = cross_entropy_loss(logits, labels, z_loss_multiplier=1e-2)
    assert z is not None
    (ce + z).backward()
    assert logits.grad is not None
    assert (logits.grad[labels == -100] == 0).all()
    assert logits.grad[labels != -100].abs().sum() > 0


def test_shape_mismatch_and_bad_reduction_are_errors() -> None:
    logits, labels = batch()
    with pytest.raises(ValueError, match="trailing vocabulary"):
        cross_entropy_loss(logits, labels[:, :-1])
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy_loss(logits, labels, reduction="average")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="trailing vocabulary"):
        log_probs_of_labels(logits[0], labels)


def test_log_probs_of_labels() -> None:
    logits, labels = batch(3)
    logits = logits.to(torch.bfloat16)
    got = log_probs_of_labels(logits, labels)
    assert got.shape == labels.shape and got.dtype == torch.float32
    full = torch.log_softmax(logits.float(), dim=-1)
    keep = labels != -100
    expected = full[keep].gather(-1, labels[keep].unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(got[keep], expected)
    assert (got[~keep] == 0).all()
    # Summed over tokens, they are minus the summed cross-entropy.
    ce, _ = cross_entropy_loss(logits, labels, reduction="sum")
    torch.testing.assert_close(-got.sum(), ce)
