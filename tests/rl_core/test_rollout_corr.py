"""verl 0.9.1's rollout correction in rl_core.rollout_corr: the numbers verl's own tests pin
(tests/trainer/ppo/test_rollout_corr*.py), numbers verl 0.9.1's helper produces for the same inputs, and cases
worked by hand. Inputs are written out; expected values are verl's or derived in the comments."""

from __future__ import annotations

import math

import pytest
import torch

from rl_core.losses.policy_bypass import compute_policy_loss_bypass_mode
from rl_core.rollout_corr import (
    RS_OPTIONS,
    ISBounds,
    RSBounds,
    offpolicy_metrics,
    parse_is_threshold,
    parse_rs,
    rejection_mask,
    rollout_correction,
    rollout_correction_weights,
)
from rl_core.rollout_corr_config import PRESETS

# verl's extra reference inputs: log ratio [[0.2, -0.5, pad], [-0.7, 0, 0]]
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0]])
ROLLOUT = torch.tensor([[-1.2, -1.5, -0.5], [-0.3, -1.0, -1.0]])
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.float32)


def close(got: torch.Tensor, expected: list, atol: float = 1e-6) -> None:
    torch.testing.assert_close(got, torch.tensor(expected, dtype=got.dtype), atol=atol, rtol=0)


def test_verls_mask_mode_case_token_tis_with_token_k1_rejection():
    """verl test_mask_mode: ratios exp(-1) and exp(0.5); "0.5_2.0" bounds pi_rollout / pi_train in [0.5, 2]."""
    old = torch.full((2, 5), -2.0)
    rollout = torch.tensor([[-1.0] * 5, [-2.5] * 5])
    mask = torch.ones(2, 5)
    weights, factor = rollout_correction_weights(old - rollout, mask, "token", 2.0)
    assert factor is None
    assert weights[0, 0] == pytest.approx(math.exp(-1.0), abs=1e-6) and weights[1, 0] == pytest.approx(math.exp(0.5))
    kept = rejection_mask(old - rollout, mask, "token_k1", "0.5_2.0")
    assert kept.tolist() == [[0.0] * 5, [1.0] * 5]  # exp(k1) = e^1 > 2 rejected; e^-0.5 in [0.5, 2] kept
    assert bool((weights[0] > 0).all())  # a rejected token keeps its weight: rejection lives in the mask only


def test_icepop_zeroes_weights_outside_its_band_and_leaves_the_mask():
    """verl test_exact_icepop_zeroes_weights_without_changing_mask: ratios 0.4, 0.8, 6.0 in "0.5_5.0"."""
    log_ratio = torch.log(torch.tensor([[0.4, 0.8, 6.0]]))
    weights, _ = rollout_correction_weights(log_ratio, torch.ones(1, 3), "token", "0.5_5.0")
    close(weights, [[0.0, 0.8, 0.0]])


def test_icepop_weights_of_verls_integration_case():
    """verl test_exact_icepop_matches_filtered_weighted_ppo_loss: log ratios -0.5, 2.5, -0.2."""
    old, rollout = torch.tensor([[-1.0, -1.0, -1.0]]), torch.tensor([[-0.5, -3.5, -0.8]])
    weights, _ = rollout_correction_weights(old - rollout, torch.ones(1, 3), "token", "0.5_5.0")
    close(weights, [[0.60653067, 0.0, 0.81873075]])


def test_token_tis_weights_ignore_padding_and_truncate():
    weights, _ = rollout_correction_weights(OLD - ROLLOUT, MASK, "token", 1.5)
    close(weights, [[1.221403, 0.606531, 0.0], [0.496585, 1.0, 1.0]])


def test_sequence_weights_with_batch_normalisation():
    """Rows' sums 0.2 - 0.5 = -0.3 and -0.7: weights e^-0.3, e^-0.7; each non-empty row's mean counts once:
    factor (0.740818 + 0.496585) / 2 = 0.618702 (verl's helper: the same)."""
    weights, factor = rollout_correction_weights(OLD - ROLLOUT, MASK, "sequence", 1.5, rollout_is_batch_normalize=True)
    assert factor == pytest.approx(0.618702, abs=1e-6)
    close(weights, [[1.197375, 1.197375, 0.0], [0.802625, 0.802625, 0.802625]])


