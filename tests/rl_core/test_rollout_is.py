"""Rollout importance sampling: hand-computed cases for every level x mode, a slow loop reference, the veto,
metrics-only mode, thresholds, padding garbage, the `mismatch/` metric contract of the verl PR, and verl's
convention that rejections and vetoes live in the returned mask only (the loss is unchanged by it)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from rl_core import rollout_is_metrics
from rl_core.losses import LOSS_AGGREGATIONS, POLICY_LOSSES, PolicyLossConfig, get_policy_loss
from rl_core.rollout_is import (
    IS_LEVELS,
    IS_MODES,
    RolloutISConfig,
    apply_rollout_is,
    compute_mismatch_metrics,
    compute_rollout_is_weights,
)

LEVELS = ("token", "sequence", "geometric")
MODES = ("truncate", "clip", "mask")
NAN, INF = math.nan, math.inf

# Metric names listed by the verl PR (all under `mismatch/`); clip mode adds rollout_is_clipped_fraction.
PR_IS_METRICS = (
    "rollout_is_eff_sample_size",
    "rollout_is_mean",
    "rollout_is_p25",
    "rollout_is_p50",
    "rollout_is_p75",
    "rollout_is_p95",
    "rollout_is_p99",
    "rollout_is_max",
    "rollout_is_min",
    "rollout_is_std",
    "rollout_is_veto_fraction",
    "rollout_is_catastrophic_token_fraction",
    "rollout_is_seq_mean",
    "rollout_is_seq_std",
    "rollout_is_seq_max",
    "rollout_is_seq_min",
)
MISMATCH_METRICS = (
    "mismatch_kl",
    "mismatch_k3_kl",
    "mismatch_training_ppl",
    "mismatch_rollout_ppl",
    "mismatch_ppl_ratio",
    "mismatch_log_ppl_diff",
    "mismatch_log_ppl_abs_diff",
    "mismatch_log_ppl_diff_max",
    "mismatch_log_ppl_diff_min",
    "mismatch_training_log_ppl",
    "mismatch_rollout_log_ppl",
)
AFFECTED = {"truncate": "truncated", "clip": "clipped", "mask": "masked"}


# ---------------------------------------------------------------------------------------------------------------
# A small batch whose ratios are written out by hand.
# row 0: three valid tokens with ratios 3, 1/4, 1; row 1: ratios 1.5, 0.8, then padding holding garbage.
RATIOS = [[3.0, 0.25, 1.0], [1.5, 0.8, 1.0]]
MASK = [[True, True, True], [True, True, False]]


def hand_batch(dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rollout = torch.full((2, 3), -1.0, dtype=dtype)
    old = rollout + torch.tensor(RATIOS, dtype=dtype).log()
    old[1, 2] = NAN  # padding garbage: must not matter
    rollout[1, 2] = -INF
    return old, rollout, torch.tensor(MASK)


def assert_close(actual: torch.Tensor, expected: list[list[float]], atol: float = 1e-12) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=1e-12)


# Expected weights / masks per (level, mode, threshold). Lower bound = 1 / threshold everywhere.
#   token: per-token ratios [3, .25, 1] and [1.5, .8]; threshold 2 -> bounds [0.5, 2]
#   sequence: 3 * .25 * 1 = 0.75 and 1.5 * .8 = 1.2; threshold 1.1 -> bounds [0.909.., 1.1]: row 0 below, row 1 above
#   geometric: 0.75 ** (1/3) = 0.9086 and 1.2 ** (1/2) = 1.0954; threshold 1.05 -> [0.952.., 1.05]: below / above
# mask mode keeps the ratio as the weight of a rejected token (verl); only the mask rejects it.
G0, G1 = 0.75 ** (1 / 3), math.sqrt(1.2)
HAND_CASES = {
    ("token", "truncate", 2.0): ([[2.0, 0.25, 1.0], [1.5, 0.8, 0.0]], MASK),
    ("token", "clip", 2.0): ([[0.0, 0.0, 1.0], [1.5, 0.8, 0.0]], MASK),
    ("token", "mask", 2.0): ([[3.0, 0.25, 1.0], [1.5, 0.8, 0.0]], [[False, False, True], [True, True, False]]),
    ("sequence", "truncate", 2.0): ([[0.75] * 3, [1.2, 1.2, 0.0]], MASK),
    ("sequence", "truncate", 1.1): ([[0.75] * 3, [1.1, 1.1, 0.0]], MASK),
    ("sequence", "clip", 2.0): ([[0.75] * 3, [1.2, 1.2, 0.0]], MASK),
    ("sequence", "clip", 1.1): ([[0.0] * 3, [0.0] * 3], MASK),
    ("sequence", "mask", 2.0): ([[0.75] * 3, [1.2, 1.2, 0.0]], MASK),
    ("sequence", "mask", 1.1): ([[0.75] * 3, [1.2, 1.2, 0.0]], [[False] * 3, [False] * 3]),
    ("geometric", "truncate", 2.0): ([[G0] * 3, [G1, G1, 0.0]], MASK),
    ("geometric", "truncate", 1.05): ([[G0] * 3, [1.05, 1.05, 0.0]], MASK),
    ("geometric", "clip", 1.05): ([[0.0] * 3, [0.0] * 3], MASK),
    ("geometric", "clip", 2.0): ([[G0] * 3, [G1, G1, 0.0]], MASK),
    ("geometric", "mask", 1.05): ([[G0] * 3, [G1, G1, 0.0]], [[False] * 3, [False] * 3]),
    ("geometric", "mask", 2.0): ([[G0] * 3, [G1, G1, 0.0]], MASK),
}


@pytest.mark.parametrize(("level", "mode", "threshold"), sorted(HAND_CASES))
def test_hand_computed_weights_and_mask(level: str, mode: str, threshold: float) -> None:
    old, rollout, mask = hand_batch()
    weights, new_mask, _ = compute_rollout_is_weights(old, rollout, mask, level=level, mode=mode, threshold=threshold)
    expected_weights, expected_mask = HAND_CASES[(level, mode, threshold)]
    assert weights is not None
    assert_close(weights, expected_weights)
    assert new_mask.dtype == torch.bool
    assert new_mask.tolist() == expected_mask


def test_every_level_and_mode_has_a_hand_case() -> None:
    assert {(lv, md) for lv, md, _ in HAND_CASES} == {(lv, md) for lv in LEVELS for md in MODES}
    assert set(IS_LEVELS.names()) == set(LEVELS)
    assert set(IS_MODES.names()) == set(MODES)


def test_hand_computed_metrics_token_truncate() -> None:
    old, rollout, mask = hand_batch()
    _, _, m = compute_rollout_is_weights(old, rollout, mask, level="token", mode="truncate", threshold=2.0)
    ratios = [3.0, 0.25, 1.0, 1.5, 0.8]  # population: the five valid tokens; sorted .25 .8 1 1.5 3
    mean = sum(ratios) / 5  # 1.31
    std = math.sqrt(sum((r - mean) ** 2 for r in ratios) / 4)  # Bessel-corrected
    w = [2.0, 0.25, 1.0, 1.5, 0.8]  # truncated at 2
    seq = [(3.0 + 0.25 + 1.0) / 3, (1.5 + 0.8) / 2]
    lr = [math.log(r) for r in ratios]
    expected = {
        "rollout_is_mean": 1.31,
        "rollout_is_std": std,
        "rollout_is_min": 0.25,
        "rollout_is_max": 3.0,
        # linear interpolation between order statistics at position q * (n - 1)
        "rollout_is_p25": 0.8,
        "rollout_is_p50": 1.0,
        "rollout_is_p75": 1.5,
        "rollout_is_p95": 1.5 + 0.8 * (3.0 - 1.5),
        "rollout_is_p99": 1.5 + 0.96 * (3.0 - 1.5),
        "rollout_is_eff_sample_size": sum(w) ** 2 / (5 * sum(x * x for x in w)),
        "rollout_is_ratio_fraction_high": 1 / 5,
        "rollout_is_ratio_fraction_low": 1 / 5,
        "rollout_is_truncated_fraction": 1 / 5,
        "rollout_is_seq_truncated_fraction": 1 / 2,
        "rollout_is_veto_fraction": 0.0,
        "rollout_is_catastrophic_token_fraction": 0.0,
        "rollout_is_seq_mean": sum(seq) / 2,
        "rollout_is_seq_std": abs(seq[0] - seq[1]) / math.sqrt(2),
        "rollout_is_seq_min": seq[1],
        "rollout_is_seq_max": seq[0],
        "mismatch_kl": -sum(lr) / 5,
        "mismatch_k3_kl": sum(r - 1 - x for r, x in zip(ratios, lr)) / 5,
        # training log-probs: -1 + log r; rollout log-probs: -1
        "mismatch_training_log_ppl": ((1 - math.log(0.75) / 3) + (1 - math.log(1.2) / 2)) / 2,
        "mismatch_training_ppl": (math.exp(1 - math.log(0.75) / 3) + math.exp(1 - math.log(1.2) / 2)) / 2,
        "mismatch_rollout_log_ppl": 1.0,
        "mismatch_rollout_ppl": math.e,
        "mismatch_log_ppl_diff": (-math.log(0.75) / 3 - math.log(1.2) / 2) / 2,
        "mismatch_log_ppl_abs_diff": (abs(math.log(0.75) / 3) + abs(math.log(1.2) / 2)) / 2,
        "mismatch_log_ppl_diff_max": -math.log(0.75) / 3,
        "mismatch_log_ppl_diff_min": -math.log(1.2) / 2,
        "mismatch_ppl_ratio": (0.75 ** (-1 / 3) + 1.2 ** (-1 / 2)) / 2,
    }
    assert {f"mismatch/{k}" for k in expected} <= set(m)
    for key, value in expected.items():
        assert m[f"mismatch/{key}"] == pytest.approx(value, rel=1e-12, abs=1e-12), key


def test_hand_computed_metrics_sequence_mask() -> None:
    old, rollout, mask = hand_batch()
    _, _, m = compute_rollout_is_weights(old, rollout, mask, level="sequence", mode="mask", threshold=1.1)
    # sequence ratios 0.75 (3 tokens) and 1.2 (2 tokens): token-weighted statistics
    assert m["mismatch/rollout_is_mean"] == pytest.approx((3 * 0.75 + 2 * 1.2) / 5, rel=1e-12)
    assert m["mismatch/rollout_is_min"] == pytest.approx(0.75, rel=1e-12)
    assert m["mismatch/rollout_is_max"] == pytest.approx(1.2, rel=1e-12)
    assert m["mismatch/rollout_is_p50"] == pytest.approx(0.75, rel=1e-12)  # sorted .75 .75 .75 1.2 1.2
    assert m["mismatch/rollout_is_seq_mean"] == pytest.approx((0.75 + 1.2) / 2, rel=1e-12)
    assert m["mismatch/rollout_is_ratio_fraction_high"] == pytest.approx(2 / 5)
    assert m["mismatch/rollout_is_ratio_fraction_low"] == pytest.approx(3 / 5)
    assert m["mismatch/rollout_is_masked_fraction"] == pytest.approx(1.0)
    assert m["mismatch/rollout_is_seq_masked_fraction"] == pytest.approx(1.0)
    assert m["mismatch/rollout_is_eff_sample_size"] == 0.0  # everything rejected
    assert "mismatch/rollout_is_clipped_fraction" not in m


# ---------------------------------------------------------------------------------------------------------------
# Slow, loop-based reference of the documented semantics (independent of the vectorised code).


def reference(
    old: torch.Tensor,
    rollout: torch.Tensor,
    mask: torch.Tensor,
    level: str,
    mode: str,
    threshold: float,
    lower: float | None,
    veto: float | None,
) -> tuple[list[list[float]], list[list[bool]], dict[str, float]]:
    lower = 1.0 / threshold if lower is None else lower
    B, T = old.shape
    o, r, v = old.tolist(), rollout.tolist(), (mask != 0).tolist()
    weights = [[0.0] * T for _ in range(B)]  # returned weights: bounded, also at rejected / vetoed tokens
    applied = [[0.0] * T for _ in range(B)]  # what the loss sees: 0 at rejected / vetoed tokens
    keep_mask = [[False] * T for _ in range(B)]
    pop_tokens: list[float] = []  # unit ratio of every token of the statistics population
    seq_means, units_w, n_valid, n_cat, n_vetoed, n_rows = [], [], 0, 0, 0, 0
    high = low = 0
    affected_rows = 0
    kl_terms, k3_terms, diffs, train_lp, roll_lp = [], [], [], [], []
    for b in range(B):
        idx = [t for t in range(T) if v[b][t]]
        n_valid += len(idx)
        if not idx:
            continue
        n_rows += 1
        gaps = {t: o[b][t] - r[b][t] for t in idx}
        bad = any(not math.isfinite(g) for g in gaps.values())
        n_cat += sum(1 for g in gaps.values() if not math.isfinite(g) or (veto is not None and g < math.log(veto)))
        vetoed = bad or (veto is not None and any(g < math.log(veto) for g in gaps.values()))
        n_vetoed += vetoed
        # A non-finite gap counts as a ratio ~0 (its sequence leaves the mask and the statistics anyway).
        unit_log = {t: (g if math.isfinite(g) else -INF) for t, g in gaps.items()}
        if level != "token":
            total = sum(unit_log.values())
            unit_log = {t: total if level == "sequence" else total / len(idx) for t in idx}
        row_affected = False
        row_weights = []
        for t in idx:
            lg = unit_log[t]
            ratio = math.exp(min(max(lg, -20.0), 20.0))
            is_high, is_low = lg > math.log(threshold), lg < math.log(lower)
            keep = not vetoed
            if mode == "truncate":
                w = min(ratio, threshold)
            elif mode == "clip":
                w = 0.0 if (is_high or is_low) else ratio
            else:
                w = ratio
                keep = keep and not (is_high or is_low)
            weights[b][t] = w
            applied[b][t] = w if keep else 0.0
            keep_mask[b][t] = keep
            row_weights.append(applied[b][t])
            if not bad:
                pop_tokens.append(ratio)
                high += is_high
                low += is_low
                row_affected |= is_high or (mode != "truncate" and is_low)
        if level == "token":
            units_w.extend(row_weights)
        else:
            units_w.append(row_weights[0])
        affected_rows += row_affected
        if not bad:
            seq_means.append(sum(math.exp(min(max(unit_log[t], -20), 20)) for t in idx) / len(idx))
            for t in idx:
                kl_terms.append(-gaps[t])
                k3_terms.append(math.exp(min(max(gaps[t], -20), 20)) - 1 - gaps[t])
            train_lp.append(sum(o[b][t] for t in idx) / len(idx))
            roll_lp.append(sum(r[b][t] for t in idx) / len(idx))
            diffs.append(roll_lp[-1] - train_lp[-1])

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else 0.0

    def std(xs: list[float]) -> float:
        return float(np.std(xs, ddof=1)) if len(xs) > 1 else 0.0

    def pct(q: float) -> float:
        return float(np.percentile(pop_tokens, q)) if pop_tokens else 0.0

    s1, s2 = sum(units_w), sum(w * w for w in units_w)
    nv, nr = max(n_valid, 1), max(n_rows, 1)
    affected = high + low if mode != "truncate" else high
    clamp = lambda x: min(max(x, -50.0), 50.0)  # noqa: E731
    metrics = {
        "rollout_is_mean": mean(pop_tokens),
        "rollout_is_std": std(pop_tokens),
        "rollout_is_min": min(pop_tokens, default=0.0),
        "rollout_is_max": max(pop_tokens, default=0.0),
        **{f"rollout_is_p{q}": pct(q) for q in (25, 50, 75, 95, 99)},
        "rollout_is_seq_mean": mean(seq_means),
        "rollout_is_seq_std": std(seq_means),
        "rollout_is_seq_min": min(seq_means, default=0.0),
        "rollout_is_seq_max": max(seq_means, default=0.0),
        "rollout_is_eff_sample_size": s1 * s1 / (len(units_w) * s2) if s2 > 0 else 0.0,
        "rollout_is_veto_fraction": n_vetoed / nr,
        "rollout_is_catastrophic_token_fraction": n_cat / nv,
        "rollout_is_ratio_fraction_high": high / nv,
        "rollout_is_ratio_fraction_low": low / nv,
        f"rollout_is_{AFFECTED[mode]}_fraction": affected / nv,
        f"rollout_is_seq_{AFFECTED[mode]}_fraction": affected_rows / nr,
        "mismatch_kl": mean(kl_terms),
        "mismatch_k3_kl": mean(k3_terms),
        "mismatch_training_log_ppl": mean([-x for x in train_lp]),
        "mismatch_training_ppl": mean([math.exp(clamp(-x)) for x in train_lp]),
        "mismatch_rollout_log_ppl": mean([-x for x in roll_lp]),
        "mismatch_rollout_ppl": mean([math.exp(clamp(-x)) for x in roll_lp]),
        "mismatch_log_ppl_diff": mean(diffs),
        "mismatch_log_ppl_abs_diff": mean([abs(d) for d in diffs]),
        "mismatch_log_ppl_diff_max": max(diffs, default=0.0),
        "mismatch_log_ppl_diff_min": min(diffs, default=0.0),
        "mismatch_ppl_ratio": mean([math.exp(clamp(d)) for d in diffs]),
    }
    return weights, applied, keep_mask, metrics


def random_batch(
    seed: int, B: int = 6, T: int = 9, spread: float = 0.6
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4
    old = rollout + torch.randn(B, T, generator=g, dtype=torch.float64) * spread
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = torch.arange(T)[None, :] < lengths[:, None]
    old[~mask] = NAN  # padding garbage
    rollout[~mask] = INF
    old[1, 0] += -12.0  # a catastrophic token (ratio ~ 1e-5 * noise): vetoed when the veto is on
    return old, rollout, mask


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("threshold", "lower", "veto"), [(2.0, None, 1e-4), (1.3, 0.6, None), (5.0, 0.9, 1e-3)])
def test_matches_loop_reference(level: str, mode: str, threshold: float, lower: float | None, veto: float | None):
    for seed in range(4):
        old, rollout, mask = random_batch(seed, spread=0.25 if level == "sequence" else 0.6)
        if seed == 3:
            old[2, 0] = NAN  # a non-finite gap at a valid position: the sequence is dropped
        weights, new_mask, metrics = compute_rollout_is_weights(
            old, rollout, mask, level=level, mode=mode, threshold=threshold, threshold_lower=lower, veto_threshold=veto
        )
        ref_w, ref_applied, ref_keep, ref_metrics = reference(old, rollout, mask, level, mode, threshold, lower, veto)
        assert weights is not None
        torch.testing.assert_close(weights, torch.tensor(ref_w, dtype=torch.float64), atol=1e-10, rtol=1e-10)
        applied = torch.tensor(ref_applied, dtype=torch.float64)
        torch.testing.assert_close(weights * new_mask, applied, atol=1e-10, rtol=1e-10)
        assert new_mask.tolist() == ref_keep
        assert set(metrics) == {f"mismatch/{k}" for k in ref_metrics}
        for key, value in ref_metrics.items():
            assert metrics[f"mismatch/{key}"] == pytest.approx(value, rel=1e-9, abs=1e-10), (key, seed)


# ---------------------------------------------------------------------------------------------------------------
# Veto, thresholds, disabled / metrics-only modes


def test_veto_drops_whole_sequence_from_the_mask_only() -> None:
    old, rollout, mask = hand_batch()
    old[1, 1] = rollout[1, 1] + math.log(1e-5)  # ratio 1e-5 < veto 1e-4
    weights, new_mask, m = compute_rollout_is_weights(old, rollout, mask, veto_threshold=1e-4)
    assert weights is not None
    assert new_mask.tolist() == [MASK[0], [False, False, False]]
    assert_close(weights, [[2.0, 0.25, 1.0], [1.5, 1e-5, 0.0]])  # the vetoed row keeps its truncated ratios
    assert m["mismatch/rollout_is_veto_fraction"] == 0.5
    assert m["mismatch/rollout_is_catastrophic_token_fraction"] == pytest.approx(1 / 5)
    # veto disabled: the token keeps its (tiny) ratio
    weights, new_mask, m = compute_rollout_is_weights(old, rollout, mask, veto_threshold=None)
    assert weights is not None
    assert new_mask.tolist() == MASK
    assert_close(weights, [[2.0, 0.25, 1.0], [1.5, 1e-5, 0.0]])
    assert m["mismatch/rollout_is_veto_fraction"] == 0.0


@pytest.mark.parametrize("veto", [1e-4, None])
def test_non_finite_gap_at_valid_token_is_catastrophic(veto: float | None) -> None:
    old, rollout, mask = hand_batch()
    rollout[0, 1] = -INF  # the rollout engine claims the sampled token was impossible
    weights, new_mask, m = compute_rollout_is_weights(old, rollout, mask, veto_threshold=veto)
    assert weights is not None
    assert torch.isfinite(weights).all()
    assert new_mask.tolist() == [[False] * 3, MASK[1]]
    # the non-finite token weighs the safety floor exp(-20); the row leaves the loss through the mask
    assert_close(weights, [[2.0, math.exp(-20.0), 1.0], [1.5, 0.8, 0.0]])
    assert m["mismatch/rollout_is_veto_fraction"] == 0.5
    assert m["mismatch/rollout_is_catastrophic_token_fraction"] == pytest.approx(1 / 5)
    assert m["mismatch/rollout_is_mean"] == pytest.approx((1.5 + 0.8) / 2)  # row 0 left out of the statistics
    assert all(math.isfinite(v) for v in m.values())


# ---------------------------------------------------------------------------------------------------------------
# verl's convention (rollout_corr_helper.py, verl >= 0.6.1, tests/trainer/ppo/test_rollout_corr.py): rejected and
# vetoed tokens keep their bounded weights and leave the loss through the returned mask alone, so the loss is what it
# was when rl-core zeroed their weights.


def verl_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """verl's ``test_mask_mode`` batch: ratio exp(-2 + 1) = exp(-1) = 0.368 on row 0, exp(0.5) = 1.649 on row 1."""
    old = torch.full((2, 5), -2.0, dtype=torch.float64)
    rollout = torch.tensor([[-1.0] * 5, [-2.5] * 5], dtype=torch.float64)
    return old, rollout, torch.ones(2, 5, dtype=torch.bool)


