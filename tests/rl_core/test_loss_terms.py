import math

import pytest
import torch

from rl_core.losses import (
    LossCoefficients,
    compose_total_loss,
    compute_kl_loss,
    compute_sft_loss,
    compute_value_loss,
    entropy_from_logits,
)


def test_value_loss_clipped_by_hand():
    values = torch.tensor([[1.0, 2.0]], requires_grad=True)
    old, returns = torch.tensor([[0.5, 0.5]]), torch.tensor([[1.2, 0.0]])
    mask = torch.ones(1, 2)
    loss, metrics = compute_value_loss(values, old, returns, mask, value_clip=0.2)
    # token 0: max((1-1.2)^2, (0.7-1.2)^2) = 0.25; token 1: max(4, 0.49) = 4; 0.5 * mean = 1.0625
    assert loss.item() == pytest.approx(1.0625)
    assert float(metrics["vf_clipfrac"]) == 0.5
    loss.backward()
    # clipped branch on token 0 has no gradient; token 1: 0.5 * 2 (V - R) / 2 tokens = 1.0
    assert values.grad.flatten().tolist() == pytest.approx([0.0, 1.0])


def test_value_loss_without_clip():
    loss, _ = compute_value_loss(torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.tensor([[3.0]]),
                                 torch.ones(1, 1), value_clip=None)  # fmt: skip
    assert loss.item() == pytest.approx(0.5 * 4.0)


def test_entropy_uniform_and_peaked():
    assert entropy_from_logits(torch.zeros(1, 1, 4)).item() == pytest.approx(math.log(4))
    peaked = entropy_from_logits(torch.tensor([[[1000.0, 0.0, 0.0]]]))
    assert peaked.item() == pytest.approx(0.0, abs=1e-6)


def test_entropy_matches_definition_and_bf16_runs_in_fp32():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 7, generator=g)
    p = torch.softmax(logits, -1)
    expected = -(p * torch.log(p)).sum(-1)
    assert torch.allclose(entropy_from_logits(logits), expected, atol=1e-6)
    out = entropy_from_logits(logits.to(torch.bfloat16))
    assert out.dtype == torch.float32
    assert torch.allclose(out, expected, atol=2e-2)


def test_sft_and_kl_loss():
    logp = torch.tensor([[math.log(0.5), math.log(0.25)]])
    mask = torch.tensor([[1, 0]])
    assert compute_sft_loss(logp, mask).item() == pytest.approx(math.log(2))
    kl = compute_kl_loss(logp, torch.tensor([[math.log(0.25), 0.0]]), mask, kl_loss_type="kl")
    assert kl.item() == pytest.approx(math.log(2))


def test_total_loss_composition():
    coefs = LossCoefficients(rl_loss_coef=1.0, kl_loss_coef=0.1, entropy_loss_coef=0.01, sft_loss_coef=0.5)
    total = compose_total_loss(coefs, pg_loss=torch.tensor(2.0), kl_loss=torch.tensor(1.0),
                               entropy=torch.tensor(3.0), sft_loss=torch.tensor(4.0))  # fmt: skip
    assert total.item() == pytest.approx(2.0 + 0.1 - 0.03 + 2.0)
    # ROLL's order: rl_loss_coef scales the policy-gradient loss with its KL term, not the entropy or SFT terms
    coefs = LossCoefficients(rl_loss_coef=0.5, kl_loss_coef=0.1, entropy_loss_coef=0.01, sft_loss_coef=0.5)
    total = compose_total_loss(coefs, pg_loss=torch.tensor(2.0), kl_loss=torch.tensor(1.0),
                               entropy=torch.tensor(3.0), sft_loss=torch.tensor(4.0))  # fmt: skip
    assert total.item() == pytest.approx((2.0 + 0.1) * 0.5 - 0.03 + 2.0)


def test_total_loss_refuses_missing_term():
    with pytest.raises(ValueError, match="kl_loss_coef"):
        compose_total_loss(LossCoefficients(kl_loss_coef=0.1), pg_loss=torch.tensor(1.0))
    # a zero coefficient needs no term
    assert compose_total_loss(LossCoefficients(), pg_loss=torch.tensor(1.0)).item() == 1.0
