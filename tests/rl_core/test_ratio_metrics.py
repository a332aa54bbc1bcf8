"""ROLL's actor ratio metrics (rl_core.losses.ratio_metrics): hand-computed values, ROLL's formulas written out for
comparison, shares that add up over micro-batches, and the ratio levels."""

from __future__ import annotations

import math

import pytest
import torch

from rl_core.losses import GlobalBatchInfo
from rl_core.losses.ratio_metrics import ratio_metrics
from rl_core.masked import segment_mean

F64 = torch.float64


def test_hand_computed_token_ratio_metrics_with_ppo_clip() -> None:
    # ratios e^0.5 (above 1.2), 1, e^-0.5 (below 0.8) | e^0.1, padding (NaN log-probs must not leak)
    old = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    new = torch.tensor([[0.5, 0.0, -0.5], [0.1, math.nan, 0.0]], dtype=F64)
    adv = torch.tensor([[1.0, 1.0, -1.0], [2.0, 5.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    got = ratio_metrics(old, new, adv, mask, ppo_clip=(0.2, 0.2))
    r = [math.exp(0.5), 1.0, math.exp(-0.5), math.exp(0.1)]
    assert float(got["ratio_mean"]) == pytest.approx((sum(r[:3]) / 3 + r[3]) / 2)
    assert float(got["ratio_max"]) == pytest.approx(r[0]) and float(got["ratio_min"]) == pytest.approx(r[2])
    assert float(got["policykl"]) == pytest.approx((0.5 + 0.0 - 0.5 + 0.1) / 4)
    assert float(got["approxkl"]) == pytest.approx(0.5 * (0.25 + 0.25 + 0.01) / 4)
    assert float(got["ppo_ratio_high_clipfrac"]) == pytest.approx(1 / 4)
    assert float(got["ppo_ratio_low_clipfrac"]) == pytest.approx(1 / 4)
    assert float(got["ppo_ratio_clipfrac"]) == pytest.approx(2 / 4)
    # clipped surrogate smaller: e^.5 * 1 clipped to 1.2 (yes); e^-.5 * -1 clipped to .8 * -1 = -.8 < -.61 (yes)
    assert float(got["clipfrac"]) == pytest.approx(2 / 4)
    assert "clipfrac" not in ratio_metrics(old, new, adv, mask)  # no PPO clip: no clip fractions


def roll_formulas(old, new, adv, mask, low, high):
    """ROLL's RLVR ActorWorker.loss_func metrics (token ratio, token-mean loss_agg_mode), one un-split batch."""
    m = mask.to(F64)
    ratio = (new - old).exp()
    surr1, surr2 = ratio * adv, ratio.clamp(1 - low, 1 + high) * adv

    def token_mean(x):
        return float((x.to(F64) * m).sum() / m.sum())

    rows = m.sum(-1) > 0
    return {
        "ppo_ratio_high_clipfrac": token_mean(ratio > 1 + high),
        "ppo_ratio_low_clipfrac": token_mean(ratio < 1 - low),
        "ppo_ratio_clipfrac": token_mean((ratio > 1 + high).to(F64) + (ratio < 1 - low).to(F64)),
        "ratio_mean": float(((ratio * m).sum(-1) / m.sum(-1).clamp(min=1))[rows].mean()),
        "ratio_max": float(torch.max(ratio * m)),
        "ratio_min": float(torch.min(ratio * m + (1 - m) * 1e10)),
        "clipfrac": token_mean(torch.lt(surr2, surr1)),
        "approxkl": token_mean(0.5 * (new - old) ** 2),
        "policykl": token_mean(new - old),
    }


def random_batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(6, 9, generator=g, dtype=F64) - 2
    new = old + 0.3 * torch.randn(6, 9, generator=g, dtype=F64)
    adv = torch.randn(6, 9, generator=g, dtype=F64)
    lengths = torch.tensor([9, 1, 5, 0, 7, 3])
    mask = torch.arange(9).unsqueeze(0) < lengths.unsqueeze(-1)
    return old, new, adv, mask


def test_equal_to_roll_formulas_and_micro_batch_shares_add_up() -> None:
    old, new, adv, mask = random_batch()
    whole = ratio_metrics(old, new, adv, mask, ppo_clip=(0.2, 0.28))
    expected = roll_formulas(old, new, adv, mask, 0.2, 0.28)
    for name, value in expected.items():
        assert float(whole[name]) == pytest.approx(value, abs=1e-12), name
    info = GlobalBatchInfo.from_mask(mask)
    parts = [ratio_metrics(old[s], new[s], adv[s], mask[s], ppo_clip=(0.2, 0.28), global_batch=info)
             for s in (slice(0, 2), slice(2, 4), slice(4, 6))]  # fmt: skip
    for name, value in whole.items():
        values = [float(part[name]) for part in parts]
        combined = max(values) if name == "ratio_max" else min(values) if name == "ratio_min" else sum(values)
        assert combined == pytest.approx(float(value), abs=1e-12), name


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_kl_and_clipfrac_follow_loss_agg_mode_as_roll(mode) -> None:
    old, new, adv, mask = random_batch(1)
    got = ratio_metrics(old, new, adv, mask, loss_agg_mode=mode, ppo_clip=(0.2, 0.2))
    m, rows = mask.to(F64), mask.any(-1)
    per_seq = ((new - old) * m).sum(-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / m.sum(-1).clamp(min=1)
    assert float(got["policykl"]) == pytest.approx(float(per_seq[rows].sum() / rows.sum()), abs=1e-12)
    assert float(got["ppo_ratio_clipfrac"]) <= 1.0  # token-mean whatever the mode, as in ROLL


def test_sequence_and_segment_ratios() -> None:
    old, new, adv, mask = random_batch(2)
    m = mask.to(F64)
    seq = ratio_metrics(old, new, adv, mask, ratio_level="sequence", ppo_clip=(0.2, 0.2))
    per_sample = ((new - old) * m).sum(-1) / m.sum(-1).clamp(min=1)
    rows = mask.any(-1)
    assert float(seq["ratio_mean"]) == pytest.approx(float(per_sample.exp()[rows].mean()), abs=1e-12)
    assert float(seq["ratio_max"]) == pytest.approx(float(per_sample.exp()[rows].max()), abs=1e-12)
    # approxkl / policykl stay on the token log-ratios
    token = ratio_metrics(old, new, adv, mask)
    assert float(seq["policykl"]) == pytest.approx(float(token["policykl"]), abs=1e-15)
    gaps = mask.clone()
    gaps[:, 2] = False  # two segments per long row
    segment = ratio_metrics(old, new, adv, gaps, ratio_level="segment")
    shared = segment_mean(torch.where(gaps, new - old, torch.zeros(())), gaps).exp()
    assert float(segment["ratio_min"]) == pytest.approx(float(shared[gaps].min()), abs=1e-12)
    with pytest.raises(ValueError, match="ratio_level='seq'"):
        ratio_metrics(old, new, adv, mask, ratio_level="seq")


def test_a_micro_batch_without_tokens_gives_neutral_extremes() -> None:
    old, new, adv, _ = random_batch(3)
    got = ratio_metrics(old, new, adv, torch.zeros(6, 9, dtype=torch.bool), global_batch=GlobalBatchInfo(10.0, 2.0))
    assert float(got["ratio_max"]) == -math.inf and float(got["ratio_min"]) == math.inf
    assert float(got["ratio_mean"]) == 0.0 and float(got["approxkl"]) == 0.0
