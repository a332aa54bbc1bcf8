"""Hand-computed values and gradients for every registered policy loss, plus shared invariants."""

import math

import pytest
import torch

from rl_core.losses import POLICY_LOSSES, GlobalBatchInfo, PolicyLossConfig, get_policy_loss

LN = math.log


def run(name, old, logp, adv, mask=None, **kwargs):
    logp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    old = torch.tensor(old, dtype=torch.float64)
    adv = torch.tensor(adv, dtype=torch.float64)
    mask = torch.ones_like(old, dtype=torch.bool) if mask is None else torch.tensor(mask, dtype=torch.bool)
    loss, metrics = get_policy_loss(name)(old, logp, adv, mask, **kwargs)
    loss.backward()
    return loss.item(), logp.grad, {k: float(v) for k, v in metrics.items()}


def test_vanilla_clip_both_sides():
    # ratios 1.5 / 0.5 / 1.1 with eps 0.2: -1.2 (clipped), 0.8 (clipped), -2.2 (not clipped)
    loss, grad, m = run("vanilla", [[0.0, 0.0, 0.0]], [[LN(1.5), LN(0.5), LN(1.1)]], [[1.0, -1.0, 2.0]])
    assert loss == pytest.approx((-1.2 + 0.8 - 2.2) / 3, abs=1e-12)
    assert m["pg_clipfrac"] == pytest.approx(2 / 3)
    assert m["pg_clipfrac_lower"] == 0.0
    # only the unclipped token has a gradient: d(-A r)/d log p = -A r, divided by 3 tokens
    assert grad.flatten().tolist() == pytest.approx([0.0, 0.0, -2.0 * 1.1 / 3], abs=1e-12)


def test_vanilla_dual_clip_caps_negative_advantage():
    # ratio 5, A = -1: surrogate max(5, 1.2) = 5 is capped at c * |A| = 3
    loss, grad, m = run("vanilla", [[0.0]], [[LN(5.0)]], [[-1.0]])
    assert loss == pytest.approx(3.0)
    assert m["pg_clipfrac_lower"] == 1.0
    assert grad.item() == 0.0
    loss, _, m = run("vanilla", [[0.0]], [[LN(5.0)]], [[-1.0]], config=PolicyLossConfig(clip_ratio_c=None))
    assert loss == pytest.approx(5.0)
    assert m["pg_clipfrac_lower"] == 0.0


def test_vanilla_asymmetric_clip_higher():
    cfg = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28)
    loss, _, _ = run("vanilla", [[0.0]], [[LN(1.5)]], [[1.0]], config=cfg)
    assert loss == pytest.approx(-1.28)


def test_gspo_sequence_ratio():
    # log ratios 0.1 and 0.3: sequence ratio exp(0.2) = 1.2214 > 1.2, so A=+1 is clipped to -1.2
    loss, grad, m = run("gspo", [[0.0, 0.0]], [[0.1, 0.3]], [[1.0, 1.0]])
    assert loss == pytest.approx(-1.2)
    assert m["pg_clipfrac"] == 1.0
    assert grad.abs().max().item() == 0.0
    # A=-1 keeps the unclipped branch; each token's gradient is -A * s / T with seq-mean-token-mean
    loss, grad, _ = run("gspo", [[0.0, 0.0]], [[0.1, 0.3]], [[-1.0, -1.0]])
    s = math.exp(0.2)
    assert loss == pytest.approx(s)
    assert grad.flatten().tolist() == pytest.approx([s / 2, s / 2], abs=1e-12)


