"""Agentic reward normalisation: every grouping x method by hand, clipping, edge cases, errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rl_core.agentic_rewards import AGENTIC_GROUPINGS, AGENTIC_NORM_METHODS, normalize_agentic_rewards

F64 = torch.float64
SCORES = [1.0, 0.0, 1.0, 1.0, 0.0, 3.0]
GROUP_IDS = [0, 0, 1, 1, 2, 2]
TAGS = ["sokoban", "sokoban", "sokoban", "frozen", "frozen", "frozen"]


def zscore(xs: list[float]) -> list[float]:
    """ROLL's mean_std on one group, in plain Python: unbiased std, + 1e-6, constant group -> 0."""
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return [(x - mean) / (std + 1e-6) if std > 1e-6 else 0.0 for x in xs]


def run(grouping: str, method: str) -> torch.Tensor:
    return normalize_agentic_rewards(torch.tensor(SCORES, dtype=F64), GROUP_IDS, grouping, method, tags=TAGS)


def close(actual: torch.Tensor, expected: list[float]) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=F64), rtol=0.0, atol=1e-12)


def test_registries() -> None:
    assert AGENTIC_GROUPINGS.names() == ["batch", "inductive", "state"]
    assert AGENTIC_NORM_METHODS.names() == ["asym_clip", "identity", "mean", "mean_std"]


def test_roll_spellings_of_groupings() -> None:
    """ROLL's example configs write ``grouping: traj_group_id`` (env group) and ``tags`` (env type)."""
    assert AGENTIC_GROUPINGS.canonical_name("traj_group_id") == "state"
    assert AGENTIC_GROUPINGS.canonical_name("tags") == "inductive"
    torch.testing.assert_close(run("traj_group_id", "mean_std"), run("state", "mean_std"))
    torch.testing.assert_close(run("tags", "mean_std"), run("inductive", "mean_std"))


@pytest.mark.parametrize("grouping", ["state", "batch", "inductive"])
def test_identity_leaves_scores(grouping: str) -> None:
    close(run(grouping, "identity"), SCORES)


def test_state_grouping() -> None:
    # env groups: [1, 0], [1, 1] (constant), [0, 3]
    close(run("state", "mean"), [0.5, -0.5, 0.0, 0.0, -1.5, 1.5])
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    b = 1.5 / (math.sqrt(4.5) + 1e-6)
    close(run("state", "mean_std"), [a, -a, 0.0, 0.0, -b, b])
    close(run("state", "asym_clip"), [a, -a, 0.0, 0.0, -b, b])  # all inside [-1, 3]


def test_inductive_grouping_uses_env_tags() -> None:
    # sokoban: [1, 0, 1] (mean 2/3), frozen: [1, 0, 3] (mean 4/3)
    close(run("inductive", "mean"), [1 / 3, -2 / 3, 1 / 3, -1 / 3, -4 / 3, 5 / 3])
    expected = zscore([1.0, 0.0, 1.0]) + zscore([1.0, 0.0, 3.0])
    assert expected[0] == pytest.approx((1 / 3) / (math.sqrt(1 / 3) + 1e-6))
    close(run("inductive", "mean_std"), expected)
    close(run("inductive", "asym_clip"), [min(max(x, -1.0), 3.0) for x in expected])


def test_batch_grouping_ignores_ids() -> None:
    close(run("batch", "mean"), [0.0, -1.0, 0.0, 0.0, -1.0, 2.0])
    z = [x / (math.sqrt(1.2) + 1e-6) for x in (0.0, -1.0, 0.0, 0.0, -1.0, 2.0)]  # mean 1, unbiased var 6 / 5
    close(run("batch", "mean_std"), z)
    out = normalize_agentic_rewards(torch.tensor(SCORES, dtype=F64), None, "batch", "asym_clip")
    close(out, [min(max(x, -1.0), 3.0) for x in z])


def test_asym_clip_clips_both_tails() -> None:
    # 19 failures and one success: the success is z = .95 / sqrt(.05) ~ 4.25 -> 3; mirrored -> -1
    rare_success = [0.0] * 19 + [1.0]
    rare_failure = [1.0] * 19 + [0.0]
    scores = torch.tensor(rare_success + rare_failure, dtype=F64)
    groups = ["s"] * 20 + ["f"] * 20
    z_s, z_f = zscore(rare_success), zscore(rare_failure)
    assert z_s[-1] > 3.0
    assert z_f[-1] < -1.0
    out = normalize_agentic_rewards(scores, groups, "state", "asym_clip")
    close(out, [min(max(x, -1.0), 3.0) for x in z_s + z_f])
    close(normalize_agentic_rewards(scores, groups, "state", "mean_std"), z_s + z_f)


