import math

import pytest
import torch

from rl_core.kl import KL_ESTIMATORS, full_kl_from_logits, kl_penalty

LOGP = torch.tensor([[math.log(0.5)]], dtype=torch.float64)
REF = torch.tensor([[math.log(0.25)]], dtype=torch.float64)
LN2 = math.log(2.0)

EXPECTED = {
    "kl": LN2,
    "k1": LN2,
    "abs": LN2,
    "mse": 0.5 * LN2**2,
    "k2": 0.5 * LN2**2,
    "low_var_kl": 0.5 - 1.0 + LN2,  # q/p - 1 - log(q/p), q/p = 0.5
    "k3": 0.5 - 1.0 + LN2,
}


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_hand_computed(kind):
    assert kl_penalty(LOGP, REF, kind).item() == pytest.approx(EXPECTED[kind], abs=1e-12)


def test_abs_of_negative_gap():
    assert kl_penalty(REF, LOGP, "abs").item() == pytest.approx(LN2)
    assert kl_penalty(REF, LOGP, "kl").item() == pytest.approx(-LN2)


def test_k3_is_clamped_for_huge_gaps():
    out = kl_penalty(torch.tensor([[-100.0]]), torch.tensor([[0.0]]), "low_var_kl")
    assert out.item() == 10.0


def test_full_kl_matches_definition():
    g = torch.Generator().manual_seed(0)
    logits, ref_logits = torch.randn(2, 3, 5, generator=g), torch.randn(2, 3, 5, generator=g)
    p, q = torch.softmax(logits, -1), torch.softmax(ref_logits, -1)
    expected = torch.zeros(2, 3)
    for b in range(2):
        for t in range(3):
            expected[b, t] = sum(p[b, t, v] * math.log(p[b, t, v] / q[b, t, v]) for v in range(5))
    assert torch.allclose(full_kl_from_logits(logits, ref_logits), expected, atol=1e-6)
    via_registry = kl_penalty(torch.log_softmax(logits, -1), torch.log_softmax(ref_logits, -1), "full")
    assert torch.allclose(via_registry, expected, atol=1e-6)


def test_full_needs_vocab_dimension():
    with pytest.raises(ValueError, match="full-vocabulary"):
        kl_penalty(LOGP, REF, "full")


def test_unknown_kind_lists_valid_names():
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(LOGP, REF, "k4")


def test_registry_names():
    assert set(KL_ESTIMATORS.names()) == {"kl", "abs", "mse", "low_var_kl", "full"}
