"""Step-level agentic rewards: discounted step returns, GiGPO, step_reinforce; hand-computed and against loops."""

from __future__ import annotations

import math
import random

import pytest
import torch

from rl_core.step_rewards import STEP_ESTIMATORS, anchor_state_groups, discounted_step_returns, gigpo_rewards


def test_step_returns_discount_later_turns_within_each_episode_in_any_sample_order():
    # Episode "a": turns 0, 1, 2 with rewards 0, 0, 1; episode "b": turns 0, 1 with rewards 1, 2. Shuffled.
    scores = torch.tensor([2.0, 0.0, 1.0, 0.0, 1.0])
    episodes = ["b", "a", "a", "a", "b"]
    steps = [1, 0, 2, 1, 0]
    returns = discounted_step_returns(scores, episodes, steps, gamma=0.5)
    # a: G2 = 1, G1 = 0 + 0.5 * 1 = 0.5, G0 = 0.25; b: G1 = 2, G0 = 1 + 0.5 * 2 = 2
    assert returns.tolist() == [2.0, 0.25, 1.0, 0.5, 2.0]
    assert discounted_step_returns(scores, episodes, steps, gamma=1.0).tolist() == [2.0, 1.0, 1.0, 1.0, 3.0]
    assert discounted_step_returns(scores, episodes, steps, gamma=0.0).tolist() == scores.tolist()


def test_step_returns_follow_turn_order_not_turn_values():
    # Turn indices 3 and 7 of one episode (turns in between dropped): 7 follows 3, one discount step apart.
    returns = discounted_step_returns(torch.tensor([1.0, 0.0]), [0, 0], [7, 3], gamma=0.9)
    assert returns.tolist() == pytest.approx([1.0, 0.9])


def test_step_returns_refuse_a_repeated_turn_and_a_bad_gamma():
    with pytest.raises(ValueError, match="episode 'e' has two samples for turn 1"):
        discounted_step_returns(torch.zeros(2), ["e", "e"], [1, 1], gamma=0.9)
    with pytest.raises(ValueError, match=r"step_reward_gamma must be in \[0, 1\], got 1.5"):
        discounted_step_returns(torch.zeros(2), ["e", "e"], [0, 1], gamma=1.5)
    with pytest.raises(ValueError, match="steps has 1 entries but there are 2 turn samples"):
        discounted_step_returns(torch.zeros(2), ["e", "e"], [0], gamma=1.0)


def test_gigpo_by_hand():
    # One env group, two episodes. Episode A (score 1): turn 0 in state s0, turn 1 in s1, rewards 0 then 1.
    # Episode B (score 0): turn 0 in s0, turn 1 in s2, rewards 0, 0. gamma 0.95.
    returns = discounted_step_returns(torch.tensor([0.0, 1.0, 0.0, 0.0]), ["A", "A", "B", "B"], [0, 1, 0, 1], 0.95)
    assert returns.tolist() == pytest.approx([0.95, 1.0, 0.0, 0.0])
    out = gigpo_rewards(torch.tensor([1.0, 1.0, 0.0, 0.0]), returns, ["g"] * 4, ["s0", "s1", "s0", "s2"],
                        grouping="traj_group_id", method="mean_std", episode_weight=1.0, step_weight=0.5)  # fmt: skip
    # Episodes over the four turn samples: mean 0.5, unbiased std sqrt(1/3) -> +-0.5 / 0.57735 = +-0.8660.
    assert out.episode is not None and out.episode.tolist() == pytest.approx(
        [0.8660, 0.8660, -0.8660, -0.8660], abs=1e-4
    )
    # Anchor state s0 holds A's turn 0 (0.95) and B's turn 0 (0): mean 0.475, std 0.95 / sqrt(2) -> +-0.7071;
    # s1 and s2 hold one turn each: no baseline, 0.
    assert out.step.tolist() == pytest.approx([0.7071, 0.0, -0.7071, 0.0], abs=1e-4)
    assert out.rewards.tolist() == pytest.approx([0.8660 + 0.3536, 0.8660, -0.8660 - 0.3536, -0.8660], abs=1e-4)
    assert out.state_group_sizes is not None and sorted(out.state_group_sizes.tolist()) == [1, 1, 2]