def test_singletons_and_constant_batches_give_zero() -> None:
    scores = torch.tensor([5.0, 2.0, 2.0], dtype=F64)
    out = normalize_agentic_rewards(scores, np.array(["a", "b", "b"]), "state", "mean_std")
    close(out, [0.0, 0.0, 0.0])
    out = normalize_agentic_rewards(torch.full((4,), 7.0, dtype=F64), None, "batch", "asym_clip")
    close(out, [0.0] * 4)


def test_group_id_types_agree() -> None:
    scores = torch.tensor(SCORES, dtype=F64)
    base = normalize_agentic_rewards(scores, GROUP_IDS, "state", "mean_std")
    for ids in (np.array(GROUP_IDS), torch.tensor(GROUP_IDS), [f"env{g}" for g in GROUP_IDS]):
        close(normalize_agentic_rewards(scores, ids, "state", "mean_std"), base.tolist())


def test_errors_name_the_key() -> None:
    scores = torch.tensor(SCORES, dtype=F64)
    with pytest.raises(ValueError, match=r"reward_normalization.grouping 'state' needs group_ids"):
        normalize_agentic_rewards(scores, None, "state", "mean_std")
    with pytest.raises(ValueError, match=r"reward_normalization.grouping 'inductive' needs tags"):
        normalize_agentic_rewards(scores, GROUP_IDS, "inductive", "mean_std")
    with pytest.raises(ValueError, match=r"unknown agentic reward grouping 'traj'.*'reward_normalization.grouping'"):
        normalize_agentic_rewards(scores, GROUP_IDS, "traj", "mean_std")
    with pytest.raises(ValueError, match=r"unknown .* 'zscore'.*'reward_normalization.method'.*asym_clip"):
        normalize_agentic_rewards(scores, GROUP_IDS, "state", "zscore")
    with pytest.raises(ValueError, match=r"'state'.*group_index has 2 entries but the batch has 6"):
        normalize_agentic_rewards(scores, [0, 1], "state", "mean")
    with pytest.raises(ValueError, match=r"scores of shape \[batch\]"):
        normalize_agentic_rewards(scores.reshape(2, 3), GROUP_IDS, "state", "mean")


def test_rolls_separate_mean_and_std_types() -> None:
    """ROLL's norm_mean_type / norm_std_type (e.g. its native Sokoban example: the env group's mean, the batch's
    std). SCORES: batch mean 1, unbiased batch std sqrt(6 / 5); env groups [1, 0], [1, 1], [0, 3]."""
    scores = torch.tensor(SCORES, dtype=F64)
    batch_std = math.sqrt(6 / 5) + 1e-6

    def typed(method: str, mean_type: str | None, std_type: str | None, grouping: str = "state") -> torch.Tensor:
        return normalize_agentic_rewards(scores, GROUP_IDS, grouping, method, mean_type=mean_type, std_type=std_type)

    close(typed("identity", "group", "batch"), [0.5 / batch_std, -0.5 / batch_std, 0.0, 0.0, -1.5 / batch_std,
                                                1.5 / batch_std])  # fmt: skip
    close(typed("identity", "batch", None), [0.0, -1.0, 0.0, 0.0, -1.0, 2.0])
    # A type left null comes from the method: mean_std with an explicit batch std subtracts the group mean.
    torch.testing.assert_close(typed("mean_std", None, "batch"), typed("identity", "group", "batch"))
    # No mean (identity), each group's std: a constant group gives 0.
    close(typed("identity", None, "group"), [1.0 / (math.sqrt(0.5) + 1e-6), 0.0, 0.0, 0.0, 0.0,
                                             3.0 / (math.sqrt(4.5) + 1e-6)])  # fmt: skip
    # With grouping batch the method's moments are the batch's, whatever the explicit other type says.
    close(typed("mean", None, "batch", grouping="batch"), [0.0, -1.0 / batch_std, 0.0, 0.0, -1.0 / batch_std,
                                                           2.0 / batch_std])  # fmt: skip
    # asym_clip keeps its clamp.
    assert typed("asym_clip", "batch", "batch").max() <= 3.0
    with pytest.raises(ValueError, match=r"reward_normalization\.norm_std_type='sample'"):
        typed("identity", "group", "sample")