def test_sequence_ppo_clips_one_ratio_per_sequence_as_rolls_importance_sampling_seq():
    # log ratios 0.1 and 0.3: one ratio exp(0.2) = 1.2214 for both tokens; A=+1 clipped to 1.2 (no gradient)
    loss, grad, m = run("sequence_ppo", [[0.0, 0.0]], [[0.1, 0.3]], [[1.0, 1.0]])
    assert loss == pytest.approx(-1.2)
    assert m["pg_clipfrac"] == 1.0 and grad.abs().max().item() == 0.0
    # A=-1 (unclipped): the gradient of s = exp(mean log ratio) reaches each token as s / T, averaged over T tokens
    loss, grad, _ = run("sequence_ppo", [[0.0, 0.0]], [[0.1, 0.3]], [[-1.0, -1.0]])
    s = math.exp(0.2)
    assert loss == pytest.approx(s)
    assert grad.flatten().tolist() == pytest.approx([s / 2, s / 2], abs=1e-12)
    # advantages that vary over the sequence: every token's loss moves both tokens (gspo's do not)
    _, grad, _ = run("sequence_ppo", [[0.0, 0.0]], [[0.0, 0.0]], [[-1.0, 0.0]])
    assert grad.flatten().tolist() == pytest.approx([0.25, 0.25], abs=1e-12)
    _, grad, _ = run("gspo", [[0.0, 0.0]], [[0.0, 0.0]], [[-1.0, 0.0]], loss_agg_mode="token-mean")
    assert grad.flatten().tolist() == pytest.approx([0.5, 0.0], abs=1e-12)


def test_segment_ppo_clips_one_ratio_per_turn_as_rolls_ratio_type_segment():
    # two turns with environment text (masked) between: log ratios 0.1, 0.3 | - | 0.0, 0.2 -> ratios exp(0.2) =
    # 1.2214 (A=+1: clipped to 1.2, no gradient) and exp(0.1) = 1.1052 (unclipped), each shared by its turn's tokens
    mask = [[1, 1, 0, 1, 1]]
    loss, grad, m = run("segment_ppo", [[0.0] * 5], [[0.1, 0.3, 9.0, 0.0, 0.2]], [[1.0] * 5], mask)
    r = math.exp(0.1)
    assert loss == pytest.approx(-(1.2 + 1.2 + r + r) / 4)
    assert m["pg_clipfrac"] == pytest.approx(0.5)
    # d/d logp of -A exp(mean of 2) over 4 tokens: r / 2 per token of the second turn, summed over its 2 tokens
    assert grad.flatten().tolist() == pytest.approx([0.0, 0.0, 0.0, -r / 4, -r / 4], abs=1e-12)
    # one turn per row: sequence_ppo
    args = ([[0.0, 0.0, 0.0]], [[0.1, -0.2, 0.4]], [[-1.0, 0.5, 2.0]], [[1, 1, 0]])
    assert run("segment_ppo", *args)[0] == pytest.approx(run("sequence_ppo", *args)[0], abs=1e-12)
    assert torch.allclose(run("segment_ppo", *args)[1], run("sequence_ppo", *args)[1], atol=1e-12)


def test_gpg_is_plain_policy_gradient():
    loss, grad, _ = run("gpg", [[0.0, 0.0]], [[-1.0, -2.0]], [[2.0, -1.0]])
    assert loss == pytest.approx((2.0 * 1.0 + (-1.0) * 2.0) / 2)
    assert grad.flatten().tolist() == pytest.approx([-1.0, 0.5])


def test_clip_cov_detaches_the_high_covariance_token():
    # A centred [3.5, -.5, -.5, -2.5], log p centred [1, 0, 0, -1] -> cov [3.5, 0, 0, 2.5]; window (3, 5)
    logp = [[-1.0, -2.0, -2.0, -3.0]]
    cfg = PolicyLossConfig(clip_cov_lb=3.0, clip_cov_ub=5.0, seed=0)
    loss, grad, m = run("clip_cov", logp, logp, [[4.0, 0.0, 0.0, -2.0]], config=cfg)
    assert loss == pytest.approx(-(4.0 - 2.0) / 4)
    assert grad.flatten().tolist() == pytest.approx([0.0, 0.0, 0.0, 0.5])
    assert m["pg_clipfrac"] == pytest.approx(0.25)


