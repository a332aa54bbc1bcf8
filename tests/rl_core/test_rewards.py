"""Reward processing: normalisation variants, running moments, length terms, token-level rewards with KL."""

from __future__ import annotations

import math
import statistics
from typing import Any

import numpy as np
import pytest
import torch

from rl_core.rewards import (
    REWARD_NORMS,
    RewardConfig,
    RunningMoments,
    apply_token_level_kl,
    build_token_level_rewards,
    clip_rewards,
    compute_length_reward,
    compute_sample_weights,
    normalize_rewards,
    process_sequence_rewards,
    scores_to_token_level,
)

F64 = torch.float64
NAN = float("nan")
EPS = 1e-6


def v(xs: list[float]) -> torch.Tensor:
    return torch.tensor(xs, dtype=F64)


def close(actual: torch.Tensor, expected: object, atol: float = 1e-9) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=0.0, atol=atol)


# ---------------------------------------------------------------------------------- normalisation
def test_registry_holds_every_reward_norm() -> None:
    assert REWARD_NORMS.names() == ["batch", "group", "none", "running"]


def test_batch_norm_full_shift_and_scale() -> None:
    scores = v([1, 2, 3, 4])
    std = math.sqrt(5 / 3)  # unbiased std of 1..4 around 2.5
    close(normalize_rewards(scores, "batch"), [(x - 2.5) / (std + EPS) for x in (1, 2, 3, 4)])
    close(normalize_rewards(scores, "batch", reward_shift=True), [-1.5, -0.5, 0.5, 1.5])
    close(normalize_rewards(scores, "batch", reward_scale=True), [x / (std + EPS) for x in (1, 2, 3, 4)])


def test_group_norm_with_constant_and_singleton_groups() -> None:
    scores = v([1, 3, 10, 10, 5])
    groups = ["a", "a", "b", "b", "c"]
    s2 = math.sqrt(2)  # unbiased std of [1, 3]
    close(normalize_rewards(scores, "group", group_index=groups), [-1 / (s2 + EPS), 1 / (s2 + EPS), 0, 0, 0])
    close(normalize_rewards(scores, "group", group_index=groups, reward_shift=True), [-1, 1, 0, 0, 0])
    # scale only: a constant group or a singleton has no spread, so it is left unscaled (not x / eps)
    scaled = normalize_rewards(scores, "group", group_index=groups, reward_scale=True)
    close(scaled, [1 / (s2 + EPS), 3 / (s2 + EPS), 10, 10, 5])


def test_running_norm_uses_everything_seen_so_far() -> None:
    running = RunningMoments()
    first, second = [1.0, 2.0, 3.0], [10.0, 0.0]
    out1 = normalize_rewards(v(first), "running", running=running)
    mean1, std1 = statistics.fmean(first), statistics.stdev(first)
    close(out1, [(x - mean1) / (std1 + EPS) for x in first])
    out2 = normalize_rewards(v(second), "running", running=running, reward_shift=True)
    seen = first + second
    close(out2, [x - statistics.fmean(seen) for x in second])
    running_scale = RunningMoments()
    running_scale.load_state_dict(running.state_dict())
    out3 = normalize_rewards(v([4.0]), "running", running=running_scale, reward_scale=True)
    close(out3, [4.0 / (statistics.stdev([*seen, 4.0]) + EPS)])


def test_none_is_identity_and_accepts_none() -> None:
    scores = v([3, -1, 2])
    close(normalize_rewards(scores, None), [3, -1, 2])
    close(normalize_rewards(scores, "none", reward_shift=True), [3, -1, 2])


def test_normalisation_errors_name_the_key() -> None:
    with pytest.raises(ValueError, match=r"unknown reward normalisation 'zscore'.*'reward_norm'.*batch"):
        normalize_rewards(v([1, 2]), "zscore")
    with pytest.raises(ValueError, match=r"'group'.*reward_norm.*needs group_index"):
        normalize_rewards(v([1, 2]), "group")
    with pytest.raises(ValueError, match=r"'running'.*reward_norm.*RunningMoments"):
        normalize_rewards(v([1, 2]), "running")
    with pytest.raises(ValueError, match=r"group_index has 1 entries but the batch has 2"):
        normalize_rewards(v([1, 2]), "group", group_index=[0])


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"reward_norm": "zscore"}, "reward_norm"),
        ({"reward_shift": True, "reward_scale": True}, "reward_shift and reward_scale"),
        ({"reward_clip": -1.0}, "reward_clip"),
        ({"kl_penalty": "k9"}, "kl_penalty"),
        ({"epsilon": 0.0}, "epsilon"),
    ],
)
def test_reward_config_validation_names_the_key(kwargs: dict[str, Any], key: str) -> None:
    with pytest.raises(ValueError, match=key):
        RewardConfig(**kwargs)


def test_clip_rewards() -> None:
    close(clip_rewards(v([-3, 0.5, 2]), 1.0), [-1, 0.5, 1])
    close(clip_rewards(v([-3, 0.5, 2]), None), [-3, 0.5, 2])


