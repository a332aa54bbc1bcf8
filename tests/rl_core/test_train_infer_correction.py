"""ROLL's train-infer correction (``train_infer_correction``): ratios and diffs at the four granularities, the
clamped IS weight, the filters and ROLL's metric names, against numbers worked out by hand and a loop reference."""

from __future__ import annotations

import math

import pytest
import torch

from rl_core.train_infer_correction import (
    GRANULARITIES,
    TrainInferCorrectionConfig,
    TrainInferFilterConfig,
    TrainInferISWeightConfig,
    compute_train_infer_correction,
    gaps,
)

# row 0: one segment of 3 tokens; row 1: two segments (tokens 0 and 2-3); row 2: no token
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1], [0, 0, 0, 0]])
OLD = torch.log(torch.tensor([[0.5, 0.4, 0.9, 0.1], [0.2, 0.3, 0.6, 0.8], [0.5, 0.5, 0.5, 0.5]]))
INFER = torch.log(torch.tensor([[0.4, 0.5, 0.9, 0.7], [0.2, 0.9, 0.5, 0.4], [0.1, 0.1, 0.1, 0.1]]))


def loop_reference(old, infer, mask):
    """Ratio and diff per granularity, row by row and segment by segment in plain Python."""
    out = {kind: {level: torch.zeros(old.shape, dtype=torch.float64) for level in GRANULARITIES}
           for kind in ("ratio", "diff")}  # fmt: skip
    for b in range(old.shape[0]):
        tokens = [t for t in range(old.shape[1]) if mask[b, t]]
        lr = {t: float(old[b, t] - infer[b, t]) for t in tokens}
        df = {t: math.exp(old[b, t]) - math.exp(infer[b, t]) for t in tokens}
        segments, current = [], []
        for t in range(old.shape[1]):
            if mask[b, t]:
                current.append(t)
            elif current:
                segments, current = [*segments, current], []
        segments += [current] if current else []
        for t in range(old.shape[1]):
            out["ratio"]["token"][b, t] = math.exp(lr.get(t, 0.0))
            out["diff"]["token"][b, t] = df.get(t, 0.0)
            out["ratio"]["geometric"][b, t] = math.exp(sum(lr.values()) / len(tokens)) if tokens else 1.0
            out["diff"]["geometric"][b, t] = sum(df.values()) / len(tokens) if tokens else 0.0
            out["ratio"]["sequence"][b, t] = math.exp(sum(lr.values()))
            out["diff"]["sequence"][b, t] = sum(df.values())
            segment = next((s for s in segments if t in s), None)
            out["ratio"]["segment"][b, t] = math.exp(sum(lr[s] for s in segment) / len(segment)) if segment else 1.0
            out["diff"]["segment"][b, t] = sum(df[s] for s in segment) / len(segment) if segment else 0.0
    return out


def test_ratios_and_diffs_at_every_granularity_match_the_loop_and_hand_numbers():
    got, expected = gaps(OLD, INFER, MASK), loop_reference(OLD, INFER, MASK)
    for kind in ("ratio", "diff"):
        for level in GRANULARITIES:
            torch.testing.assert_close(got[kind][level].double(), expected[kind][level], atol=1e-6, rtol=1e-6)
    # by hand, row 0: token ratios 0.5/0.4, 0.4/0.5, 1; sequence ratio their product 1; diffs 0.1, -0.1, 0
    assert got["ratio"]["token"][0, :3].tolist() == pytest.approx([1.25, 0.8, 1.0])
    assert got["ratio"]["sequence"][0, 0] == pytest.approx(1.0) and got["diff"]["sequence"][0, 0] == pytest.approx(0.0)
    # row 1's second segment: ratios 0.6/0.5 and 0.8/0.4 -> geometric mean sqrt(1.2 * 2)
    assert got["ratio"]["segment"][1, 3] == pytest.approx(math.sqrt(2.4)) and got["ratio"]["segment"][1, 0] == 1.0


