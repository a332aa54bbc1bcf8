"""Reward processing before the advantage estimator, after ROLL's ``reward_postprocess`` / ``compute_token_reward``.

Order (as ROLL): sequence scores ``[B]`` -> optional length reward (``add_len_reward``) -> normalisation
(``reward_norm`` with ``reward_shift`` / ``reward_scale``) -> ``reward_clip`` -> token level ``[B, T]`` (score at the
last valid token) -> minus ``kl_coef * KL`` per token (``add_token_level_kl``) -> ``reward_clip`` again ->
optional ``whiten_rewards``. Sample weights for the loss (``difficulty_loss_weight``, ``length_loss_weight``) are
separate: :func:`compute_sample_weights`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from rl_core.advantages import GroupIndex, encode_groups, group_moments
from rl_core.kl import KL_ESTIMATORS, kl_penalty
from rl_core.masked import masked_mean, masked_whiten
from rl_core.registry import Registry


@dataclass
class RewardConfig:
    """Reward-processing keys of ROLL's PPO section."""

    reward_norm: str | None = None
    """Sequence-reward normalisation: "batch", "group", "running" or None (none)."""
    reward_shift: bool = False
    """Normalisation only subtracts the mean (no division by the std)."""
    reward_scale: bool = False
    """Normalisation only divides by the std (no mean subtraction)."""
    reward_clip: float | None = None
    """Clamp rewards to [-reward_clip, reward_clip] (sequence level after normalisation, token level after KL)."""
    whiten_rewards: bool = False
    """Whiten token-level rewards over all valid tokens of the batch before the advantage estimator."""
    add_len_reward: bool = False
    """Add the Kimi k1.5 length reward (see compute_length_reward) to the sequence scores before normalising."""
    len_reward_coef: float = 1.0
    """Weight of the length reward when add_len_reward is set."""
    difficulty_loss_weight: bool = False
    """Weight samples by difficulty in the loss: 0.5 + 1.5 * clamp(difficulty, 0, 1)."""
    length_loss_weight: bool = False
    """Weight samples by response length in the loss: 1.5 - batch-min-max-normalised length."""
    add_token_level_kl: bool = False
    """Subtract kl_coef * KL(policy || reference) from every token's reward (InstructGPT-style KL reward)."""
    kl_penalty: str = "kl"
    """Per-token KL estimator for the KL reward: kl/k1, abs, mse/k2, low_var_kl/k3, full."""
    epsilon: float = 1e-6
    """Added to the std before dividing in reward normalisation."""

    def __post_init__(self) -> None:
        normalizer_name(self.reward_norm)  # raises naming 'reward_norm' when unknown
        KL_ESTIMATORS.get(self.kl_penalty)  # raises naming 'kl_penalty' when unknown
        if self.reward_shift and self.reward_scale:
            raise ValueError(
                "reward_shift and reward_scale are both set; reward_shift only subtracts the mean and "
                "reward_scale only divides by the std, so set at most one (neither = full normalisation)"
            )
        if self.reward_clip is not None and not self.reward_clip > 0:
            raise ValueError(f"reward_clip must be None or > 0, got {self.reward_clip}")
        if not self.epsilon > 0:
            raise ValueError(f"epsilon must be > 0, got {self.epsilon}")


class RunningMoments:
    """Running mean / variance of a reward stream in float64 (Welford, merged per batch as in Chan et al. 1979).

    ``std`` is the unbiased (Bessel-corrected) std of everything seen, 0 before two values have been seen.
    ``state_dict`` / ``load_state_dict`` round-trip exactly, so a resumed run normalises like an uninterrupted one.
    """

    def __init__(self) -> None:
        self.count: int = 0
        self.mean: float = 0.0
        self.m2: float = 0.0  # sum of squared deviations from the mean

    def update(self, values: torch.Tensor) -> None:
        """Fold in every element of ``values`` (any shape)."""
        batch = values.detach().reshape(-1).to(torch.float64)
        n_b = batch.numel()
        if n_b == 0:
            return
        mean_b = float(batch.mean())
        m2_b = float((batch - mean_b).square().sum())
        total = self.count + n_b
        delta = mean_b - self.mean
        self.mean += delta * n_b / total
        self.m2 += m2_b + delta * delta * self.count * n_b / total
        self.count = total

    @property
    def var(self) -> float:
        """Unbiased variance of all values seen (0 with fewer than two)."""
        return self.m2 / (self.count - 1) if self.count > 1 else 0.0

    @property
    def std(self) -> float:
        """Unbiased std of all values seen (0 with fewer than two)."""
        return math.sqrt(self.var)

    def state_dict(self) -> dict[str, float | int]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        missing = {"count", "mean", "m2"} - set(state)
        if missing:
            raise ValueError(f"RunningMoments state is missing {sorted(missing)}; expected count, mean and m2")
        self.count = int(state["count"])
        self.mean = float(state["mean"])
        self.m2 = float(state["m2"])


