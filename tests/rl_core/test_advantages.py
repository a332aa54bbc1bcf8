"""Advantage estimators: hand-computed values, a slow pure-Python reference, masks, groups and errors."""

from __future__ import annotations

import math
import statistics
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import pytest
import torch

from rl_core.advantages import (
    ADV_ESTIMATORS,
    AdvantageConfig,
    GroupIndex,
    compute_advantages,
    encode_groups,
    get_advantage_estimator,
)

F64 = torch.float64
NAN = float("nan")
ATOL = 1e-9
Rows = list[list[float]]
Mask = list[list[bool]]


def t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def m(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.bool)


def close(actual: torch.Tensor, expected: object, atol: float = ATOL) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=F64), rtol=0.0, atol=atol)


# ------------------------------------------------------------------------------------------ hand values
def test_gae_hand_computed() -> None:
    # delta2 = 1 - .7 = .3; delta1 = .9*.7 - .6 = .03; delta0 = .9*.6 - .5 = .04; gamma*lambd = .72
    cfg = AdvantageConfig(gamma=0.9, lambd=0.8)
    adv, ret = compute_advantages("gae", t([[0, 0, 1]]), m([[1, 1, 1]]), config=cfg, values=t([[0.5, 0.6, 0.7]]))
    a2 = 0.3
    a1 = 0.03 + 0.72 * a2
    a0 = 0.04 + 0.72 * a1
    close(adv, [[a0, a1, a2]])
    close(ret, [[a0 + 0.5, a1 + 0.6, a2 + 0.7]])


def test_gae_padding_and_gap_are_transparent() -> None:
    rewards = t([[0, 1, NAN], [0, 99, 1]])
    values = t([[0.5, 0.4, NAN], [0.2, NAN, 0.5]])
    mask = m([[1, 1, 0], [1, 0, 1]])
    # row 0, gamma = lambd = 1: A1 = 1 - .4 = .6; A0 = 0 + .4 - .5 + .6 = .5; returns = rewards-to-go.
    adv, ret = compute_advantages("gae", rewards[:1], mask[:1], config=AdvantageConfig(), values=values[:1])
    close(adv, [[0.5, 0.6, 0.0]])
    close(ret, [[1.0, 1.0, 0.0]])
    # row 1, gamma = .5, lambd = 1, the masked middle token is skipped (no reward, no discount step):
    # A2 = 1 - .5 = .5; A0 = 0 + .5 * .5 - .2 + .5 * .5 = .3; return at 0 = .5 * 1 = .5 = A0 + V0.
    adv, ret = compute_advantages("gae", rewards[1:], mask[1:], config=AdvantageConfig(gamma=0.5), values=values[1:])
    close(adv, [[0.3, 0.0, 0.5]])
    close(ret, [[0.5, 0.0, 1.0]])


def test_reinforce_hand_computed() -> None:
    rewards, mask = t([[1, 0, 2], [1, 5, NAN]]), m([[1, 1, 1], [1, 0, 0]])
    adv, ret = compute_advantages("reinforce", rewards, mask, config=AdvantageConfig(gamma=0.5))
    close(adv, [[1 + 0.5 * (0 + 0.5 * 2), 0 + 0.5 * 2, 2], [1, 0, 0]])
    close(ret, adv)
    adv, _ = compute_advantages("reinforce", rewards, mask, config=AdvantageConfig(gamma=1.0))
    close(adv, [[3, 2, 2], [1, 0, 0]])


def _whiten(xs: list[float]) -> list[float]:
    mean = sum(xs) / len(xs)
    var = sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)
    return [(x - mean) / math.sqrt(var + 1e-8) for x in xs]


def test_reinforce_plus_plus_hand_computed() -> None:
    rewards, mask = t([[0, 0, 1], [0, 2, NAN]]), m([[1, 1, 1], [1, 1, 0]])
    adv, ret = compute_advantages("reinforce_plus_plus", rewards, mask, config=AdvantageConfig())
    w = _whiten([1, 1, 1, 2, 2])  # returns-to-go of the five valid tokens
    close(adv, [[w[0], w[1], w[2]], [w[3], w[4], 0]])
    close(ret, [[1, 1, 1], [2, 2, 0]])