def test_token_batch_normalisation_is_the_mean_over_real_tokens():
    log_ratio = torch.log(torch.tensor([[1.0, 3.0], [2.0, 9.0]]))
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    weights, factor = rollout_correction_weights(log_ratio, mask, "token", 10.0, rollout_is_batch_normalize=True)
    assert factor == pytest.approx(2.0, rel=1e-6)  # (1 + 3 + 2) / 3; the padded 9 does not count
    close(weights, [[0.5, 1.5], [1.0, 0.0]])


def test_combined_rejection_options_every_one_must_keep_a_token():
    """verl's helper on these inputs: token IcePop "0.7_1.5" with seq_sum_k1 "0.5_1.6" and token_k3 0.1 ->
    weights [[1.221403, 0, 0], [0, 1, 1]], mask [[1, 0, 0], [0, 0, 0]]."""
    weights, _ = rollout_correction_weights(OLD - ROLLOUT, MASK, "token", "0.7_1.5")
    close(weights, [[1.221403, 0.0, 0.0], [0.0, 1.0, 1.0]])
    kept = rejection_mask(OLD - ROLLOUT, MASK, "seq_sum_k1,token_k3", "0.5_1.6,0.1")
    assert kept.tolist() == [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    # row 0: sum of k1 = 0.3, exp 1.35 in [0.5, 1.6]: kept; its k3 of l=-0.5 is 0.1065 > 0.1: token 1 rejected.
    # row 1: sum of k1 = 0.7, exp 2.01 > 1.6: the whole row rejected.


def test_k1_bounds_pi_rollout_over_pi_train_as_verl_does():
    """verl's direction: "0.1_1.2" keeps train / rollout ratios in [1/1.2, 1/0.1] = [0.833, 10]."""
    ratios = torch.tensor([[0.5, 0.9, 1.1, 1.5, 5.0, 12.0]])
    kept = rejection_mask(ratios.log(), torch.ones(1, 6), "token_k1", "0.1_1.2")
    assert kept.tolist() == [[0.0, 1.0, 1.0, 1.0, 1.0, 0.0]]
    one_value = rejection_mask(ratios.log(), torch.ones(1, 6), "token_k1", 2.0)  # u = 2: ratios in [0.5, 2]
    assert one_value.tolist() == [[1.0, 1.0, 1.0, 1.0, 0.0, 0.0]]


def test_sequence_statistics_by_hand():
    """Row 0 log ratios (0.2, -0.5), row 1 (-0.7, 0, 0). k2 = l^2 / 2: row 0 (0.02, 0.125): sum 0.145, mean 0.0725,
    max 0.125; row 1 (0.245, 0, 0): sum 0.245, mean 0.0817, max 0.245."""
    log_ratio = OLD - ROLLOUT
    cases = {("seq_sum_k2", 0.2): [1, 0], ("seq_mean_k2", 0.08): [1, 0], ("seq_max_k2", 0.2): [1, 0],
             ("seq_max_k2", 0.1): [0, 0], ("seq_mean_k2", 0.09): [1, 1]}  # fmt: skip
    for (option, bound), rows in cases.items():
        kept = rejection_mask(log_ratio, MASK, option, bound)
        assert kept.tolist() == [[rows[0]] * 2 + [0], [rows[1]] * 3], option
    # seq_mean_k1 is the geometric mean of pi_rollout / pi_train: row 0 exp(0.15) = 1.16, row 1 exp(0.233) = 1.26
    assert rejection_mask(log_ratio, MASK, "seq_mean_k1", "0.9_1.2")[:, 0].tolist() == [1.0, 0.0]


def test_padding_never_decides_and_nan_in_a_real_token_is_rejected():
    log_ratio = torch.tensor([[0.1, math.nan], [math.nan, 0.1]])
    mask = torch.tensor([[True, False], [True, True]])
    for option in RS_OPTIONS:
        bound = "0.5_2.0" if option.endswith("k1") else 5.0
        kept = rejection_mask(log_ratio, mask, option, bound)
        assert kept.dtype == torch.bool and kept[0, 0] and not kept[1, 0], option
        assert kept[1, 1] == option.startswith("token"), option  # a sequence option rejects the NaN's row
    weights, _ = rollout_correction_weights(log_ratio, mask, "token", 2.0)
    assert weights[0, 1] == 0.0 and math.isnan(weights[1, 0])  # padding 0; a real NaN propagates (as in verl)


def test_offpolicy_metrics_equal_verls():
    got = offpolicy_metrics(OLD, ROLLOUT, MASK)
    expected = {"training_ppl": 3.599985, "training_log_ppl": 1.25, "kl": 0.2, "k3_kl": 0.064904,
                "rollout_ppl": 3.005002, "rollout_log_ppl": 1.058333, "log_ppl_diff": 0.191667,
                "log_ppl_abs_diff": 0.191667, "log_ppl_diff_max": 0.233333, "log_ppl_diff_min": 0.15,
                "ppl_ratio": 1.212318, "chi2_token": -0.17874, "chi2_seq": -0.602296}  # fmt: skip
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, abs=2e-6), name
    icepop = offpolicy_metrics(torch.zeros(1, 3), -torch.log(torch.tensor([[0.4, 0.8, 6.0]])), torch.ones(1, 3))
    assert icepop["kl"] == pytest.approx(-0.217442, abs=1e-6) and icepop["chi2_seq"] == pytest.approx(2.686401)
    assert set(offpolicy_metrics(OLD, None, MASK)) == {"training_ppl", "training_log_ppl"}
    with pytest.raises(ValueError, match="at least one valid token"):
        offpolicy_metrics(OLD, ROLLOUT, torch.zeros_like(MASK))