VERL_WEIGHTS = [[math.exp(-1.0)] * 5, [math.exp(0.5)] * 5]
# What rl-core returned for row 0 before it followed verl (rejected / vetoed tokens weighed 0).
ZEROED_VERL_WEIGHTS = [[0.0] * 5, [math.exp(0.5)] * 5]


@pytest.mark.parametrize("veto", [None, 1e-4])
def test_mask_mode_rejects_through_the_mask_and_keeps_the_ratio(veto: float | None) -> None:
    """exp(-1) < threshold_lower 0.5: row 0 leaves the mask, and its weights stay 0.368 (were 0 before)."""
    old, rollout, mask = verl_batch()
    weights, new_mask, m = compute_rollout_is_weights(
        old, rollout, mask, mode="mask", threshold=2.0, threshold_lower=0.5, veto_threshold=veto
    )
    assert weights is not None
    assert_close(weights, VERL_WEIGHTS)
    assert weights[0, 0].item() == pytest.approx(0.368, abs=5e-4)
    assert new_mask.tolist() == [[False] * 5, [True] * 5]
    assert_close(weights * new_mask, ZEROED_VERL_WEIGHTS)
    assert m["mismatch/rollout_is_masked_fraction"] == 0.5
    assert m["mismatch/rollout_is_veto_fraction"] == 0.0


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_veto_rejects_through_the_mask_and_keeps_the_ratio(mode: str) -> None:
    """exp(-1) < veto_threshold 0.5 (lower bound 0.25 keeps it in bounds): row 0 is vetoed, its weights stay 0.368."""
    old, rollout, mask = verl_batch()
    weights, new_mask, m = compute_rollout_is_weights(
        old, rollout, mask, mode=mode, threshold=2.0, threshold_lower=0.25, veto_threshold=0.5
    )
    assert weights is not None
    assert_close(weights, VERL_WEIGHTS)
    assert weights[0, 0].item() == pytest.approx(0.368, abs=5e-4)
    assert new_mask.tolist() == [[False] * 5, [True] * 5]
    assert_close(weights * new_mask, ZEROED_VERL_WEIGHTS)
    assert m["mismatch/rollout_is_veto_fraction"] == 0.5
    assert m["mismatch/rollout_is_catastrophic_token_fraction"] == 0.5
    assert m[f"mismatch/rollout_is_{AFFECTED[mode]}_fraction"] == 0.0