def test_gigpo_keeps_equal_states_of_different_env_groups_apart():
    returns = torch.tensor([1.0, 0.0, 5.0, 3.0])
    out = gigpo_rewards(torch.zeros(4), returns, ["g1", "g1", "g2", "g2"], ["s"] * 4, grouping="batch", method="mean")
    assert out.step.tolist() == [0.5, -0.5, 1.0, -1.0]  # centred within (g1, s) and (g2, s), not over all four
    assert out.state_group_sizes is not None and out.state_group_sizes.tolist() == [2, 2]
    assert anchor_state_groups(["g1", "g2"], ["s", "s"]) == [("g1", "s"), ("g2", "s")]


def test_gigpo_identity_adds_the_raw_parts_and_refuses_mismatched_shapes():
    out = gigpo_rewards(torch.tensor([1.0, 0.0]), torch.tensor([0.5, 0.25]), [0, 0], [1, 2], grouping="batch",
                        method="identity", episode_weight=2.0, step_weight=3.0)  # fmt: skip
    assert out.rewards.tolist() == [2.0 + 1.5, 0.75]
    with pytest.raises(ValueError, match="must both have shape"):
        gigpo_rewards(torch.zeros(2), torch.zeros(3), [0, 0], [0, 0], grouping="batch", method="mean")
    with pytest.raises(ValueError, match=r"reward_normalization\.method"):
        gigpo_rewards(torch.zeros(2), torch.zeros(2), [0, 0], [0, 0], grouping="batch", method="zscore")


# ------------------------------------------------------------------------------------------ loop reference
def _loop_returns(scores, episodes, steps, gamma):
    out = [0.0] * len(scores)
    for episode in set(episodes):
        turns = sorted((steps[i], i) for i in range(len(scores)) if episodes[i] == episode)
        running = 0.0
        for _, i in reversed(turns):
            running = scores[i] + gamma * running
            out[i] = running
    return out


def _loop_mean_std(values, labels):
    out = []
    for i, label in enumerate(labels):
        members = [values[j] for j in range(len(values)) if labels[j] == label]
        mean = sum(members) / len(members)
        std = math.sqrt(sum((m - mean) ** 2 for m in members) / (len(members) - 1)) if len(members) > 1 else 0.0
        out.append((values[i] - mean) / (std + 1e-6) if len(members) > 1 and std > 1e-6 else 0.0)
    return out


@pytest.mark.parametrize("seed", range(5))
def test_gigpo_equals_a_loop_over_episodes_and_anchor_states(seed):
    rng = random.Random(seed)
    samples = []  # (group, episode, turn, state, step score, episode score)
    for group in range(3):
        for episode in range(4):
            turns, score = rng.randint(1, 5), float(rng.random() < 0.5)
            for turn in range(turns):
                samples.append(
                    (group, f"{group}-{episode}", turn, rng.choice("abc"), rng.choice([0.0, 0.0, 1.0]), score)
                )
    rng.shuffle(samples)
    groups, episodes, steps, states, step_scores, episode_scores = (list(column) for column in zip(*samples))
    gamma, weights = 0.9, (0.7, 1.3)
    returns = discounted_step_returns(torch.tensor(step_scores, dtype=torch.float64), episodes, steps, gamma)
    assert returns.tolist() == pytest.approx(_loop_returns(step_scores, episodes, steps, gamma), abs=1e-12)
    out = gigpo_rewards(torch.tensor(episode_scores, dtype=torch.float64), returns, groups, states, grouping="state",
                        method="mean_std", episode_weight=weights[0], step_weight=weights[1])  # fmt: skip
    expected_episode = _loop_mean_std(episode_scores, groups)
    expected_step = _loop_mean_std(returns.tolist(), list(zip(groups, states, strict=True)))
    assert out.episode is not None and out.episode.tolist() == pytest.approx(expected_episode, abs=1e-9)
    assert out.step.tolist() == pytest.approx(expected_step, abs=1e-9)
    expected = [weights[0] * e + weights[1] * s for e, s in zip(expected_episode, expected_step, strict=True)]
    assert out.rewards.tolist() == pytest.approx(expected, abs=1e-9)
    assert STEP_ESTIMATORS.get("gigpo") is gigpo_rewards
    # step_reinforce: the step returns normalised like episode scores; episode scores and states play no part.
    reinforce = STEP_ESTIMATORS.get("step_reinforce")(torch.zeros(len(groups)), returns, groups, ["x"] * len(groups),
                                                      grouping="state", method="mean_std")  # fmt: skip
    assert reinforce.rewards.tolist() == pytest.approx(_loop_mean_std(returns.tolist(), groups), abs=1e-9)
    assert reinforce.episode is None and reinforce.state_group_sizes is None
