"""Advantage estimators, one registry keyed by the config key ``adv_estimator``.

Every estimator has the same call signature, so a caller never branches on the name::

    estimator(token_level_rewards,  # [B, T]
              response_mask,        # [B, T], True = the token counts
              *, config,            # AdvantageConfig
              values=None,          # [B, T] critic values (gae only)
              group_index=None)     # [B] group id per sample (grpo, rloo, opo, reinforce_plus_plus_baseline)
    -> (advantages [B, T], returns [B, T])

Conventions shared by all estimators:

- Entries outside ``response_mask`` are ignored on input (NaN there does not leak) and are 0 on output.
- Masked-out positions are *transparent* to the token-level scans (gae, reinforce, reinforce_plus_plus):
  they neither add a reward nor take a discount step, so a multi-turn sample whose environment tokens are
  masked out is discounted over its own tokens only. With right padding this is the usual recursion.
- Outcome estimators (grpo, rloo, opo, reinforce_plus_plus_baseline) score a sample by the sum of its
  token-level rewards over the response, and give that one advantage to every valid token; their returns
  equal their advantages (no critic).
- A group of size 1 has no baseline to compare against: its sample gets advantage 0 in every grouped
  estimator (grpo, rloo, opo, reinforce_plus_plus_baseline). verl instead uses baseline 0 there.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from rl_core.masked import masked_sum, masked_whiten
from rl_core.registry import Registry

# One group id per sample: ints or strings (prompt uid, env group id), as a list, numpy array or tensor.
GroupIndex = Sequence[Hashable] | np.ndarray | torch.Tensor


@dataclass
class AdvantageConfig:
    """Knobs of the advantage estimators (ROLL / verl config keys)."""

    gamma: float = 1.0
    """Discount factor over response tokens (gae, reinforce, reinforce_plus_plus)."""
    lambd: float = 1.0
    """GAE lambda: 1 = Monte-Carlo returns minus values, 0 = one-step TD error (ROLL spells it ``lambd``)."""
    norm_adv_by_std_in_grpo: bool = True
    """grpo divides by the group std; False gives Dr.GRPO (Liu et al. 2025), mean-centred only."""
    epsilon: float = 1e-6
    """Added to the group std before dividing (grpo)."""
    whiten_advantages: bool = False
    """Whiten advantages over all valid tokens of the batch after the estimator (compute_advantages)."""
    advantage_clip: float | None = None
    """Clamp advantages to [-advantage_clip, advantage_clip] after whitening; None = no clamp."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"gamma must be in [0, 1], got {self.gamma}")
        if not 0.0 <= self.lambd <= 1.0:
            raise ValueError(f"lambd must be in [0, 1], got {self.lambd}")
        if not self.epsilon > 0.0:
            raise ValueError(f"epsilon must be > 0, got {self.epsilon}")
        if self.advantage_clip is not None and not self.advantage_clip > 0.0:
            raise ValueError(f"advantage_clip must be None or > 0, got {self.advantage_clip}")