def _loss_and_grad(
    name: str, agg: str, old: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(13)
    log_prob = (old.nan_to_num(nan=-1.0) + 0.1 * torch.randn(old.shape, generator=g, dtype=old.dtype)).requires_grad_()
    advantages = torch.randn(old.shape, generator=g, dtype=old.dtype)
    loss, _ = get_policy_loss(name)(
        old, log_prob, advantages, mask, loss_agg_mode=agg, config=PolicyLossConfig(seed=0), rollout_is_weights=weights
    )
    loss.backward()
    assert log_prob.grad is not None
    return loss.detach(), log_prob.grad


@pytest.mark.parametrize("agg", LOSS_AGGREGATIONS.names())
@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_loss_with_returned_weights_and_mask_equals_loss_with_zeroed_weights(name: str, agg: str) -> None:
    """Every policy loss and aggregation gives bit-identical losses and gradients with the returned (weights, mask)
    and with the weights of rejected / vetoed tokens zeroed (rl-core's former output, = weights * mask)."""
    old, rollout, mask = verl_batch()
    weights, new_mask, _ = compute_rollout_is_weights(
        old, rollout, mask, mode="mask", threshold=2.0, threshold_lower=0.5, veto_threshold=None
    )
    assert weights is not None
    zeroed = torch.tensor(ZEROED_VERL_WEIGHTS, dtype=old.dtype)
    for a, b in zip(
        _loss_and_grad(name, agg, old, new_mask, weights), _loss_and_grad(name, agg, old, new_mask, zeroed)
    ):
        assert torch.equal(a, b)
    old, rollout, mask = random_batch(2)  # has a vetoed row and padding garbage
    for level in LEVELS:
        for mode in MODES:
            weights, new_mask, _ = compute_rollout_is_weights(old, rollout, mask, level=level, mode=mode, threshold=1.5)
            assert weights is not None
            assert not new_mask.equal(mask)  # something is rejected or vetoed
            applied = weights * new_mask
            got = _loss_and_grad(name, agg, old, new_mask, weights)
            for a, b in zip(got, _loss_and_grad(name, agg, old, new_mask, applied)):
                assert torch.equal(a, b), (level, mode)


def test_threshold_none_disables_everything() -> None:
    old, rollout, mask = hand_batch()
    weights, new_mask, metrics = compute_rollout_is_weights(old, rollout, mask, threshold=None)
    assert weights is None
    assert new_mask is mask
    assert metrics == {}


def test_lower_threshold_defaults_to_reciprocal() -> None:
    old, rollout, mask = hand_batch()
    for level in LEVELS:
        implicit = compute_rollout_is_weights(old, rollout, mask, level=level, mode="clip", threshold=4.0)
        explicit = compute_rollout_is_weights(
            old, rollout, mask, level=level, mode="clip", threshold=4.0, threshold_lower=0.25
        )
        assert implicit[0] is not None and explicit[0] is not None
        assert torch.equal(implicit[0], explicit[0])
        assert implicit[2] == explicit[2]
    # upper 3.5: the default lower bound 1/3.5 = 0.286 clips the ratio 0.25; an explicit lower of 0.2 keeps it
    weights, _, _ = compute_rollout_is_weights(old, rollout, mask, mode="clip", threshold=3.5)
    assert weights is not None
    assert_close(weights, [[3.0, 0.0, 1.0], [1.5, 0.8, 0.0]])
    weights, _, _ = compute_rollout_is_weights(old, rollout, mask, mode="clip", threshold=3.5, threshold_lower=0.2)
    assert weights is not None
    assert_close(weights, [[3.0, 0.25, 1.0], [1.5, 0.8, 0.0]])


def test_metrics_only_mode_via_config() -> None:
    old, rollout, mask = hand_batch()
    config = RolloutISConfig(rollout_is_threshold=2.0, rollout_is=False, rollout_is_mode="mask")
    weights, new_mask, metrics = apply_rollout_is(config, old, rollout, mask)
    assert weights is None
    assert new_mask is mask
    _, applied_mask, full_metrics = compute_rollout_is_weights(old, rollout, mask, mode="mask", threshold=2.0)
    assert metrics == full_metrics  # what IS would do is still reported
    assert applied_mask.tolist() != MASK
    config.rollout_is = True
    weights, new_mask, _ = apply_rollout_is(config, old, rollout, mask)
    assert weights is not None
    assert new_mask.tolist() == applied_mask.tolist()


def test_config_disabled_by_default_and_validation_names_the_key() -> None:
    old, rollout, mask = hand_batch()
    assert apply_rollout_is(RolloutISConfig(), old, rollout, mask) == (None, mask, {})
    bad = {
        "rollout_is_level": RolloutISConfig(rollout_is_threshold=2.0, rollout_is_level="tokens"),
        "rollout_is_mode": RolloutISConfig(rollout_is_threshold=2.0, rollout_is_mode="cap"),
        "rollout_is_threshold": RolloutISConfig(rollout_is_threshold=0.5),
        "rollout_is_threshold_lower": RolloutISConfig(rollout_is_threshold=2.0, rollout_is_threshold_lower=3.0),
        "rollout_is_veto_threshold": RolloutISConfig(rollout_is_threshold=2.0, rollout_is_veto_threshold=0.0),
        "rollout_is": RolloutISConfig(rollout_is_threshold=2.0, rollout_is="yes"),  # type: ignore[arg-type]
    }
    for key, config in bad.items():
        with pytest.raises(ValueError, match=key):
            config.validate()
    with pytest.raises(ValueError, match="rollout_is_level"):
        compute_rollout_is_weights(old, rollout, mask, level="tokens")
    with pytest.raises(ValueError, match="calculate_log_probs"):
        compute_rollout_is_weights(old, None, mask)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="response_length"):
        compute_rollout_is_weights(old, rollout[:, :2], mask)