def test_thresholds_parse_as_verl_does_and_bad_ones_name_the_key():
    assert parse_is_threshold(2) == ISBounds(2.0) and parse_is_threshold(" 0.5_5.0 ") == ISBounds(5.0, 0.5)
    assert parse_is_threshold("0.5") == ISBounds(0.5)  # an upper bound below 1 is allowed (verl)
    assert parse_rs("token_k1, seq_max_k3 ,token_k1", "0.4_1.8,3.0") == [
        RSBounds("token_k1", 1.8, 0.4), RSBounds("seq_max_k3", 3.0)]  # fmt: skip
    assert parse_rs("token_k1", 1.3) == [RSBounds("token_k1", 1.3, 1 / 1.3)]
    with pytest.raises(TypeError, match="not a boolean"):
        parse_is_threshold(True)
    for spec in ("5.0_0.5", "0_2", "-1", "abc"):
        with pytest.raises(ValueError, match="rollout_is_threshold"):
            parse_is_threshold(spec)
    bad = [("token_k4", 1.0, "Invalid rollout_rs option"), ("token_k2", "0.5_2", "no '_'"),
           ("token_k1,token_k2", "1,2,3", "3 specs for 2 options"), ("token_k1", None, "needs rollout_rs_threshold"),
           ("seq_sum_k1", "2_1", "lower <= upper"), (" , ", 1.0, "names no option")]  # fmt: skip
    for options, threshold, message in bad:
        with pytest.raises(ValueError, match=message):
            parse_rs(options, threshold)


def test_presets_set_every_key_as_verls():
    keys = {"rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs", "rollout_rs_threshold",
            "bypass_mode", "loss_type"}  # fmt: skip
    assert len(PRESETS) == 19 and all(set(values) == keys for values in PRESETS.values())
    icepop = PRESETS["decoupled_token_icepop"]
    assert (icepop["rollout_is"], icepop["rollout_is_threshold"]) == ("token", "0.5_5.0")
    assert PRESETS["bypass_pg_geo_rs_token_tis"] == {
        "rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": False,
        "rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.999_1.001", "bypass_mode": True,
        "loss_type": "reinforce"}  # fmt: skip
    assert PRESETS["decoupled_k3_rs"]["rollout_rs_threshold"] == 0.01 and not PRESETS["disabled"]["bypass_mode"]


def metrics_of(**keys) -> dict[str, float]:
    _, _, metrics = rollout_correction(OLD, ROLLOUT, MASK, **keys)
    return {name.removeprefix("rollout_corr/"): value for name, value in metrics.items()}


def assert_metrics(got: dict[str, float], expected: dict[str, float]) -> None:
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, abs=2e-6), name