def test_the_is_weight_is_the_clamped_ratio_and_only_metrics_when_disabled():
    off = TrainInferCorrectionConfig()
    weight, keep, metrics = compute_train_infer_correction(off, MASK, OLD, INFER)
    assert torch.equal(weight, torch.ones_like(weight)) and torch.equal(keep, torch.ones_like(keep))
    names = {f"actor/train_infer_{kind}_{level}_mean@sum" for kind in ("ratio", "diff") for level in GRANULARITIES}
    assert set(metrics) == names
    # the mean over the two sequences with tokens of each one's token mean (row 2 has none)
    row0 = (1.25 + 0.8 + 1.0) / 3
    row1 = (1.0 + 1.2 + 2.0) / 3
    assert metrics["actor/train_infer_ratio_token_mean@sum"] == pytest.approx((row0 + row1) / 2)

    on = TrainInferCorrectionConfig(is_weight=TrainInferISWeightConfig(enabled=True, upper_bound=1.5))
    weight, _, metrics = compute_train_infer_correction(on, MASK, OLD, INFER)
    assert weight[0, :3].tolist() == pytest.approx([1.25, 0.8, 1.0]) and weight[1, 3] == pytest.approx(1.5)
    assert metrics["actor/is_weight_clipfrac@sum"] == pytest.approx(1 / 6)  # one of the six tokens (2.0) clamped
    sequence = TrainInferCorrectionConfig(is_weight=TrainInferISWeightConfig(True, "sequence", None))
    weight, _, metrics = compute_train_infer_correction(sequence, MASK, OLD, INFER)
    assert weight[1, 0] == pytest.approx(2.4) and "actor/is_weight_clipfrac@sum" not in metrics  # no bound


def test_filters_drop_the_tokens_outside_their_bounds_and_report_pass_rates():
    rules = [TrainInferFilterConfig(enabled=True, agg_type="token", ratio_low=0.9, ratio_high=1.3),
             TrainInferFilterConfig(enabled=True, agg_type="segment", ratio_enabled=False, diff_enabled=True,
                                    diff_low=-0.05, diff_high=0.05),
             TrainInferFilterConfig(enabled=False, agg_type="sequence", ratio_low=5.0, ratio_high=6.0)]  # fmt: skip
    weight, keep, metrics = compute_train_infer_correction(TrainInferCorrectionConfig(filters=rules), MASK, OLD, INFER)
    # token ratios 1.25, 0.8, 1 | 1, -, 1.2, 2: the band keeps 1.25, 1, 1, 1.2 (4 of 6)
    assert metrics["actor/train_infer_token_ratio_mask_mean@sum"] == pytest.approx(4 / 6)
    # segment diffs: row 0 (0.1 - 0.1 + 0) / 3 = 0; row 1: 0, then (0.1 + 0.4) / 2 = 0.25 -> its last two fail
    assert metrics["actor/train_infer_segment_diff_mask_mean@sum"] == pytest.approx(4 / 6)
    kept = (keep * MASK).tolist()
    assert kept == [[1, 0, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]]
    assert metrics["actor/train_infer_final_mask_mean"] == pytest.approx(3 / 6)
    assert "actor/train_infer_sequence_ratio_mask_mean@sum" not in metrics  # a disabled rule does nothing
    assert torch.equal(weight, torch.ones_like(weight))


def test_masked_out_positions_never_reach_a_value():
    old, infer = OLD.clone(), INFER.clone()
    old[0, 3] = infer[0, 3] = float("-inf")  # padding: -inf - -inf is NaN unless masked out before any arithmetic
    config = TrainInferCorrectionConfig(is_weight=TrainInferISWeightConfig(True, "sequence"),
                                        filters=[TrainInferFilterConfig(True, "geometric")])  # fmt: skip
    weight, keep, metrics = compute_train_infer_correction(config, MASK, old, infer)
    assert torch.isfinite(weight).all() and torch.isfinite(keep).all()
    token = compute_train_infer_correction(TrainInferCorrectionConfig(TrainInferISWeightConfig(True)), MASK, old, infer)
    assert torch.isfinite(token[0]).all()
    assert all(math.isfinite(value) for value in metrics.values())


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (TrainInferCorrectionConfig(TrainInferISWeightConfig(True, "turn")), r"is_weight\.weight_type='turn'"),
        (TrainInferCorrectionConfig(TrainInferISWeightConfig(True, upper_bound=0)), r"is_weight\.upper_bound=0"),
        (TrainInferCorrectionConfig(filters=[TrainInferFilterConfig(True, "row")]), r"filters\[0\]\.agg_type='row'"),
        (TrainInferCorrectionConfig(filters=[TrainInferFilterConfig(True, ratio_low=1.5, ratio_high=1.2)]),
         r"filters\[0\]\.ratio_low=1\.5 exceeds .*ratio_high=1\.2"),
    ],
)  # fmt: skip
def test_bad_values_name_the_key(config, message):
    with pytest.raises(ValueError, match=message):
        config.validate()