def test_config_defaults_mirror_verl_and_accept_numpy_numbers() -> None:
    config = RolloutISConfig()
    assert (config.rollout_is_threshold, config.rollout_is, config.rollout_is_threshold_lower) == (None, False, None)
    assert (config.rollout_is_level, config.rollout_is_mode, config.rollout_is_veto_threshold) == (
        "token",
        "truncate",
        1e-4,
    )
    RolloutISConfig(rollout_is_threshold=np.float32(2.0), rollout_is_veto_threshold=None).validate()  # type: ignore[arg-type]
    for bad in (INF, NAN, True, "2.0"):
        with pytest.raises(ValueError, match="rollout_is_threshold"):
            RolloutISConfig(rollout_is_threshold=bad).validate()  # type: ignore[arg-type]


def test_registries_reject_duplicates() -> None:
    with pytest.raises(ValueError, match="registered twice"):
        IS_LEVELS.register("token")(lambda gaps: gaps.log_ratio)
    with pytest.raises(ValueError, match="registered twice"):
        IS_MODES.register("clip")(IS_MODES.get("clip"))


# ---------------------------------------------------------------------------------------------------------------
# Contract details: padding, dtypes, detachment, metric names, per-sequence independence, big batches


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("mode", MODES)
def test_padding_garbage_is_ignored(level: str, mode: str) -> None:
    old, rollout, mask = random_batch(7)
    base = compute_rollout_is_weights(old, rollout, mask, level=level, mode=mode)
    for fill in (0.0, NAN, INF, -INF, 1e30):
        old2, rollout2 = old.clone(), rollout.clone()
        old2[~mask], rollout2[~mask] = fill, -fill if math.isfinite(fill) else NAN
        other = compute_rollout_is_weights(old2, rollout2, mask, level=level, mode=mode)
        assert base[0] is not None and other[0] is not None
        assert torch.equal(base[0], other[0])
        assert torch.equal(base[1], other[1])
        assert base[2] == other[2]