def test_token_is_metrics_equal_verls():
    got = metrics_of(rollout_is="token", rollout_is_threshold=1.5)
    assert_metrics(got, {"rollout_is_mean": 0.864904, "rollout_is_max": 1.221403, "rollout_is_min": 0.496585,
                         "rollout_is_ratio_fraction_high": 0.0, "rollout_is_ratio_fraction_low": 0.4,
                         "rollout_is_std": 0.270558, "rollout_is_eff_sample_size": 0.910867,
                         "rollout_is_seq_mean": 0.873081, "rollout_is_seq_std": 0.057821,
                         "rollout_is_seq_max": 0.913967, "rollout_is_seq_min": 0.832195,
                         "rollout_is_seq_max_deviation": 0.167805, "rollout_is_seq_fraction_high": 0.0,
                         "rollout_is_seq_fraction_low": 0.0, "kl": 0.2, "chi2_seq": -0.602296})  # fmt: skip
    assert "rollout_is_oob_ratio" not in got and "rollout_is_batch_norm_factor" not in got


def test_sequence_is_metrics_with_batch_normalisation_equal_verls():
    got = metrics_of(rollout_is="sequence", rollout_is_threshold=1.5, rollout_is_batch_normalize=True)
    assert_metrics(got, {"rollout_is_max": 0.740818, "rollout_is_min": 0.496585, "rollout_is_mean": 0.594279,
                         "rollout_is_ratio_fraction_high": 0.0, "rollout_is_ratio_fraction_low": 0.5,
                         "rollout_is_std": 0.119649, "rollout_is_eff_sample_size": 0.961043,
                         "rollout_is_seq_mean": 0.618702, "rollout_is_seq_std": 0.172699,
                         "rollout_is_seq_max": 0.740818, "rollout_is_seq_min": 0.496585,
                         "rollout_is_seq_max_deviation": 0.503415, "rollout_is_seq_fraction_high": 0.0,
                         "rollout_is_seq_fraction_low": 0.5, "rollout_is_batch_norm_factor": 0.618702})  # fmt: skip


def test_icepop_and_rejection_metrics_equal_verls():
    keys = {"rollout_is": "token", "rollout_is_threshold": "0.7_1.5", "rollout_rs": "seq_sum_k1,token_k3",
            "rollout_rs_threshold": "0.5_1.6,0.1"}  # fmt: skip
    weights, kept, metrics = rollout_correction(OLD, ROLLOUT, MASK, **keys)
    assert kept.tolist() == [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]] and weights is not None
    got = {name.removeprefix("rollout_corr/"): value for name, value in metrics.items()}
    assert_metrics(got, {
        "rollout_is_mean": 0.644281, "rollout_is_min": 0.0, "rollout_is_std": 0.532229,
        "rollout_is_eff_sample_size": 0.594385, "rollout_is_oob_ratio": 0.4, "rollout_is_seq_mean": 0.638684,
        "rollout_is_seq_std": 0.039573, "rollout_is_seq_max": 0.666667, "rollout_is_seq_min": 0.610701,
        "rollout_rs_seq_sum_k1_mean": 0.54, "rollout_rs_seq_sum_k1_max": 0.7, "rollout_rs_seq_sum_k1_min": 0.3,
        "rollout_rs_seq_sum_k1_fraction_high": 0.5, "rollout_rs_seq_sum_k1_fraction_low": 0.0,
        "rollout_rs_seq_sum_k1_std": 0.083284, "rollout_rs_seq_sum_k1_seq_mean": 0.5,
        "rollout_rs_seq_sum_k1_seq_std": 0.282843, "rollout_rs_seq_sum_k1_seq_fraction_high": 0.5,
        "rollout_rs_seq_sum_k1_seq_fraction_low": 0.0, "rollout_rs_seq_sum_k1_masked_fraction": 0.6,
        "rollout_rs_seq_sum_k1_seq_masked_fraction": 0.5,
        "rollout_rs_token_k3_mean": 0.064904, "rollout_rs_token_k3_max": 0.196585, "rollout_rs_token_k3_min": 0.0,
        "rollout_rs_token_k3_fraction_high": 0.4, "rollout_rs_token_k3_std": 0.046161,
        "rollout_rs_token_k3_seq_mean": 0.064748, "rollout_rs_token_k3_seq_std": 0.001104,
        "rollout_rs_token_k3_seq_max": 0.065528, "rollout_rs_token_k3_seq_min": 0.063967,
        "rollout_rs_token_k3_seq_fraction_high": 0.0, "rollout_rs_token_k3_masked_fraction": 0.4,
        "rollout_rs_token_k3_seq_masked_fraction": 1.0,
        "rollout_rs_masked_fraction": 0.8, "rollout_rs_seq_masked_fraction": 1.0,
    })  # fmt: skip
    assert "rollout_rs_token_k3_seq_fraction_low" not in got  # k2 / k3 options have no lower bound


