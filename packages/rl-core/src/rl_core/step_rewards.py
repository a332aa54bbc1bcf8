"""Step-level rewards of ROLL's step-wise agentic mode, where each turn of an episode is its own sample.

Every sample carries the id of its episode, the index of its turn in that episode, the env group of the episode
(``traj_group_id``: the episodes that started from the same env seed) and, for GiGPO, a key of the state the turn
acted on (e.g. a hash of the observation text).

- ``discounted_step_returns``: a turn's return ``G_t = r_t + gamma * G_{t+1}`` over the turns of its episode, in
  turn order (ROLL's ``step_reward_gamma``; its ``compute_discounted_returns``).
- The advantage stage then treats the estimators' rewards like ``reinforce`` (ROLL: ``compute_reinforce_return``).
- ``STEP_ESTIMATORS`` (``adv_estimator``), one signature (``StepEstimator``):
  ``step_reinforce``: the step returns normalised like episode scores (``reward_normalization``);
  ``gigpo`` (Feng et al. 2025, "Group-in-Group Policy Optimization for LLM Agent Training", arXiv:2505.10978):
  ``episode_reward_weight`` x the episode score normalised within its
  ``reward_normalization`` group (ROLL normalises over the turn samples, so a longer episode counts once per turn)
  plus ``step_reward_weight`` x the step return normalised within its *anchor-state group*: the turns of the same
  env group that acted on an identical state, with the same ``reward_normalization.method``.

One difference from ROLL, on purpose: ROLL labels an anchor-state group by the state key alone, so identical states
of two different env groups would share statistics; here the group is (env group, state), as the paper defines it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol

import torch

from rl_core.advantages import GroupIndex, discounted_returns, encode_groups
from rl_core.agentic_rewards import AGENTIC_NORM_METHODS, normalize_agentic_rewards
from rl_core.registry import Registry


@dataclass(frozen=True)
class StepRewards:
    """What a step-level estimator returns; every tensor but ``state_group_sizes`` is ``[N]`` (one per turn sample)."""

    rewards: torch.Tensor
    """What the advantage stage trains on (ROLL's ``response_level_rewards``)."""
    step: torch.Tensor
    """The normalised step returns (GiGPO: within their anchor-state groups)."""
    episode: torch.Tensor | None = None
    """GiGPO: the episode scores normalised within their ``reward_normalization`` groups."""
    state_group_sizes: torch.Tensor | None = None
    """GiGPO, ``[S]``: how many turn samples each anchor-state group holds (ROLL's ``system/state_batch_size/*``)."""


class StepEstimator(Protocol):
    """The uniform signature of the step-level estimators (``adv_estimator`` of ROLL's step-wise agentic mode).

    ``episode_scores`` ``[N]``: the score of the episode each turn belongs to; ``step_returns`` ``[N]``: the turn's
    discounted return (``discounted_step_returns``); ``group_ids`` ``[N]``: the env group; ``state_keys`` ``[N]``:
    the state the turn acted on; ``grouping`` / ``method`` / ``tags``: ``reward_normalization`` as in
    ``normalize_agentic_rewards``; the weights: ``episode_reward_weight`` / ``step_reward_weight``;
    ``mean_type`` / ``std_type``: ROLL's ``norm_mean_type`` / ``norm_std_type`` (GiGPO: of the episode part only;
    as in ROLL, its anchor-state groups follow ``method``).
    """

    def __call__(
        self,
        episode_scores: torch.Tensor,
        step_returns: torch.Tensor,
        group_ids: GroupIndex,
        state_keys: GroupIndex,
        *,
        grouping: str,
        method: str,
        tags: GroupIndex | None = None,
        episode_weight: float = 1.0,
        step_weight: float = 1.0,
        mean_type: str | None = None,
        std_type: str | None = None,
    ) -> StepRewards: ...


STEP_ESTIMATORS: Registry[StepEstimator] = Registry("step-level reward estimator", "adv_estimator")


def _as_labels(values: GroupIndex, size: int, what: str) -> list[object]:
    labels = values.tolist() if isinstance(values, torch.Tensor) or hasattr(values, "tolist") else list(values)
    if len(labels) != size:
        raise ValueError(f"{what} has {len(labels)} entries but there are {size} turn samples; pass one per sample")
    return list(labels)


def discounted_step_returns(
    step_scores: torch.Tensor, episode_ids: GroupIndex, steps: GroupIndex, gamma: float
) -> torch.Tensor:
    """The return of each turn over the later turns of its episode. ``[N]``.

    ``step_scores`` ``[N]``: the reward of each turn; ``episode_ids`` ``[N]``: its episode; ``steps`` ``[N]``: its
    turn index (only the order within an episode matters; a turn index may not repeat within an episode). Samples
    may come in any order; the result is in the input order.
    """
    if step_scores.dim() != 1:
        raise ValueError(f"step_scores must have shape [turn samples], got {tuple(step_scores.shape)}")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"step_reward_gamma must be in [0, 1], got {gamma}")
    size = step_scores.shape[0]
    episodes = _as_labels(episode_ids, size, "discounted_step_returns: episode_ids")
    turn = _as_labels(steps, size, "discounted_step_returns: steps")
    episode_of, num_episodes = encode_groups(episodes, size, what="discounted_step_returns: episode_ids")
    codes = episode_of.tolist()
    pairs = sorted(range(size), key=lambda i: (codes[i], turn[i]))
    position = [0] * size
    for previous, current in itertools.pairwise(pairs):
        if codes[current] == codes[previous]:
            if turn[current] == turn[previous]:
                raise ValueError(
                    f"discounted_step_returns: episode {episodes[current]!r} has two samples for turn "
                    f"{turn[current]!r}; each turn of an episode must be one sample"
                )
            position[current] = position[previous] + 1
    width = max(position, default=-1) + 1
    dense = torch.zeros(num_episodes, width, dtype=step_scores.dtype, device=step_scores.device)
    valid = torch.zeros(num_episodes, width, dtype=torch.bool, device=step_scores.device)
    rows, cols = episode_of.to(step_scores.device), torch.tensor(position, dtype=torch.long, device=step_scores.device)
    dense[rows, cols] = step_scores
    valid[rows, cols] = True
    return discounted_returns(dense, valid, gamma)[rows, cols]