# ---------------------------------------------------------------------------------- running moments
def test_running_moments_match_numpy_over_concatenated_batches() -> None:
    rng = np.random.default_rng(0)
    # float32 inputs (as rewards usually are) are accumulated in float64
    batches = [rng.normal(loc=3.0, scale=2.0, size=n).astype(np.float32) for n in (1, 7, 64, 3, 250)]
    running = RunningMoments()
    for batch in batches:
        running.update(torch.from_numpy(batch))
    everything = np.concatenate(batches).astype(np.float64)
    assert running.count == everything.size
    assert running.mean == pytest.approx(everything.mean(), abs=1e-12)
    assert running.var == pytest.approx(everything.var(ddof=1), rel=1e-12)
    assert running.std == pytest.approx(everything.std(ddof=1), rel=1e-12)


def test_running_moments_resume_is_exact() -> None:
    rng = np.random.default_rng(1)
    batches = [torch.tensor(rng.normal(size=n)) for n in (5, 9, 2, 11)]
    uninterrupted = RunningMoments()
    for batch in batches:
        uninterrupted.update(batch)
    first = RunningMoments()
    for batch in batches[:2]:
        first.update(batch)
    resumed = RunningMoments()
    resumed.load_state_dict(dict(first.state_dict()))
    for batch in batches[2:]:
        resumed.update(batch)
    assert resumed.state_dict() == uninterrupted.state_dict()  # bit-identical
    with pytest.raises(ValueError, match=r"missing \['m2'\]"):
        resumed.load_state_dict({"count": 1, "mean": 0.0})


def test_running_moments_small_counts() -> None:
    running = RunningMoments()
    assert running.std == 0.0
    running.update(torch.tensor([]))
    assert running.count == 0
    running.update(torch.tensor([4.0]))
    assert (running.mean, running.std) == (4.0, 0.0)


# ---------------------------------------------------------------------------------- length terms
def test_length_reward_kimi_k15() -> None:
    mask = torch.tensor([[1] * 2 + [0] * 4, [1] * 4 + [0] * 2, [1] * 6, [1] * 2 + [0] * 4, [1] * 6, [1, 0, 0, 0, 0, 0]])
    correct = torch.tensor([True, True, False, False, True, True])
    groups = [0, 0, 0, 1, 1, 2]
    # group 0: lengths [2, 4, 6] -> lam [.5, 0, -.5]; group 1: [2, 6] -> lam [.5, -.5], the wrong one gets
    # min(0, .5) = 0; group 2: a single length -> 0.
    close(compute_length_reward(mask, correct, groups), [0.5, 0.0, -0.5, 0.0, -0.5, 0.0])
    # whole batch: min 1, max 6 -> lam = .5 - (len - 1) / 5
    lam = [0.5 - (n - 1) / 5 for n in (2, 4, 6, 2, 6, 1)]
    expected = [x if ok else min(0.0, x) for x, ok in zip(lam, correct.tolist())]
    close(compute_length_reward(mask, correct), expected)


def test_sample_weights_difficulty_and_length() -> None:
    mask4 = torch.ones(4, 3)
    w = [0.5, 0.5 + 1.5 * 0.5, 2.0, 2.0]  # difficulty [0, .5, 1, 2] clamped to [0, 1]
    weights = compute_sample_weights(mask4, difficulty=torch.tensor([0.0, 0.5, 1.0, 2.0]), difficulty_loss_weight=True)
    close(weights, [x * 4 / sum(w) for x in w], atol=1e-6)
    mask3 = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]])
    norm_len = [(n - 1) / (2 + 1e-8) for n in (1, 2, 3)]
    lw = [1.5 - x for x in norm_len]
    close(compute_sample_weights(mask3, length_loss_weight=True), [x * 3 / sum(lw) for x in lw], atol=1e-6)
    both = [d * x for d, x in zip([0.5, 2.0, 1.25], lw)]
    weights = compute_sample_weights(
        mask3, difficulty=torch.tensor([0.0, 1.0, 0.5]), difficulty_loss_weight=True, length_loss_weight=True
    )
    close(weights, [x * 3 / sum(both) for x in both], atol=1e-6)
    close(compute_sample_weights(mask3), [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="difficulty_loss_weight"):
        compute_sample_weights(mask3, difficulty_loss_weight=True)


# ---------------------------------------------------------------------------------- token level
def test_scores_land_on_last_valid_token() -> None:
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    out = scores_to_token_level(v([1, 2, 3, 4]), mask)
    close(out, [[0, 1, 0, 0], [0, 0, 2, 0], [0, 0, 0, 0], [0, 0, 0, 4]])


def test_token_level_kl_penalty_by_hand() -> None:
    scores = torch.tensor([[0, 0, 1.0], [0, 2.0, 0], [0, 0, 0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    log_prob = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, NAN], [NAN, NAN, NAN]], dtype=F64)
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-2.0, -1.25, NAN], [NAN, NAN, NAN]], dtype=F64)
    rewards, kl, batch_kl = apply_token_level_kl(scores, mask, log_prob, ref, kl_coef=0.1, kind="kl")
    close(kl, [[0.5, -1.0, 0.0], [1.0, 0.25, 0.0], [0, 0, 0]])
    close(rewards, [[-0.05, 0.1, 1.0], [-0.1, 2.0 - 0.025, 0.0], [0, 0, 0]])
    # per-sample token means: (.5 - 1 + 0) / 3 and (1 + .25) / 2; the empty sample is not counted
    assert batch_kl == pytest.approx(((-0.5 / 3) + 0.625) / 2, abs=1e-12)
    _, kl_k2, _ = apply_token_level_kl(scores, mask, log_prob, ref, kl_coef=0.1, kind="mse")
    close(kl_k2, [[0.125, 0.5, 0.0], [0.5, 0.03125, 0.0], [0, 0, 0]])