def test_every_pr_metric_is_present_for_every_level_and_mode() -> None:
    old, rollout, mask = random_batch(1)
    for level in LEVELS:
        for mode in MODES:
            _, _, m = compute_rollout_is_weights(old, rollout, mask, level=level, mode=mode)
            expected = {*PR_IS_METRICS, *MISMATCH_METRICS, "rollout_is_ratio_fraction_high"}
            expected |= {"rollout_is_ratio_fraction_low", f"rollout_is_{AFFECTED[mode]}_fraction"}
            assert {f"mismatch/{k}" for k in expected} <= set(m), (level, mode)
            assert all(isinstance(v, float) and math.isfinite(v) for v in m.values())
            assert 0.0 <= m["mismatch/rollout_is_eff_sample_size"] <= 1.0


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.uint8, torch.float32])
def test_mask_dtype_is_preserved(mask_dtype: torch.dtype) -> None:
    old, rollout, mask = hand_batch(torch.float32)
    weights, new_mask, _ = compute_rollout_is_weights(old, rollout, mask.to(mask_dtype), mode="mask")
    assert new_mask.dtype == mask_dtype
    assert new_mask.bool().tolist() == [[False, False, True], [True, True, False]]
    assert weights is not None and weights.dtype == torch.float32


def test_weights_are_detached_and_bf16_is_computed_in_fp32() -> None:
    old, rollout, mask = hand_batch(torch.float32)
    old.requires_grad_(True)
    weights, _, _ = compute_rollout_is_weights(old, rollout, mask)
    assert weights is not None and not weights.requires_grad
    weights, _, metrics = compute_rollout_is_weights(old.detach().bfloat16(), rollout.bfloat16(), mask)
    assert weights is not None and weights.dtype == torch.float32
    assert metrics["mismatch/rollout_is_max"] == pytest.approx(3.0, rel=1e-2)