def test_reinforce_plus_plus_baseline_hand_computed() -> None:
    # scores: group a [1, 0] -> centred [.5, -.5]; group b [3, 1] -> [1, -1]
    rewards = t([[0, 1], [0, NAN], [3, 0], [1, 0]])
    mask = m([[1, 1], [1, 0], [1, 0], [1, 1]])
    adv, ret = compute_advantages(
        "reinforce_plus_plus_baseline", rewards, mask, config=AdvantageConfig(), group_index=["a", "a", "b", "b"]
    )
    w = _whiten([0.5, 0.5, -0.5, 1.0, -1.0, -1.0])
    close(adv, [[w[0], w[1]], [w[2], 0], [w[3], 0], [w[4], w[5]]])
    close(ret, adv)


def test_grpo_hand_computed_and_dr_grpo() -> None:
    # group a scores [1, 0, .5]: mean .5, unbiased std .5; group b is a singleton -> 0
    rewards = t([[0, 1], [0, 0], [0.5, NAN], [7, 0]])
    mask = m([[1, 1], [1, 1], [1, 0], [1, 1]])
    groups = [0, 0, 0, 1]
    adv, ret = compute_advantages("grpo", rewards, mask, config=AdvantageConfig(), group_index=groups)
    z = 0.5 / (0.5 + 1e-6)
    close(adv, [[z, z], [-z, -z], [0, 0], [0, 0]])
    close(ret, adv)
    cfg = AdvantageConfig(norm_adv_by_std_in_grpo=False)
    adv, _ = compute_advantages("grpo", rewards, mask, config=cfg, group_index=groups)
    close(adv, [[0.5, 0.5], [-0.5, -0.5], [0, 0], [0, 0]])


def test_rloo_hand_computed() -> None:
    # leave-one-out baselines: (0 + .5) / 2, (1 + .5) / 2, (1 + 0) / 2
    rewards, mask = t([[1, 0], [0, 0], [0.5, 0], [4, 0]]), m([[1, 1], [1, 0], [1, 1], [1, 1]])
    adv, _ = compute_advantages("rloo", rewards, mask, config=AdvantageConfig(), group_index=["p", "p", "p", "q"])
    close(adv, [[0.75, 0.75], [-0.75, 0], [0, 0], [0, 0]])


def test_opo_hand_computed() -> None:
    # lengths [3, 1, 2], scores [1, 0, .5]: baseline (3 * 1 + 1 * 0 + 2 * .5) / 6 = 2 / 3
    rewards = t([[0, 0, 1], [0, NAN, NAN], [0.5, 0, NAN]])
    mask = m([[1, 1, 1], [1, 0, 0], [1, 1, 0]])
    adv, _ = compute_advantages("opo", rewards, mask, config=AdvantageConfig(), group_index=[9, 9, 9])
    b = 2 / 3
    close(adv, [[1 - b] * 3, [-b, 0, 0], [0.5 - b, 0.5 - b, 0]])


def test_whiten_then_clip() -> None:
    rewards, mask = t([[1, 0, 2], [1, NAN, NAN]]), m([[1, 1, 1], [1, 0, 0]])
    cfg = AdvantageConfig(whiten_advantages=True, advantage_clip=1.0)
    adv, ret = compute_advantages("reinforce", rewards, mask, config=cfg)
    w = [min(max(x, -1.0), 1.0) for x in _whiten([3, 2, 2, 1])]
    close(adv, [[w[0], w[1], w[2]], [w[3], 0, 0]])
    close(ret, [[3, 2, 2], [1, 0, 0]])  # returns are not whitened
    cfg = AdvantageConfig(advantage_clip=2.5)
    adv, _ = compute_advantages("reinforce", rewards, mask, config=cfg)
    close(adv, [[2.5, 2, 2], [1, 0, 0]])