class AdvantageEstimator(Protocol):
    """The uniform signature of every registered estimator (see the module docstring)."""

    def __call__(
        self,
        token_level_rewards: torch.Tensor,
        response_mask: torch.Tensor,
        *,
        config: AdvantageConfig,
        values: torch.Tensor | None = None,
        group_index: GroupIndex | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


ADV_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator", "adv_estimator")


# ----------------------------------------------------------------------------------------------- groups
def encode_groups(group_index: GroupIndex, batch_size: int, *, what: str) -> tuple[torch.Tensor, int]:
    """Map per-sample group ids to dense codes ``0..G-1`` (first-seen order). Returns (inverse [B], G).

    ``what`` names the caller in errors, e.g. ``"advantage estimator 'grpo' (config key 'adv_estimator')"``.
    """
    if isinstance(group_index, (torch.Tensor, np.ndarray)):
        if group_index.ndim != 1:
            raise ValueError(f"{what}: group_index must be 1-D [batch], got shape {tuple(group_index.shape)}")
        labels: list[Hashable] = group_index.tolist()
    else:
        labels = list(group_index)
    if len(labels) != batch_size:
        raise ValueError(
            f"{what}: group_index has {len(labels)} entries but the batch has {batch_size} samples; "
            "pass one group id (e.g. the prompt uid) per sample"
        )
    codes: dict[Hashable, int] = {}
    inverse = [codes.setdefault(label, len(codes)) for label in labels]
    return torch.tensor(inverse, dtype=torch.long), len(codes)


def group_moments(
    values: torch.Tensor, inverse: torch.Tensor, num_groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample view of its group's mean, unbiased std (0 for a singleton) and size. All ``[B]``."""
    inverse = inverse.to(values.device)
    zeros = torch.zeros(num_groups, dtype=values.dtype, device=values.device)
    count = zeros.index_add(0, inverse, torch.ones_like(values))
    mean = zeros.index_add(0, inverse, values) / count.clamp(min=1)
    sq_dev = (values - mean[inverse]).square()
    var = zeros.index_add(0, inverse, sq_dev) / (count - 1).clamp(min=1)
    return mean[inverse], var.sqrt()[inverse], count[inverse]


def _require_groups(name: str, group_index: GroupIndex | None, batch_size: int) -> tuple[torch.Tensor, int]:
    what = f"advantage estimator {name!r} (config key 'adv_estimator')"
    if group_index is None:
        raise ValueError(
            f"{what} needs group_index: one group id per sample (e.g. the prompt uid shared by the "
            "num_return_sequences_in_group responses of a prompt); got None"
        )
    return encode_groups(group_index, batch_size, what=what)


def _check_shapes(name: str, token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> None:
    if token_level_rewards.dim() != 2 or response_mask.shape != token_level_rewards.shape:
        raise ValueError(
            f"advantage estimator {name!r}: token_level_rewards and response_mask must both be "
            f"[batch, response_length], got {tuple(token_level_rewards.shape)} and {tuple(response_mask.shape)}"
        )


def _broadcast_outcome(advantage: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence advantage ``[B]`` -> the same value on every valid token ``[B, T]``; returns = advantages."""
    token_adv = advantage.unsqueeze(-1).expand(response_mask.shape)
    token_adv = torch.where(response_mask.to(torch.bool), token_adv, torch.zeros_like(token_adv))
    return token_adv, token_adv


# ------------------------------------------------------------------------------------------ token scans
def discounted_returns(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Return-to-go ``G_t = r_t + gamma * G_{t+1}`` over valid tokens (Sutton & Barto eq. 3.8). ``[B, T]``.

    Masked-out positions are transparent (no reward, no discount step) and are 0 in the output.
    With ``gamma == 1`` this is a reverse cumulative sum, computed without a scan.
    """
    mask = response_mask.to(torch.bool)
    rewards = torch.where(mask, token_level_rewards, torch.zeros_like(token_level_rewards))
    if gamma == 1.0:
        returns = rewards.flip(-1).cumsum(-1).flip(-1)
    else:
        returns = torch.zeros_like(rewards)
        running = torch.zeros_like(rewards[:, 0])
        for t in reversed(range(rewards.shape[-1])):  # scan over time, vectorised over the batch
            running = torch.where(mask[:, t], rewards[:, t] + gamma * running, running)
            returns[:, t] = running
    return torch.where(mask, returns, torch.zeros_like(returns))


@ADV_ESTIMATORS.register("gae")
def compute_gae_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    config: AdvantageConfig,
    values: torch.Tensor | None = None,
    group_index: GroupIndex | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438, eq. 16).

    ``delta_t = r_t + gamma * V_{t+1} - V_t``, ``A_t = delta_t + gamma * lambd * A_{t+1}``, returns ``A_t + V_t``.
    The value after the last valid token is 0 (terminal). Needs critic ``values`` ``[B, T]``.
    """
    _check_shapes("gae", token_level_rewards, response_mask)
    if values is None or values.shape != token_level_rewards.shape:
        got = None if values is None else tuple(values.shape)
        raise ValueError(
            "advantage estimator 'gae' (config key 'adv_estimator') needs critic values of shape "
            f"[batch, response_length] = {tuple(token_level_rewards.shape)}, got {got}; configure a critic "
            "or pick an estimator without one (grpo, reinforce, rloo, ...)"
        )
    mask = response_mask.to(torch.bool)
    zeros = torch.zeros_like(token_level_rewards)
    rewards = torch.where(mask, token_level_rewards, zeros)
    values = torch.where(mask, values.to(rewards.dtype), zeros)
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    last_gae = torch.zeros_like(rewards[:, 0])
    discount = config.gamma * config.lambd
    for t in reversed(range(rewards.shape[-1])):  # scan over time, vectorised over the batch
        delta = rewards[:, t] + config.gamma * next_value - values[:, t]
        last_gae = torch.where(mask[:, t], delta + discount * last_gae, last_gae)
        next_value = torch.where(mask[:, t], values[:, t], next_value)
        advantages[:, t] = last_gae
    advantages = torch.where(mask, advantages, zeros)
    returns = torch.where(mask, advantages + values, zeros)
    return advantages, returns


@ADV_ESTIMATORS.register("reinforce")
def compute_reinforce_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    config: AdvantageConfig,
    values: torch.Tensor | None = None,
    group_index: GroupIndex | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE (Williams 1992): advantage = discounted return-to-go, no baseline (ROLL "reinforce")."""
    _check_shapes("reinforce", token_level_rewards, response_mask)
    returns = discounted_returns(token_level_rewards, response_mask, config.gamma)
    return returns, returns


@ADV_ESTIMATORS.register("reinforce_plus_plus")
def compute_reinforce_plus_plus_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    config: AdvantageConfig,
    values: torch.Tensor | None = None,
    group_index: GroupIndex | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262, sec. 3): discounted returns whitened over the batch's tokens.

    Returns are the un-whitened discounted returns.
    """
    _check_shapes("reinforce_plus_plus", token_level_rewards, response_mask)
    returns = discounted_returns(token_level_rewards, response_mask, config.gamma)
    return masked_whiten(returns, response_mask), returns


def _sequence_scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Outcome score of each sample: sum of its token-level rewards over valid tokens. ``[B]``."""
    return masked_sum(token_level_rewards, response_mask, dim=-1)


@ADV_ESTIMATORS.register("reinforce_plus_plus_baseline")
def compute_reinforce_plus_plus_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    config: AdvantageConfig,
    values: torch.Tensor | None = None,
    group_index: GroupIndex | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (Hu 2025, arXiv:2501.03262): ``score - group mean``, then whitened over the batch."""
    name = "reinforce_plus_plus_baseline"
    _check_shapes(name, token_level_rewards, response_mask)
    inverse, num_groups = _require_groups(name, group_index, token_level_rewards.shape[0])
    scores = _sequence_scores(token_level_rewards, response_mask)
    mean, _, _ = group_moments(scores, inverse, num_groups)
    centred, _ = _broadcast_outcome(scores - mean, response_mask)
    advantages = masked_whiten(centred, response_mask)
    return advantages, advantages


@ADV_ESTIMATORS.register("grpo")
def compute_grpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    config: AdvantageConfig,
    values: torch.Tensor | None = None,
    group_index: GroupIndex | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage (Shao et al. 2024, arXiv:2402.03300, sec. 4.1.2): ``(s - mean_g) / (std_g + eps)``.

    ``std_g`` is the unbiased group std. With ``norm_adv_by_std_in_grpo=False`` (Dr.GRPO, Liu et al. 2025,
    arXiv:2503.20783) only the mean is subtracted. Singletons get 0.
    """
    _check_shapes("grpo", token_level_rewards, response_mask)
    inverse, num_groups = _require_groups("grpo", group_index, token_level_rewards.shape[0])
    scores = _sequence_scores(token_level_rewards, response_mask)
    mean, std, count = group_moments(scores, inverse, num_groups)
    advantage = scores - mean
    if config.norm_adv_by_std_in_grpo:
        advantage = advantage / (std + config.epsilon)
    advantage = torch.where(count > 1, advantage, torch.zeros_like(advantage))
    return _broadcast_outcome(advantage, response_mask)


@ADV_ESTIMATORS.register("rloo")
def compute_rloo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    config: AdvantageConfig,
    values: torch.Tensor | None = None,
    group_index: GroupIndex | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al. 2024, arXiv:2402.14740, eq. 6): ``s_i - mean_{j != i} s_j`` within the group.

    Equivalently ``n / (n - 1) * (s_i - mean_g)``. Singletons have no other sample to compare with: 0.
    """
    _check_shapes("rloo", token_level_rewards, response_mask)
    inverse, num_groups = _require_groups("rloo", group_index, token_level_rewards.shape[0])
    scores = _sequence_scores(token_level_rewards, response_mask)
    mean, _, count = group_moments(scores, inverse, num_groups)
    advantage = count / (count - 1).clamp(min=1) * (scores - mean)
    advantage = torch.where(count > 1, advantage, torch.zeros_like(advantage))
    return _broadcast_outcome(advantage, response_mask)


@ADV_ESTIMATORS.register("opo")
def compute_opo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    config: AdvantageConfig,
    values: torch.Tensor | None = None,
    group_index: GroupIndex | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """On-Policy RL with Optimal reward baseline (Hao et al. 2025, arXiv:2505.23585, eq. 5).

    The variance-minimising baseline for sequence-level rewards is the length-weighted group mean
    ``b_g = sum_j |y_j| s_j / sum_j |y_j|`` (the sample itself included); advantage ``s_i - b_g``.
    ``|y_j|`` is the number of valid response tokens. Singletons get 0.
    """
    _check_shapes("opo", token_level_rewards, response_mask)
    inverse, num_groups = _require_groups("opo", group_index, token_level_rewards.shape[0])
    scores = _sequence_scores(token_level_rewards, response_mask)
    lengths = response_mask.to(scores.dtype).sum(dim=-1)
    inverse = inverse.to(scores.device)
    zeros = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device)
    weighted = zeros.index_add(0, inverse, lengths * scores)
    total_length = zeros.index_add(0, inverse, lengths)
    baseline = (weighted / total_length.clamp(min=1))[inverse]
    count = zeros.index_add(0, inverse, torch.ones_like(scores))[inverse]
    advantage = torch.where(count > 1, scores - baseline, torch.zeros_like(scores))
    return _broadcast_outcome(advantage, response_mask)


# ---------------------------------------------------------------------------------------------- entry
def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered as ``name``; raises naming the valid names and the key ``adv_estimator``."""
    return ADV_ESTIMATORS.get(name)


def compute_advantages(
    name: str,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    config: AdvantageConfig,
    values: torch.Tensor | None = None,
    group_index: GroupIndex | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run estimator ``name``, then optional ``whiten_advantages`` and ``advantage_clip`` as ROLL does.

    Shapes: ``[B, T]`` in and out; ``values`` ``[B, T]``; ``group_index`` ``[B]``. Whitening uses the mean and
    variance over all valid tokens of the batch and is skipped with fewer than two (no unbiased variance; ROLL skips
    it then too). Returns are untouched.
    """
    estimator = get_advantage_estimator(name)
    advantages, returns = estimator(
        token_level_rewards, response_mask, config=config, values=values, group_index=group_index
    )
    mask = response_mask.to(torch.bool)
    if config.whiten_advantages and int(mask.sum()) > 1:
        advantages = masked_whiten(advantages, mask)
    if config.advantage_clip is not None:
        advantages = advantages.clamp(-config.advantage_clip, config.advantage_clip)
    return torch.where(mask, advantages, torch.zeros_like(advantages)), returns