def test_process_sequence_rewards_len_reward_norm_clip() -> None:
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0], [1, 0, 0, 0]])
    scores = v([1.0, 1.0, 0.0, 0.0])
    cfg = RewardConfig(
        add_len_reward=True, len_reward_coef=0.5, reward_norm="group", reward_shift=True, reward_clip=0.4
    )
    out = process_sequence_rewards(scores, mask, config=cfg, group_index=["p", "p", "q", "q"])
    # p: lengths [2, 4], both correct -> lam [.5, -.5] -> [1.25, .75] -> centred [.25, -.25]
    # q: lengths [3, 1], both wrong -> min(0, lam) = [-.5, 0] -> [-.25, 0] -> centred [-.125, .125]
    close(out, [0.25, -0.25, -0.125, 0.125])
    cfg = RewardConfig(reward_norm="batch", reward_clip=1.0)
    out = process_sequence_rewards(v([0.0, 0.0, 0.0, 4.0]), mask, config=cfg)
    z = 3 / (2 + EPS)  # mean 1, unbiased std 2
    close(out, [-0.5 / (1 + EPS / 2), -0.5 / (1 + EPS / 2), -0.5 / (1 + EPS / 2), min(z, 1.0)])


def test_build_token_level_rewards_kl_clip_whiten() -> None:
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    log_prob = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, NAN]], dtype=F64)
    ref = torch.tensor([[-2.0, -1.0, -3.0], [-1.0, -1.5, NAN]], dtype=F64)  # k1 = [1, 0, 2], [0, .5]
    seq = v([3.0, -1.0])
    cfg = RewardConfig(add_token_level_kl=True, reward_clip=2.5)
    rewards, batch_kl = build_token_level_rewards(
        seq, mask, config=cfg, kl_coef=0.5, log_prob=log_prob, ref_log_prob=ref
    )
    close(rewards, [[-0.5, 0.0, 2.0], [0.0, -1.25, 0.0]])  # 3 - .5 * 2 = 2; -1 - .25; then clip at 2.5
    assert batch_kl == pytest.approx((1.0 + 0.25) / 2)
    # measured but not applied without add_token_level_kl; whitening over the five valid tokens
    cfg = RewardConfig(whiten_rewards=True)
    rewards, batch_kl = build_token_level_rewards(
        seq, mask, config=cfg, kl_coef=0.5, log_prob=log_prob, ref_log_prob=ref
    )
    assert batch_kl == pytest.approx(0.625)
    flat = [0.0, 0.0, 3.0, 0.0, -1.0]
    mean, var = statistics.fmean(flat), statistics.variance(flat)
    w = [(x - mean) / math.sqrt(var + 1e-8) for x in flat]
    close(rewards, [w[:3], [w[3], w[4], 0.0]])
    rewards, batch_kl = build_token_level_rewards(seq, mask, config=RewardConfig())
    assert batch_kl is None
    close(rewards, [[0, 0, 3], [0, -1, 0]])
    with pytest.raises(ValueError, match="add_token_level_kl"):
        build_token_level_rewards(seq, mask, config=RewardConfig(add_token_level_kl=True), kl_coef=0.1)


def test_build_token_level_rewards_measures_the_kl_over_kl_mask() -> None:
    """``kl_mask``: the batch KL over the responses as generated (ROLL's controller input) while the rewards keep
    ``response_mask``, here with the second sample taken out by a sample mask."""
    generated = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    mask = torch.tensor([[1, 1, 1], [0, 0, 0]], dtype=torch.bool)
    log_prob = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, NAN]], dtype=F64)
    ref = torch.tensor([[-2.0, -1.0, -3.0], [-1.0, -1.5, NAN]], dtype=F64)  # k1 = [1, 0, 2], [0, .5]
    cfg = RewardConfig(add_token_level_kl=True)
    rewards, batch_kl = build_token_level_rewards(
        v([3.0, -1.0]), mask, config=cfg, kl_coef=0.5, log_prob=log_prob, ref_log_prob=ref, kl_mask=generated
    )
    close(rewards, [[-0.5, 0.0, 2.0], [0.0, 0.0, 0.0]])
    assert batch_kl == pytest.approx((1.0 + 0.25) / 2)  # both samples; over `mask` alone it would be 1.0
    _, masked_kl = build_token_level_rewards(
        v([3.0, -1.0]), mask, config=cfg, kl_coef=0.5, log_prob=log_prob, ref_log_prob=ref
    )
    assert masked_kl == pytest.approx(1.0)