def test_kl_cov_penalises_the_top_covariance_token():
    logp = [[-1.0, -2.0, -2.0, -3.0]]
    old = [[-1.1, -2.0, -2.0, -3.0]]  # log ratio 0.1 on token 0
    cfg = PolicyLossConfig(kl_cov_ratio=0.25, ppo_kl_coef=1.0)
    loss, _, m = run("kl_cov", old, logp, [[4.0, 0.0, 0.0, -2.0]], config=cfg)
    assert loss == pytest.approx((-4.0 * math.exp(0.1) + 0.1 + 2.0) / 4)
    assert m["pg_clipfrac"] == pytest.approx(0.25)


def test_geo_mean_two_sequences():
    # seq 0: A=+1, log ratios [0.5, -0.1] -> pessimistic [0.4, -0.1]; seq 1: A=-1, [0.5, -0.6] -> [0.5, -0.4]
    loss, _, m = run("geo_mean", [[0.0, 0.0], [0.0, 0.0]], [[0.5, -0.1], [0.5, -0.6]], [[1.0, 1.0], [-1.0, -1.0]],
                     config=PolicyLossConfig(clip_ratio=0.4))  # fmt: skip
    expected = (-math.exp(0.15) + math.exp(0.05)) / 2
    assert loss == pytest.approx(expected, abs=1e-12)
    assert m["pg_clipfrac"] == pytest.approx(0.5)


def test_tis_truncates_detached_ratio():
    loss, grad, m = run("tis", [[0.0, 0.0]], [[LN(1.5), LN(0.5)]], [[1.0, 1.0]])
    assert loss == pytest.approx((-1.0 * LN(1.5) - 0.5 * LN(0.5)) / 2)
    assert grad.flatten().tolist() == pytest.approx([-0.5, -0.25])
    assert m["tis_upper_clipfrac"] == 0.5


def test_topr_positive_sft_negative_truncated():
    scores = torch.tensor([1.0, 0.0])
    loss, grad, m = run("topr", [[0.0], [0.0]], [[LN(2.0)], [LN(0.5)]], [[1.0], [-1.0]], sample_scores=scores)
    assert loss == pytest.approx((-LN(2.0) + 0.5 * LN(0.5)) / 2)  # A=-1: -(0.5)(-1)(ln .5)
    assert grad.flatten().tolist() == pytest.approx([-0.5, 0.25])
    assert m["topr_positive_fraction"] == 0.5


def test_topr_without_scores_uses_advantage_sign():
    with_scores = run(
        "topr", [[0.0], [0.0]], [[LN(2.0)], [LN(0.5)]], [[1.0], [-1.0]], sample_scores=torch.tensor([1, 0])
    )
    without = run("topr", [[0.0], [0.0]], [[LN(2.0)], [LN(0.5)]], [[1.0], [-1.0]])
    assert with_scores[0] == pytest.approx(without[0])


def test_cispo_clips_weight_not_gradient():
    loss, grad, _ = run("cispo", [[0.0, 0.0]], [[LN(1.5), LN(0.5)]], [[1.0, -1.0]])
    assert loss == pytest.approx((-1.1 * LN(1.5) + 0.9 * LN(0.5)) / 2)
    assert grad.flatten().tolist() == pytest.approx([-0.55, 0.45])
    loss, grad, m = run("cispo", [[0.0, 0.0]], [[LN(1.5), LN(0.5)]], [[1.0, -1.0]],
                        config=PolicyLossConfig(cispo_use_unified_mask=True))  # fmt: skip
    assert loss == 0.0 and m["cispo_masked_fraction"] == 1.0


def test_kimi15():
    loss, grad, _ = run("kimi15", [[-1.0, -1.0]], [[-0.8, -1.3]], [[1.0, -1.0]])
    assert loss == pytest.approx((0.8 + 0.05 * 0.04 + (-1.3) + 0.05 * 0.09) / 2)
    assert grad.flatten().tolist() == pytest.approx([(-1.0 + 0.1 * 0.2) / 2, (1.0 + 0.1 * -0.3) / 2])