def test_one_valid_token_is_not_whitened_as_in_roll() -> None:
    """With a single valid token the unbiased variance is undefined: ROLL skips both whitenings (its
    compute_advantage), where whitening gave the token 0."""
    from rl_core.rewards import whiten_token_rewards

    rewards, mask = t([[0.7, 5.0], [2.0, 3.0]]), m([[1, 0], [0, 0]])
    adv, _ = compute_advantages("reinforce", rewards, mask, config=AdvantageConfig(whiten_advantages=True))
    close(adv, [[0.7, 0], [0, 0]])
    close(whiten_token_rewards(rewards, mask), [[0.7, 0], [0, 0]])


# ---------------------------------------------------------------------------------- slow reference
def _valid(mask_row: list[bool]) -> list[int]:
    return [i for i, ok in enumerate(mask_row) if ok]


def ref_returns(rewards: Rows, mask: Mask, gamma: float) -> Rows:
    """Explicit sums G_i = sum_{j >= i} gamma^(k_j - k_i) r_j over the valid tokens (k = rank among valid)."""
    out = []
    for r_row, m_row in zip(rewards, mask):
        idx, row = _valid(m_row), [0.0] * len(m_row)
        for a, i in enumerate(idx):
            row[i] = sum(gamma ** (b - a) * r_row[j] for b, j in enumerate(idx) if b >= a)
        out.append(row)
    return out


def ref_gae(rewards: Rows, values: Rows, mask: Mask, gamma: float, lambd: float) -> tuple[Rows, Rows]:
    """Explicit sums A_i = sum_{j >= i} (gamma lambd)^(k_j - k_i) delta_j; V after the last valid token = 0."""
    advs, rets = [], []
    for r_row, v_row, m_row in zip(rewards, values, mask):
        idx = _valid(m_row)
        deltas = []
        for a, i in enumerate(idx):
            next_v = v_row[idx[a + 1]] if a + 1 < len(idx) else 0.0
            deltas.append(r_row[i] + gamma * next_v - v_row[i])
        adv, ret = [0.0] * len(m_row), [0.0] * len(m_row)
        for a, i in enumerate(idx):
            adv[i] = sum((gamma * lambd) ** (b - a) * deltas[b] for b in range(a, len(idx)))
            ret[i] = adv[i] + v_row[i]
        advs.append(adv)
        rets.append(ret)
    return advs, rets


def ref_scores(rewards: Rows, mask: Mask) -> list[float]:
    return [sum(r for r, ok in zip(r_row, m_row) if ok) for r_row, m_row in zip(rewards, mask)]