class RewardNormalizer(Protocol):
    """Signature of every ``reward_norm`` variant: sequence scores ``[B]`` -> ``[B]``."""

    def __call__(
        self,
        scores: torch.Tensor,
        *,
        group_index: GroupIndex | None,
        running: RunningMoments | None,
        reward_shift: bool,
        reward_scale: bool,
        epsilon: float,
    ) -> torch.Tensor: ...


REWARD_NORMS: Registry[RewardNormalizer] = Registry("reward normalisation", "reward_norm")


def _standardise(
    scores: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, shift: bool, scale: bool, eps: float
) -> torch.Tensor:
    """``(x - mean) / (std + eps)``; ``shift`` keeps only the subtraction, ``scale`` only the division.

    A (near-)constant set (std <= eps) carries no scale, so it is not divided: otherwise ``reward_scale``
    would multiply every reward by 1 / eps.
    """
    out = scores if scale else scores - mean
    if not shift:
        out = out / torch.where(std > eps, std + eps, torch.ones_like(std))
    return out


@REWARD_NORMS.register("none", "None")
def _norm_none(
    scores: torch.Tensor,
    *,
    group_index: GroupIndex | None,
    running: RunningMoments | None,
    reward_shift: bool,
    reward_scale: bool,
    epsilon: float,
) -> torch.Tensor:
    """No normalisation (``reward_norm: null``)."""
    return scores


@REWARD_NORMS.register("batch")
def _norm_batch(
    scores: torch.Tensor,
    *,
    group_index: GroupIndex | None,
    running: RunningMoments | None,
    reward_shift: bool,
    reward_scale: bool,
    epsilon: float,
) -> torch.Tensor:
    """Mean and unbiased std over the whole batch."""
    zeros = torch.zeros(scores.shape[0], dtype=torch.long)
    mean, std, _ = group_moments(scores, zeros, 1)
    return _standardise(scores, mean, std, reward_shift, reward_scale, epsilon)


@REWARD_NORMS.register("group")
def _norm_group(
    scores: torch.Tensor,
    *,
    group_index: GroupIndex | None,
    running: RunningMoments | None,
    reward_shift: bool,
    reward_scale: bool,
    epsilon: float,
) -> torch.Tensor:
    """Mean and unbiased std within each prompt group (a singleton becomes 0 unless ``reward_scale``)."""
    what = "reward normalisation 'group' (config key 'reward_norm')"
    if group_index is None:
        raise ValueError(f"{what} needs group_index: one prompt-group id per sample; got None")
    inverse, num_groups = encode_groups(group_index, scores.shape[0], what=what)
    mean, std, _ = group_moments(scores, inverse, num_groups)
    return _standardise(scores, mean, std, reward_shift, reward_scale, epsilon)


@REWARD_NORMS.register("running")
def _norm_running(
    scores: torch.Tensor,
    *,
    group_index: GroupIndex | None,
    running: RunningMoments | None,
    reward_shift: bool,
    reward_scale: bool,
    epsilon: float,
) -> torch.Tensor:
    """Running mean / std over all batches so far, this batch included (``running`` is updated in place)."""
    if running is None:
        raise ValueError("reward normalisation 'running' (config key 'reward_norm') needs a RunningMoments")
    running.update(scores)
    mean = torch.tensor(running.mean, dtype=scores.dtype, device=scores.device)
    std = torch.tensor(running.std, dtype=scores.dtype, device=scores.device)
    return _standardise(scores, mean, std, reward_shift, reward_scale, epsilon)


def normalizer_name(reward_norm: str | None) -> str:
    """Canonical registry name for a ``reward_norm`` value (None -> "none"); raises naming the key."""
    return REWARD_NORMS.canonical_name("none" if reward_norm is None else reward_norm)


def normalize_rewards(
    scores: torch.Tensor,
    reward_norm: str | None,
    *,
    group_index: GroupIndex | None = None,
    running: RunningMoments | None = None,
    reward_shift: bool = False,
    reward_scale: bool = False,
    epsilon: float = 1e-6,
) -> torch.Tensor:
    """Normalise sequence rewards ``[B]`` by ``reward_norm`` ("batch", "group", "running" or None). ``[B]``."""
    normalizer = REWARD_NORMS.get(normalizer_name(reward_norm))
    return normalizer(
        scores,
        group_index=group_index,
        running=running,
        reward_shift=reward_shift,
        reward_scale=reward_scale,
        epsilon=epsilon,
    )