def anchor_state_groups(group_ids: GroupIndex, state_keys: GroupIndex) -> list[tuple[object, object]]:
    """The anchor-state group label of each turn sample: (env group, state key)."""
    groups = _as_labels(group_ids, len(group_ids), "group_ids")
    return list(zip(groups, _as_labels(state_keys, len(groups), "state_keys"), strict=True))


@STEP_ESTIMATORS.register("gigpo")
def gigpo_rewards(
    episode_scores: torch.Tensor,
    step_returns: torch.Tensor,
    group_ids: GroupIndex,
    state_keys: GroupIndex,
    *,
    grouping: str,
    method: str,
    tags: GroupIndex | None = None,
    episode_weight: float = 1.0,
    step_weight: float = 1.0,
    mean_type: str | None = None,
    std_type: str | None = None,
) -> StepRewards:
    """GiGPO's two-level relative rewards of ``N`` turn samples (the module docstring; arguments: StepEstimator)."""
    if episode_scores.shape != step_returns.shape or episode_scores.dim() != 1:
        raise ValueError(
            "gigpo_rewards: episode_scores and step_returns must both have shape [turn samples], got "
            f"{tuple(episode_scores.shape)} and {tuple(step_returns.shape)}"
        )
    episode = normalize_agentic_rewards(episode_scores, group_ids, grouping, method, tags=tags, mean_type=mean_type,
                                        std_type=std_type)  # fmt: skip
    anchors = anchor_state_groups(group_ids, state_keys)
    inverse, num_states = encode_groups(anchors, len(anchors), what="gigpo_rewards: anchor-state groups")
    step = AGENTIC_NORM_METHODS.get(method)(step_returns, inverse.to(step_returns.device), num_states)
    sizes = torch.bincount(inverse, minlength=num_states)
    return StepRewards(episode_weight * episode + step_weight * step, step, episode, sizes)


@STEP_ESTIMATORS.register("step_reinforce")
def step_reinforce_rewards(
    episode_scores: torch.Tensor,
    step_returns: torch.Tensor,
    group_ids: GroupIndex,
    state_keys: GroupIndex,
    *,
    grouping: str,
    method: str,
    tags: GroupIndex | None = None,
    episode_weight: float = 1.0,
    step_weight: float = 1.0,
    mean_type: str | None = None,
    std_type: str | None = None,
) -> StepRewards:
    """ROLL's ``step_reinforce``: the step returns normalised like episode scores; the episode scores, state keys and
    weights play no part."""
    step = normalize_agentic_rewards(step_returns, group_ids, grouping, method, tags=tags, mean_type=mean_type,
                                     std_type=std_type)  # fmt: skip
    return StepRewards(step, step)