def ref_outcome(kind: str, rewards: Rows, mask: Mask, groups: Sequence[Hashable], eps: float = 1e-6) -> Rows:
    scores = ref_scores(rewards, mask)
    lengths = [sum(row) for row in mask]
    members: dict[Hashable, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    seq_adv = [0.0] * len(scores)
    for idx in members.values():
        group_scores = [scores[i] for i in idx]
        if len(idx) == 1:
            continue
        mean = statistics.fmean(group_scores)
        for i in idx:
            others = [scores[j] for j in idx if j != i]
            if kind == "grpo":
                seq_adv[i] = (scores[i] - mean) / (statistics.stdev(group_scores) + eps)
            elif kind == "drgrpo":
                seq_adv[i] = scores[i] - mean
            elif kind == "rloo":
                seq_adv[i] = scores[i] - statistics.fmean(others)
            elif kind == "opo":
                total = sum(lengths[j] for j in idx)
                baseline = sum(lengths[j] * scores[j] for j in idx) / total if total else 0.0
                seq_adv[i] = scores[i] - baseline
            elif kind == "rpp_baseline":
                seq_adv[i] = scores[i] - mean
    return [[seq_adv[b] if ok else 0.0 for ok in m_row] for b, m_row in enumerate(mask)]


def ref_whiten(rows: Rows, mask: Mask) -> Rows:
    flat = [x for row, m_row in zip(rows, mask) for x, ok in zip(row, m_row) if ok]
    white = iter(_whiten(flat))
    return [[next(white) if ok else 0.0 for ok in m_row] for m_row in mask]


def random_batch(
    seed: int, batch: int = 10, length: int = 7
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[Hashable]]:
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, length, generator=gen, dtype=F64)
    values = torch.randn(batch, length, generator=gen, dtype=F64)
    lengths = torch.randint(0, length + 1, (batch,), generator=gen)
    lengths[0] = length  # at least one full row
    mask = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    gaps = torch.rand(batch, length, generator=gen) < 0.15  # multi-turn style holes
    mask = mask & ~gaps
    mask[0, -1] = True
    rewards[~mask] = NAN
    values[~mask] = NAN
    groups: list[Hashable] = [int(g) for g in torch.randint(0, 3, (batch,), generator=gen)]
    groups[-1] = "solo"  # a singleton group
    return rewards, values, mask, groups


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize(("gamma", "lambd"), [(1.0, 1.0), (0.9, 0.95), (0.5, 0.0)])
def test_token_scans_match_slow_reference(seed: int, gamma: float, lambd: float) -> None:
    rewards, values, mask, _ = random_batch(seed)
    r, v, ml = rewards.tolist(), values.tolist(), mask.tolist()
    cfg = AdvantageConfig(gamma=gamma, lambd=lambd)
    adv, ret = compute_advantages("gae", rewards, mask, config=cfg, values=values)
    ref_adv, ref_ret = ref_gae(r, v, ml, gamma, lambd)
    close(adv, ref_adv)
    close(ret, ref_ret)
    adv, ret = compute_advantages("reinforce", rewards, mask, config=cfg)
    close(adv, ref_returns(r, ml, gamma))
    close(ret, ref_returns(r, ml, gamma))
    adv, ret = compute_advantages("reinforce_plus_plus", rewards, mask, config=cfg)
    close(adv, ref_whiten(ref_returns(r, ml, gamma), ml))
    close(ret, ref_returns(r, ml, gamma))


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_outcome_estimators_match_slow_reference(seed: int) -> None:
    rewards, _, mask, groups = random_batch(seed)
    r, ml = rewards.tolist(), mask.tolist()
    cases = {
        ("grpo", True): "grpo",
        ("grpo", False): "drgrpo",
        ("rloo", True): "rloo",
        ("opo", True): "opo",
    }
    for (name, by_std), kind in cases.items():
        cfg = AdvantageConfig(norm_adv_by_std_in_grpo=by_std)
        adv, ret = compute_advantages(name, rewards, mask, config=cfg, group_index=groups)
        close(adv, ref_outcome(kind, r, ml, groups))
        close(ret, adv)
    adv, _ = compute_advantages(
        "reinforce_plus_plus_baseline", rewards, mask, config=AdvantageConfig(), group_index=groups
    )
    close(adv, ref_whiten(ref_outcome("rpp_baseline", r, ml, groups), ml))


# ----------------------------------------------------------------------------------- uniform contract
def test_every_estimator_takes_the_same_call_and_keeps_padding_clean() -> None:
    rewards, values, mask, groups = random_batch(7)
    assert set(ADV_ESTIMATORS.names()) >= {
        "gae",
        "grpo",
        "reinforce",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "rloo",
        "opo",
    }
    for name in ADV_ESTIMATORS.names():
        cfg = AdvantageConfig(gamma=0.9, lambd=0.9, whiten_advantages=True, advantage_clip=3.0)
        adv, ret = get_advantage_estimator(name)(rewards, mask, config=cfg, values=values, group_index=groups)
        for out in (adv, ret):
            assert out.shape == rewards.shape
            assert out.dtype == F64
            assert torch.isfinite(out).all(), name
            assert (out[~mask] == 0).all(), name
        adv, _ = compute_advantages(name, rewards, mask, config=cfg, values=values, group_index=groups)
        assert adv.abs().max() <= 3.0
        assert (adv[~mask] == 0).all()


def test_float_and_int_masks_match_bool_masks() -> None:
    rewards, values, mask, groups = random_batch(11)
    cfg = AdvantageConfig(gamma=0.95, lambd=0.9)
    for name in ADV_ESTIMATORS.names():
        expected = compute_advantages(name, rewards, mask, config=cfg, values=values, group_index=groups)
        for as_numbers in (mask.to(F64), mask.to(torch.int64)):
            got = compute_advantages(name, rewards, as_numbers, config=cfg, values=values, group_index=groups)
            close(got[0], expected[0])
            close(got[1], expected[1])