def clip_rewards(rewards: torch.Tensor, reward_clip: float | None) -> torch.Tensor:
    """Clamp to ``[-reward_clip, reward_clip]``; None leaves the rewards as they are. Any shape."""
    return rewards if reward_clip is None else rewards.clamp(-reward_clip, reward_clip)


def compute_length_reward(
    response_mask: torch.Tensor, correct: torch.Tensor, group_index: GroupIndex | None = None
) -> torch.Tensor:
    """Kimi k1.5 length reward (Kimi Team 2025, arXiv:2501.12599, sec. 2.3.3). ``[B, T]`` mask, ``[B]`` -> ``[B]``.

    ``lam = 0.5 - (len - min_len) / (max_len - min_len)`` with min / max over the sample's group (the whole
    batch when ``group_index`` is None); reward ``lam`` if correct, ``min(0, lam)`` otherwise. A group whose
    responses all have the same length gets 0. Computed in float64. ROLL only declares ``add_len_reward``
    (no implementation); this is our definition.
    """
    lengths = response_mask.to(torch.float64).sum(dim=-1)
    batch = lengths.shape[0]
    if group_index is None:
        inverse, num_groups = torch.zeros(batch, dtype=torch.long), 1
    else:
        inverse, num_groups = encode_groups(group_index, batch, what="add_len_reward")
    inverse = inverse.to(lengths.device)
    empty = torch.zeros(num_groups, dtype=lengths.dtype, device=lengths.device)
    min_len = empty.scatter_reduce(0, inverse, lengths, reduce="amin", include_self=False)[inverse]
    max_len = empty.scatter_reduce(0, inverse, lengths, reduce="amax", include_self=False)[inverse]
    spread = max_len - min_len
    lam = torch.where(spread > 0, 0.5 - (lengths - min_len) / spread.clamp(min=1), torch.zeros_like(lengths))
    return torch.where(correct.to(device=lam.device, dtype=torch.bool), lam, lam.clamp(max=0.0))


def compute_sample_weights(
    response_mask: torch.Tensor,
    *,
    difficulty: torch.Tensor | None = None,
    difficulty_loss_weight: bool = False,
    length_loss_weight: bool = False,
) -> torch.Tensor:
    """Per-sample loss weights ``[B]`` from ROLL's ``compute_sample_weights``, renormalised to mean 1.

    Difficulty weight ``0.5 + 1.5 * clamp(difficulty, 0, 1)`` (harder -> heavier); length weight
    ``1.5 - (len - min) / (max - min + 1e-8)`` over the batch (longer -> lighter). ``response_mask`` ``[B, T]``.
    """
    lengths = response_mask.to(torch.float32).sum(dim=-1)
    weights = torch.ones_like(lengths)
    if difficulty_loss_weight:
        if difficulty is None:
            raise ValueError("difficulty_loss_weight is set but no per-sample difficulty was given")
        weights = weights * (0.5 + 1.5 * difficulty.to(weights).clamp(0.0, 1.0))
    if length_loss_weight and lengths.numel() > 0:
        norm_len = (lengths - lengths.min()) / (lengths.max() - lengths.min() + 1e-8)
        weights = weights * (1.5 - norm_len)
    total = weights.sum()
    if total > 0:
        weights = weights * (lengths.shape[0] / total)
    return weights