def test_all_padding_batch_gives_zero_weights_and_zero_metrics() -> None:
    old, rollout, mask = hand_batch()
    empty = torch.zeros_like(mask)
    weights, new_mask, metrics = compute_rollout_is_weights(old, rollout, empty)
    assert weights is not None and not weights.any()
    assert not new_mask.any()
    assert metrics and all(v == 0.0 for v in metrics.values())


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("mode", MODES)
def test_weights_and_mask_are_per_sequence(level: str, mode: str) -> None:
    """Weights and rejections of a sequence do not depend on the rest of the batch (batch 1x6 == 6x1)."""
    old, rollout, mask = random_batch(3)
    weights, new_mask, _ = compute_rollout_is_weights(old, rollout, mask, level=level, mode=mode, threshold=1.5)
    rows = [
        compute_rollout_is_weights(
            old[i : i + 1], rollout[i : i + 1], mask[i : i + 1], level=level, mode=mode, threshold=1.5
        )
        for i in range(old.shape[0])
    ]
    assert weights is not None
    assert torch.equal(weights, torch.cat([w for w, _, _ in rows if w is not None]))
    assert torch.equal(new_mask, torch.cat([m for _, m, _ in rows]))


def test_mismatch_metrics_standalone() -> None:
    old, rollout, mask = hand_batch()
    standalone = compute_mismatch_metrics(old, rollout, mask)
    assert set(standalone) == set(MISMATCH_METRICS)  # unprefixed
    _, _, metrics = compute_rollout_is_weights(old, rollout, mask)
    for key, value in standalone.items():
        assert metrics[f"mismatch/{key}"] == value
    training_only = compute_mismatch_metrics(old, None, mask)
    assert set(training_only) == {"mismatch_training_ppl", "mismatch_training_log_ppl"}
    assert training_only["mismatch_training_log_ppl"] == standalone["mismatch_training_log_ppl"]
    assert training_only["mismatch_training_ppl"] == pytest.approx(standalone["mismatch_training_ppl"], rel=1e-12)