def test_group_ids_as_strings_numpy_and_tensors_agree() -> None:
    rewards, _, mask, _ = random_batch(3, batch=6)
    ints = [0, 1, 0, 1, 2, 2]
    variants: list[GroupIndex] = [
        ints,
        ["x", "y", "x", "y", "z", "z"],
        np.array(ints),
        np.array(["u1", "u2", "u1", "u2", "u3", "u3"], dtype=object),
        torch.tensor(ints),
    ]
    outs = [compute_advantages("grpo", rewards, mask, config=AdvantageConfig(), group_index=g)[0] for g in variants]
    for out in outs[1:]:
        close(out, outs[0])


def test_group_edge_cases() -> None:
    rewards, mask = t([[1, 0], [0, 2], [3, 0]]), m([[1, 1], [1, 1], [1, 0]])
    cfg = AdvantageConfig()
    for name in ("grpo", "rloo", "opo", "reinforce_plus_plus_baseline"):
        adv, _ = compute_advantages(name, rewards, mask, config=cfg, group_index=[0, 1, 2])  # all singletons
        close(adv, torch.zeros(3, 2, dtype=F64))
    # a constant group: no spread, so grpo gives 0 rather than 0 / eps noise
    adv, _ = compute_advantages("grpo", t([[1, 0], [0, 1]]), m([[1, 1], [1, 1]]), config=cfg, group_index=[5, 5])
    close(adv, torch.zeros(2, 2, dtype=F64))
    # an all-padding sample still counts as score 0 in its group and gets zeros on its tokens
    adv, _ = compute_advantages("rloo", t([[2, NAN], [NAN, NAN]]), m([[1, 0], [0, 0]]), config=cfg, group_index=[1, 1])
    close(adv, [[2, 0], [0, 0]])
    # whitening an all-padding batch gives zeros, not NaN
    cfg_w = AdvantageConfig(whiten_advantages=True)
    adv, _ = compute_advantages("reinforce_plus_plus", t([[NAN]]), m([[0]]), config=cfg_w)
    close(adv, [[0.0]])
    assert encode_groups(["b", "a", "b"], 3, what="x")[0].tolist() == [0, 1, 0]


# ------------------------------------------------------------------------------------------- errors
def test_missing_inputs_name_estimator_and_what_is_missing() -> None:
    rewards, mask = t([[1, 0]]), m([[1, 1]])
    with pytest.raises(ValueError, match=r"'gae'.*adv_estimator.*critic values"):
        compute_advantages("gae", rewards, mask, config=AdvantageConfig())
    with pytest.raises(ValueError, match=r"'gae'.*got \(1, 3\)"):
        compute_advantages("gae", rewards, mask, config=AdvantageConfig(), values=torch.zeros(1, 3, dtype=F64))
    for name in ("grpo", "rloo", "opo", "reinforce_plus_plus_baseline"):
        with pytest.raises(ValueError, match=rf"'{name}'.*adv_estimator.*needs group_index"):
            compute_advantages(name, rewards, mask, config=AdvantageConfig())
    with pytest.raises(ValueError, match=r"'grpo'.*group_index has 2 entries but the batch has 1"):
        compute_advantages("grpo", rewards, mask, config=AdvantageConfig(), group_index=[0, 1])
    with pytest.raises(ValueError, match=r"must both be \[batch, response_length\]"):
        compute_advantages("reinforce", rewards, m([[1]]), config=AdvantageConfig())


def test_unknown_estimator_lists_valid_names_and_key() -> None:
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'ppo'.*'adv_estimator'.*gae.*grpo"):
        get_advantage_estimator("ppo")


def test_duplicate_registration_raises() -> None:
    with pytest.raises(ValueError, match="registered twice"):
        ADV_ESTIMATORS.register("grpo")(get_advantage_estimator("rloo"))


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"gamma": 1.5}, "gamma"),
        ({"lambd": -0.1}, "lambd"),
        ({"epsilon": 0.0}, "epsilon"),
        ({"advantage_clip": 0.0}, "advantage_clip"),
    ],
)
def test_config_validation_names_the_key(kwargs: dict[str, Any], key: str) -> None:
    with pytest.raises(ValueError, match=key):
        AdvantageConfig(**kwargs)
