"""DPO losses and the exact per-token KL of two-stage training."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from olmolike.nn.functional import (
    DPOLossType,
    cross_entropy_loss,
    dpo_loss,
    sequence_log_probs,
    token_kl_divergence,
)


def _logits(seed: int, shape: tuple[int, ...] = (2, 3, 5)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_kl_matches_direct_formula_and_masks() -> None:
    p, q = _logits(0), _logits(1)
    labels = torch.tensor([[1, -100, 2], [0, 4, -100]])
    kl = token_kl_divergence(p, q, labels)
    lp, lq = p.log_softmax(-1), q.log_softmax(-1)
    per_token = (lp.exp() * (lp - lq)).sum(-1)
    mask = labels != -100
    assert torch.allclose(kl, per_token[mask].mean().float())
    assert float(token_kl_divergence(p, p, labels)) == pytest.approx(0.0, abs=1e-7)
    assert float(kl) > 0


def test_kl_gradient_matches_finite_differences() -> None:
    p = _logits(2, (1, 2, 4)).requires_grad_(True)
    q = _logits(3, (1, 2, 4))
    labels = torch.tensor([[1, 3]])

    def kl64(x: torch.Tensor) -> torch.Tensor:
        lp, lq = x.log_softmax(-1), q.log_softmax(-1)
        return (lp.exp() * (lp - lq)).sum(-1).mean()

    (grad,) = torch.autograd.grad(token_kl_divergence(p, q, labels), p)
    eps = 1e-6
    numeric = torch.zeros_like(p)
    for idx in torch.cartesian_prod(*(torch.arange(n) for n in p.shape)):
        i = tuple(idx.tolist())
        plus, minus = p.detach().clone(), p.detach().clone()
        plus[i] += eps
        minus[i] -= eps
        numeric[i] = (kl64(plus) - kl64(minus)) / (2 * eps)
    assert torch.allclose(grad.double(), numeric, atol=1e-5)
    # The reference is frozen: no gradient reaches it.
    q2 = q.clone().requires_grad_(True)
    token_kl_divergence(p, q2, labels).backward()
    assert q2.grad is None


def test_seed_approximation_is_a_rescaled_cross_entropy_and_differs_from_exact_kl() -> None:
    """``nll_policy - stopgrad(nll_reference)`` has gradient (1 + beta) * CE-grad; ours does not."""
    beta = 0.5
    p = _logits(4).requires_grad_(True)
    q = _logits(5)
    labels = torch.tensor([[1, 2, 3], [0, 4, 2]])
    (ce_grad,) = torch.autograd.grad(cross_entropy_loss(p, labels)[0], p)
    nll_ref, _ = cross_entropy_loss(q, labels)
    seed_total = cross_entropy_loss(p, labels)[0] + beta * (
        cross_entropy_loss(p, labels)[0] - nll_ref.detach()
    )
    (seed_grad,) = torch.autograd.grad(seed_total, p)
    assert torch.allclose(seed_grad, (1 + beta) * ce_grad, atol=1e-6)
    exact_total = cross_entropy_loss(p, labels)[0] + beta * token_kl_divergence(p, q, labels)
    (exact_grad,) = torch.autograd.grad(exact_total, p)
    assert not torch.allclose(exact_grad, seed_grad, atol=1e-3)
    # The exact KL term's gradient is not parallel to the CE gradient either.
    (kl_grad,) = torch.autograd.grad(token_kl_divergence(p, q, labels), p)
    cos = F.cosine_similarity(kl_grad.flatten(), ce_grad.flatten(), dim=0)
    assert abs(float(cos)) < 0.99


def test_sequence_log_probs_sums_trained_tokens() -> None:
    logits = _logits(6)
    labels = torch.tensor([[1, -100, 2], [-100, -100, 4]])
    total, count = sequence_log_probs(logits, labels)
    lp = logits.float().log_softmax(-1)
    assert torch.allclose(total, torch.stack([lp[0, 0, 1] + lp[0, 2, 2], lp[1, 2, 4]]))
    assert count.tolist() == [2.0, 1.0]


def _pairs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(7)
    return tuple(torch.randn(4, generator=g) * 3 for _ in range(4))


@pytest.mark.parametrize("loss_type", list(DPOLossType))
def test_dpo_loss_formulas(loss_type: DPOLossType) -> None:
    pc, pr, rc, rr = _pairs()
    lc, lr = torch.tensor([3.0, 5.0, 1.0, 2.0]), torch.tensor([2.0, 4.0, 6.0, 1.0])
    beta, e = 0.2, 0.2 if loss_type.smooths_labels else 0.0
    out = dpo_loss(
        pc, pr, rc, rr, beta=beta, loss_type=loss_type, label_smoothing=e,
        chosen_lengths=lc, rejected_lengths=lr,
    )  # fmt: skip
    h = (pc - pr) - (rc - rr)
    h_avg = (pc - rc) / lc - (pr - rr) / lr
    expected = {
        DPOLossType.sigmoid: -F.logsigmoid(beta * h),
        DPOLossType.cdpo: -(1 - e) * F.logsigmoid(beta * h) - e * F.logsigmoid(-beta * h),
        DPOLossType.robust: (-(1 - e) * F.logsigmoid(beta * h) + e * F.logsigmoid(-beta * h))
        / (1 - 2 * e),
        DPOLossType.length_normalized: -F.logsigmoid(beta * h_avg),
        DPOLossType.hinge: torch.relu(1 - beta * h),
        DPOLossType.ipo: (h_avg - 1 / (2 * beta)) ** 2,
    }[loss_type].mean()
    assert torch.allclose(out.loss, expected)
    # The rewards are on summed log-probs for every loss type (TRL's logged rewards).
    assert torch.allclose(out.chosen_rewards, beta * (pc - rc))
    assert torch.allclose(out.rejected_rewards, beta * (pr - rr))


def test_trls_name_for_length_normalized_dpo_is_an_alias() -> None:
    assert DPOLossType("sigmoid_norm") is DPOLossType.length_normalized
    pc, pr, rc, rr = _pairs()
    lengths = {"chosen_lengths": torch.ones(4) * 3, "rejected_lengths": torch.ones(4)}
    a = dpo_loss(pc, pr, rc, rr, beta=0.1, loss_type="sigmoid_norm", **lengths)  # type: ignore[arg-type]
    b = dpo_loss(pc, pr, rc, rr, beta=0.1, loss_type=DPOLossType.length_normalized, **lengths)
    assert torch.equal(a.loss, b.loss)


def test_conservative_dpo_without_smoothing_is_dpo() -> None:
    pc, pr, rc, rr = _pairs()
    for loss_type in (DPOLossType.cdpo, DPOLossType.robust):
        out = dpo_loss(pc, pr, rc, rr, beta=0.1, loss_type=loss_type)
        assert torch.allclose(out.loss, dpo_loss(pc, pr, rc, rr, beta=0.1).loss)


def test_dpo_loss_bad_arguments() -> None:
    pc, pr, rc, rr = _pairs()
    with pytest.raises(ValueError, match="beta must be positive"):
        dpo_loss(pc, pr, rc, rr, beta=0.0)
    with pytest.raises(ValueError, match="needs chosen_lengths"):
        dpo_loss(pc, pr, rc, rr, beta=0.1, loss_type=DPOLossType.ipo)
    for loss_type in ("sigmoid", "hinge", "ipo", "sigmoid_norm"):
        with pytest.raises(ValueError, match=r"no effect on loss_type=.*use loss_type=cdpo"):
            dpo_loss(pc, pr, rc, rr, beta=0.1, loss_type=loss_type, label_smoothing=0.1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"must be in \[0, 0.5\)"):
        dpo_loss(pc, pr, rc, rr, beta=0.1, loss_type=DPOLossType.robust, label_smoothing=0.5)