def test_every_loss_has_a_hand_test():
    tested = {
        "vanilla",
        "sequence_ppo",
        "segment_ppo",
        "gspo",
        "gpg",
        "clip_cov",
        "kl_cov",
        "geo_mean",
        "tis",
        "topr",
        "cispo",
        "kimi15",
    }
    assert set(POLICY_LOSSES.names()) == tested


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_rollout_is_weights_scale_the_loss(name):
    """Weights of 2 on every token double the loss of each variant (its aggregation is linear)."""
    g = torch.Generator().manual_seed(3)
    old = torch.randn(4, 5, generator=g, dtype=torch.float64) - 2
    logp = old + 0.05 * torch.randn(4, 5, generator=g, dtype=torch.float64)
    adv = torch.randn(4, 5, generator=g, dtype=torch.float64)
    mask = torch.ones(4, 5, dtype=torch.bool)
    cfg = PolicyLossConfig(seed=0)
    base, _ = get_policy_loss(name)(old, logp, adv, mask, config=cfg)
    weighted, _ = get_policy_loss(name)(old, logp, adv, mask, config=cfg, rollout_is_weights=torch.full_like(old, 2.0))
    assert weighted.item() == pytest.approx(2 * base.item(), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_padding_garbage_never_reaches_loss_or_gradient(name):
    g = torch.Generator().manual_seed(5)
    old = torch.randn(3, 6, generator=g) - 2
    logp_clean = (old + 0.1 * torch.randn(3, 6, generator=g)).requires_grad_(True)
    adv = torch.randn(3, 6, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    pad = ~mask
    logp = torch.where(pad, torch.full_like(logp_clean, float("nan")), logp_clean)
    old_bad = torch.where(pad, torch.full_like(old, float("inf")), old)
    adv_bad = torch.where(pad, torch.full_like(adv, -float("inf")), adv)
    cfg = PolicyLossConfig(seed=0)
    loss, metrics = get_policy_loss(name)(old_bad, logp, adv_bad, mask, config=cfg)
    loss.backward()
    assert math.isfinite(loss.item())
    assert torch.isfinite(logp_clean.grad).all()
    assert (logp_clean.grad[pad] == 0).all()
    assert all(math.isfinite(float(v)) for v in metrics.values())


@pytest.mark.parametrize("name", sorted(set(POLICY_LOSSES.names()) - {"clip_cov", "kl_cov"}))
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batching_is_invariant(name, mode):
    """Loss and gradient of 1 x 8 equal those of 8 x 1 and of an uneven 3 + 5 split.
    (clip_cov / kl_cov select tokens by batch covariance, so they are batch-dependent by design.)"""
    g = torch.Generator().manual_seed(7)
    old = torch.randn(8, 6, generator=g, dtype=torch.float64) - 2
    logp = (old + 0.3 * torch.randn(8, 6, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(8, 6, generator=g, dtype=torch.float64)
    mask = torch.rand(8, 6, generator=g) > 0.3
    mask[4] = False
    fn = get_policy_loss(name)
    full, _ = fn(old, logp, adv, mask, loss_agg_mode=mode)
    (full_grad,) = torch.autograd.grad(full, logp)
    info = GlobalBatchInfo.from_mask(mask)
    for splits in ([1] * 8, [3, 5]):
        total = sum(
            fn(o, lp, a, m, loss_agg_mode=mode, global_batch=info)[0]
            for o, lp, a, m in zip(old.split(splits), logp.split(splits), adv.split(splits), mask.split(splits))
        )
        (grad,) = torch.autograd.grad(total, logp)
        assert total.item() == pytest.approx(full.item(), abs=1e-12)
        assert torch.allclose(grad, full_grad, atol=1e-12)


def test_unknown_loss_lists_valid_names():
    with pytest.raises(ValueError, match="vanilla"):
        get_policy_loss("ppo2")


def test_duplicate_registration_raises():
    with pytest.raises(ValueError, match="registered twice"):
        POLICY_LOSSES.register("vanilla")(lambda *a, **k: None)


def test_config_validation_names_the_key():
    with pytest.raises(ValueError, match="clip_ratio_c"):
        PolicyLossConfig(clip_ratio_c=0.5).validate()
    with pytest.raises(ValueError, match="clip_ratoi"):
        PolicyLossConfig.from_dict({"clip_ratoi": 0.2})