def test_sequence_options_alone_count_rejected_rows_by_their_tokens():
    """With only sequence options the statistics come from the rows (each weighed by its token count) instead of a
    pass over the tokens; they equal the token path's. seq_sum_k1 = -sum(l): 0.3 for row 0 (kept by "0.5_1.6", whose
    log bounds are -0.69 and 0.47), 0.7 for row 1 (rejected, 3 tokens); an empty third row is never rejected but
    counts in the overall sequence fraction (every row, as verl)."""
    old, rollout = torch.cat([OLD, OLD[:1]]), torch.cat([ROLLOUT, ROLLOUT[:1]])
    mask = torch.cat([MASK, torch.zeros(1, 3)])
    keys = {"rollout_rs": "seq_sum_k1", "rollout_rs_threshold": "0.5_1.6"}
    high = math.log(1.6)
    _, kept, rows = rollout_correction(old, rollout, mask, **keys)
    assert kept.tolist() == [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    got = {name.removeprefix("rollout_corr/"): value for name, value in rows.items()}
    assert_metrics(got, {
        "rollout_rs_masked_fraction": 0.6, "rollout_rs_seq_masked_fraction": 1 / 3,
        "rollout_rs_seq_sum_k1_masked_fraction": 0.6, "rollout_rs_seq_sum_k1_seq_masked_fraction": 0.5,
        "rollout_rs_seq_sum_k1_mean": (2 * 0.3 + 3 * 0.7) / 5,
        "rollout_rs_seq_sum_k1_std": math.sqrt((2 * 0.3**2 + 3 * high**2) / 5 - ((2 * 0.3 + 3 * high) / 5) ** 2),
    })  # fmt: skip  # the std clamps row 1's 0.7 to the upper bound
    # a token option that keeps every token sends the overall statistics through the token path: the same numbers
    _, kept_too, tokens = rollout_correction(old, rollout, mask, rollout_rs="seq_sum_k1,token_k2",
                                             rollout_rs_threshold="0.5_1.6,100.0")  # fmt: skip
    assert torch.equal(kept_too, kept)
    for name, value in rows.items():
        assert tokens[name] == pytest.approx(value, abs=1e-12), name


def test_verls_pinned_metric_values():
    """verl's tests: IcePop std / ESS / out-of-band ratio; token_k1 rejection's masked fraction; the sequence
    fraction above the bound from raw per-row means; the sequence max over every row (an empty one gives 1)."""
    _, _, icepop = rollout_correction(torch.zeros(1, 3), -torch.log(torch.tensor([[0.4, 0.8, 6.0]])),
                                      torch.ones(1, 3), rollout_is="token", rollout_is_threshold="0.5_5.0")  # fmt: skip
    assert icepop["rollout_corr/rollout_is_oob_ratio"] == pytest.approx(2 / 3, abs=1e-6)
    assert icepop["rollout_corr/rollout_is_std"] == pytest.approx(0.3771236, abs=1e-6)
    assert icepop["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(1 / 3, abs=1e-6)
    old, rollout = torch.full((2, 5), -2.0), torch.tensor([[-1.0] * 5, [-2.5] * 5])
    _, _, rejected = rollout_correction(old, rollout, torch.ones(2, 5), rollout_is="token", rollout_rs="token_k1",
                                        rollout_rs_threshold="0.5_2.0")  # fmt: skip
    assert rejected["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(0.5, abs=1e-6)
    raw = torch.tensor([[1.0, 6.0], [0.9, 1.1]])
    _, _, fractions = rollout_correction(raw.log(), torch.zeros(2, 2), torch.ones(2, 2), rollout_is="token")
    assert fractions["rollout_corr/rollout_is_seq_fraction_high"] == 0.5  # row means 3.5 and 1.0 against 2.0
    one_row = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    _, _, seq = rollout_correction(OLD, ROLLOUT, one_row, rollout_is="sequence", rollout_is_threshold=1.5)
    assert seq["rollout_corr/rollout_is_max"] == 1.0 and seq["rollout_corr/rollout_is_seq_min"] == 0.0


def test_no_correction_asked_gives_no_weights_the_same_mask_and_off_policy_metrics():
    weights, kept, metrics = rollout_correction(OLD, ROLLOUT, MASK)
    assert weights is None and torch.equal(kept, MASK)
    assert set(metrics) == {f"rollout_corr/{name}" for name in offpolicy_metrics(OLD, ROLLOUT, MASK)}
    every = ",".join(RS_OPTIONS)
    _, _, all_options = rollout_correction(OLD, ROLLOUT, MASK, rollout_rs=every, rollout_rs_threshold="2.0")
    assert all(f"rollout_corr/rollout_rs_{option}_mean" in all_options for option in RS_OPTIONS)
    with pytest.raises(ValueError, match="at least one valid token"):
        rollout_correction(OLD, ROLLOUT, torch.zeros_like(MASK), rollout_is="token")
    with pytest.raises(ValueError, match="must have one shape"):
        rollout_correction(OLD, ROLLOUT[:, :2], MASK)
    _, _, zeroed = rollout_correction(torch.zeros(1, 2), torch.tensor([[-3.0, 3.0]]), torch.ones(1, 2),
                                      rollout_is="token", rollout_is_threshold="0.5_2.0")  # fmt: skip
    assert zeroed["rollout_corr/rollout_is_eff_sample_size"] == 0.0  # verl divides by zero here


def bypass(loss_type: str, **keys):
    from rl_core.losses import PolicyLossConfig
    from rl_core.rollout_corr_config import RolloutCorrectionConfig

    correction = RolloutCorrectionConfig(bypass_mode=True, loss_type=loss_type, **keys)
    correction.validate()
    return PolicyLossConfig(rollout_correction=correction)


def test_bypass_reinforce_is_the_weighted_policy_gradient_by_hand():
    """log_prob (-1, -2) against rollout (-1.5, -2): token weights (e^0.5, 1); loss mean(-A log_prob w)."""
    log_prob = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    rollout, advantages = torch.tensor([[-1.5, -2.0]]), torch.tensor([[1.0, 2.0]])
    loss, metrics = compute_policy_loss_bypass_mode(rollout, log_prob, advantages, torch.ones(1, 2),
                                                    config=bypass("reinforce", rollout_is="token"))  # fmt: skip
    assert float(loss) == pytest.approx((math.exp(0.5) * 1.0 + 4.0) / 2, rel=1e-6)
    loss.backward()
    close(log_prob.grad, [[-math.exp(0.5) / 2, -1.0]])  # d/d log_prob of -A w log_prob / n, w detached
    assert float(metrics["ppo_kl"]) == pytest.approx(-0.25) and float(metrics["rollout_corr/kl"]) == -0.25


def test_bypass_ppo_clip_is_vanilla_ppo_against_the_rollout_policy_on_the_kept_tokens():
    from rl_core.losses import get_policy_loss

    gen = torch.Generator().manual_seed(0)
    rollout = -torch.rand(3, 4, generator=gen) - 0.5
    log_prob = rollout + 0.4 * torch.randn(3, 4, generator=gen)
    advantages, mask = torch.randn(3, 4, generator=gen), torch.ones(3, 4)
    config = bypass("ppo_clip", rollout_is="token", rollout_rs="token_k2", rollout_rs_threshold=0.05)
    loss, metrics = compute_policy_loss_bypass_mode(rollout, log_prob, advantages, mask, config=config)
    kept = rejection_mask(log_prob - rollout, mask, "token_k2", 0.05)
    assert 0 < float(kept.sum()) < 12  # some tokens rejected, some kept
    expected, _ = get_policy_loss("vanilla")(rollout, log_prob, advantages, kept, config=config)
    assert float(loss) == pytest.approx(float(expected), rel=1e-6)  # IS weights computed, not applied
    assert "rollout_corr/rollout_is_mean" in metrics and "pg_clipfrac" in metrics


def test_bypass_mode_without_its_config_is_refused():
    from rl_core.losses import PolicyLossConfig
    from rl_core.rollout_corr_config import RolloutCorrectionConfig

    args = (torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2))
    with pytest.raises(ValueError, match="needs the rollout correction config with bypass_mode: true"):
        compute_policy_loss_bypass_mode(*args, config=PolicyLossConfig())
    with pytest.raises(ValueError, match="computes its own IS weights"):
        compute_policy_loss_bypass_mode(*args, config=bypass("reinforce"), rollout_is_weights=torch.ones(1, 2))
    with pytest.raises(ValueError, match=r"rollout_correction\.loss_type='pg'"):
        RolloutCorrectionConfig(loss_type="pg").validate()
    with pytest.raises(ValueError, match=r"rollout_correction: Invalid rollout_rs option"):
        RolloutCorrectionConfig(rollout_rs="k9", rollout_rs_threshold=1.0).validate()
    assert RolloutCorrectionConfig.preset("bypass_pg_is") == RolloutCorrectionConfig(
        rollout_is="sequence", bypass_mode=True, loss_type="reinforce")  # fmt: skip


def test_bypass_on_a_micro_batch_without_a_real_token_trains_on_nothing_without_failing():
    args = (torch.zeros(2, 3), torch.zeros(2, 3, requires_grad=True), torch.ones(2, 3), torch.zeros(2, 3))
    for loss_type in ("ppo_clip", "reinforce"):
        loss, metrics = compute_policy_loss_bypass_mode(*args, config=bypass(loss_type, rollout_is="token"))
        assert float(loss) == 0.0 and not any(name.startswith("rollout_corr/") for name in metrics)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_log_probs_give_the_float32_numbers_to_their_precision(dtype):
    """e^20, the bound of an exp of a clamped log ratio, lies beyond float16's range: the correction still runs there
    (its bound is then infinity, as exp(20) is in float16) and agrees with float32 on values both represent."""
    g = torch.Generator().manual_seed(0)
    old = (torch.randn(4, 16, generator=g) * 0.5 - 2.0).to(dtype)
    rollout = (old.float() + 0.1 * torch.randn(4, 16, generator=g)).to(dtype)
    mask = torch.arange(16).unsqueeze(0) < torch.tensor([[16], [9], [1], [12]])
    keys = {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "token_k3,seq_mean_k3",
            "rollout_rs_threshold": "1.0,0.5"}  # fmt: skip
    weights, kept, half = rollout_correction(old, rollout, mask, **keys)
    weights32, kept32, full = rollout_correction(old.float(), rollout.float(), mask, **keys)
    assert weights is not None and weights.dtype == dtype and torch.equal(kept, kept32)
    torch.testing.assert_close(weights.float(), weights32, rtol=1e-2, atol=1e-3)
    assert half.keys() == full.keys()
    for name, value in full.items():
        assert half[name] == pytest.approx(value, rel=2e-2, abs=2e-3), name
    old[0, 0], rollout[0, 1] = -30.0, -30.0  # log ratios of +-28: exp overflows float16, the weights are truncated
    weights, _, _ = rollout_correction(old, rollout, mask, **keys)
    assert weights is not None and weights[0, 1] == 2.0 and weights[0, 0] < 1e-7


def test_values_without_spread_have_a_std_of_exactly_zero_as_in_verl():
    """On-policy (every weight 1, every divergence 0) and every weight / statistic clamped to one bound: verl's
    float32 ``count + 1e-8`` is the count, so these stds are 0.0 there. Dividing the float64 moments by
    ``count + 1e-8`` instead left |x| sqrt(1e-8 / N) (measured 1.1e-6 for rollout_is_std at 64 x 256)."""
    old = torch.full((64, 256), -1.0)
    mask = torch.ones(64, 256)
    mask[0, 100:] = 0  # rows of different lengths
    on_policy = {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "token_k2,seq_sum_k2",
                 "rollout_rs_threshold": 1.0}  # fmt: skip
    _, _, metrics = rollout_correction(old, old.clone(), mask, **on_policy, fused=False)
    clamped = {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "token_k2,seq_sum_k2",
               "rollout_rs_threshold": 0.1}  # fmt: skip
    # log ratio 3 everywhere: every weight truncated at 2, every k2 (4.5) above its bound 0.1, every row's sum too
    _, _, clamped_metrics = rollout_correction(old, old - 3.0, mask, **clamped, fused=False)
    for got in (metrics, clamped_metrics):
        for name in ("rollout_is_std", "rollout_rs_token_k2_std", "rollout_rs_seq_sum_k2_std"):
            assert got[f"rollout_corr/{name}"] == 0.0, name
    assert clamped_metrics["rollout_corr/rollout_is_mean"] == pytest.approx(2.0)  # the means keep verl's 1e-8