def test_percentiles_of_large_batches_come_from_a_strided_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(0)
    B, T = 32, 512
    rollout = -torch.rand(B, T, generator=g)
    old = rollout + 0.1 * torch.randn(B, T, generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    ratios = (old - rollout).double().exp().flatten()
    exact = {q: torch.quantile(ratios, q / 100).item() for q in (25, 50, 75, 95, 99)}
    monkeypatch.setattr(rollout_is_metrics, "QUANTILE_MAX_SAMPLES", 2048)
    _, _, m = compute_rollout_is_weights(old, rollout, mask, threshold=10.0)
    for q, value in exact.items():
        assert m[f"mismatch/rollout_is_p{q}"] == pytest.approx(value, abs=0.02), q
    assert m["mismatch/rollout_is_max"] == pytest.approx(ratios.max().item(), rel=1e-6)  # min / max stay exact
    assert rollout_is_metrics._quantile_stride(128 * 4096) % 2 == 1


def test_docs_quick_start_runs() -> None:
    """The Python example of docs/rollout-importance-sampling.md stays true."""
    doc = Path(__file__).resolve().parents[2] / "docs" / "rollout-importance-sampling.md"
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(encoding="utf-8"), flags=re.DOTALL)
    assert blocks
    for block in blocks:
        exec(compile(block, str(doc), "exec"), {})


@pytest.mark.parametrize("level", LEVELS)
def test_float32_agrees_with_float64(level: str) -> None:
    """Small mismatches (|log r| ~ 1e-3, as between bf16 and fp32 engines) keep their precision in fp32."""
    g = torch.Generator().manual_seed(5)
    rollout = -torch.rand(16, 256, generator=g, dtype=torch.float64) * 3
    old = rollout + 1e-3 * torch.randn(16, 256, generator=g, dtype=torch.float64)
    old, rollout = old.float().double(), rollout.float().double()  # both runs see the same fp32 inputs
    mask = torch.rand(16, 256, generator=g) < 0.9
    w64, _, m64 = compute_rollout_is_weights(old, rollout, mask, level=level, mode="clip", threshold=1.002)
    w32, _, m32 = compute_rollout_is_weights(
        old.float(), rollout.float(), mask, level=level, mode="clip", threshold=1.002
    )
    assert w64 is not None and w32 is not None
    torch.testing.assert_close(w32.double(), w64, atol=1e-6, rtol=0)
    for key, value in m64.items():  # k3 ~ 5e-7 per token and the stds ~ 1e-3 included
        assert m32[key] == pytest.approx(value, rel=2e-5, abs=1e-12), key