def scores_to_token_level(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence score ``[B]`` on its last valid token; ``[B, T]``, zeros elsewhere (and for empty rows)."""
    mask = response_mask.to(torch.bool)
    length = mask.shape[-1]
    last = (length - 1) - mask.flip(-1).to(torch.int8).argmax(dim=-1)  # index of the last True per row
    rows = torch.arange(mask.shape[0], device=mask.device)
    out = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    out[rows, last] = scores
    return torch.where(mask, out, torch.zeros_like(out))


def apply_token_level_kl(
    token_level_scores: torch.Tensor,
    response_mask: torch.Tensor,
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    *,
    kl_coef: float,
    kind: str = "kl",
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """KL-penalised rewards ``r_t = score_t - kl_coef * KL_t`` (Ziegler et al. 2019, arXiv:1909.08593, eq. 2).

    Returns (token_level_rewards ``[B, T]``, per-token KL ``[B, T]``, batch KL). All zero outside the mask.
    The batch KL, fed to the KL controller, is the mean over samples with a valid token of each sample's
    token-mean KL (ROLL's ``current_kl``, without counting empty samples as KL 0).
    """
    mask = response_mask.to(torch.bool)
    zeros = torch.zeros_like(token_level_scores)
    kl = torch.where(mask, kl_penalty(log_prob, ref_log_prob, kind).to(token_level_scores.dtype), zeros)
    rewards = torch.where(mask, token_level_scores - kl_coef * kl, zeros)
    return rewards, kl, _sequence_mean_kl(kl, mask)


def _sequence_mean_kl(kl: torch.Tensor, mask: torch.Tensor) -> float:
    """The mean over samples with a token in ``mask`` of each sample's token-mean ``kl``."""
    per_sample = masked_mean(kl, mask, dim=-1)
    return float(masked_mean(per_sample, mask.any(dim=-1)))


def sequence_mean_kl(response_mask: torch.Tensor, log_prob: torch.Tensor, ref_log_prob: torch.Tensor,
                     kind: str = "kl") -> float:  # fmt: skip
    """:func:`apply_token_level_kl`'s batch KL alone, over the tokens of ``response_mask``."""
    mask = response_mask.to(torch.bool)
    kl = torch.where(mask, kl_penalty(log_prob, ref_log_prob, kind), torch.zeros((), dtype=log_prob.dtype))
    return _sequence_mean_kl(kl, mask)


def whiten_token_rewards(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``whiten_rewards``: zero mean, unit variance over the batch's valid tokens; 0 outside. ``[B, T]``. With fewer
    than two valid tokens (no unbiased variance) the rewards stay as they are, as ROLL skips whitening then."""
    mask = response_mask.to(torch.bool)
    if int(mask.sum()) < 2:
        return torch.where(mask, token_level_rewards, torch.zeros_like(token_level_rewards))
    return masked_whiten(token_level_rewards, response_mask)


def process_sequence_rewards(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    config: RewardConfig,
    group_index: GroupIndex | None = None,
    running: RunningMoments | None = None,
    correct: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sequence scores ``[B]`` -> response-level rewards ``[B]``: length reward, ``reward_norm``, ``reward_clip``.

    ``correct`` ``[B]`` (for the length reward) defaults to ``scores > 0``, i.e. verifiable 0/1 rewards.
    """
    rewards = scores
    if config.add_len_reward:
        is_correct = scores > 0 if correct is None else correct
        length_reward = compute_length_reward(response_mask, is_correct, group_index).to(scores)
        rewards = rewards + config.len_reward_coef * length_reward
    rewards = normalize_rewards(
        rewards,
        config.reward_norm,
        group_index=group_index,
        running=running,
        reward_shift=config.reward_shift,
        reward_scale=config.reward_scale,
        epsilon=config.epsilon,
    )
    return clip_rewards(rewards, config.reward_clip)


def build_token_level_rewards(
    response_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    config: RewardConfig,
    kl_coef: float = 0.0,
    log_prob: torch.Tensor | None = None,
    ref_log_prob: torch.Tensor | None = None,
    kl_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, float | None]:
    """Response-level rewards ``[B]`` -> token-level rewards ``[B, T]`` and the batch KL (None without log-probs).

    The KL is measured whenever both log-probs are given (the adaptive controller needs it) but only
    subtracted from the rewards with ``add_token_level_kl``. Then ``reward_clip`` and ``whiten_rewards``.
    ``kl_mask``: the tokens the batch KL is measured over when they differ from ``response_mask`` (ROLL measures
    it over the responses as generated, before its sample masks take samples out of ``response_mask``).
    """
    rewards = scores_to_token_level(response_level_rewards, response_mask)
    batch_kl: float | None = None
    if log_prob is not None and ref_log_prob is not None:
        coef = kl_coef if config.add_token_level_kl else 0.0
        rewards, _, batch_kl = apply_token_level_kl(
            rewards, response_mask, log_prob, ref_log_prob, kl_coef=coef, kind=config.kl_penalty
        )
        if kl_mask is not None:
            batch_kl = sequence_mean_kl(kl_mask, log_prob, ref_log_prob, config.kl_penalty)
    elif config.add_token_level_kl:
        raise ValueError("add_token_level_kl is set but log_prob / ref_log_prob were not given")
    rewards = clip_rewards(rewards, config.reward_clip)
    if config.whiten_rewards:
        rewards = whiten_token_rewards(rewards, response_mask)
    return rewards, batch_kl
