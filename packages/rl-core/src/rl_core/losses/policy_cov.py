"""Covariance-based entropy-preserving losses (Clip-Cov, KL-Cov; Cui et al. 2025, "The Entropy Mechanism of
Reinforcement Learning for Reasoning Language Models", section 4) and GMPO's geometric-mean loss.

Registered in the shared policy-loss registry; see :mod:`rl_core.losses.policy` for the common signature.
"""

from __future__ import annotations

import torch

from rl_core.losses.aggregation import LOSS_AGGREGATIONS, GlobalBatchInfo, agg_loss
from rl_core.losses.config import PolicyLossConfig
from rl_core.losses.policy import (
    POLICY_LOSSES,
    LossInputs,
    Metrics,
    _clipped_surrogate,
    _config,
    apply_is_weights,
)
from rl_core.masked import masked_mean


def token_covariance(x: LossInputs) -> torch.Tensor:
    """Centred product ``(A - mean A) * (log pi - mean log pi)`` per token, detached ``[B, T]`` (eq. 11)."""
    adv_centered = x.advantages - masked_mean(x.advantages, x.mask)
    logp = x.log_prob.detach()
    return adv_centered * (logp - masked_mean(logp, x.mask))


@POLICY_LOSSES.register("clip_cov", "clip-cov")
def compute_policy_loss_clip_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    config: PolicyLossConfig | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch: GlobalBatchInfo | None = None,
    sample_scores: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Clip-Cov: detach the gradient of a random ``clip_cov_ratio`` share of tokens whose covariance lies in
    ``(clip_cov_lb, clip_cov_ub)`` and which PPO clipping did not already remove (Cui et al. 2025, eq. 13).

    Uses PPO's clipped surrogate (no dual clip). ``config.seed`` makes the token choice reproducible.
    """
    cfg = _config(config)
    x = LossInputs(old_log_prob, log_prob, advantages, response_mask)
    log_ratio = x.log_ratio()
    pg_losses, clipped = _clipped_surrogate(x.advantages, torch.exp(log_ratio), cfg.low, cfg.high)
    cov = token_covariance(x)
    eligible = x.mask & ~clipped & (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub)
    candidates = torch.nonzero(eligible.reshape(-1)).squeeze(-1)
    num_clip = max(int(cfg.clip_cov_ratio * float(x.mask.sum())), 1)
    detached = torch.zeros_like(x.mask)
    if candidates.numel() > 0:
        generator = None
        if cfg.seed is not None:
            generator = torch.Generator(device="cpu").manual_seed(cfg.seed)
        order = torch.randperm(candidates.numel(), generator=generator).to(candidates.device)
        chosen = candidates[order[:num_clip]]
        detached.view(-1)[chosen] = True
    # The chosen tokens keep their value in the loss but contribute no gradient.
    pg_losses = torch.where(detached, pg_losses.detach(), pg_losses)
    pg_losses = apply_is_weights(pg_losses, rollout_is_weights)
    loss = x.aggregate(pg_losses, loss_agg_mode, global_batch)
    metrics = {
        "pg_clipfrac": x.mean(clipped | detached),
        "pg_clipfrac_lower": torch.zeros((), dtype=loss.dtype, device=loss.device),
        "ppo_kl": x.ppo_kl(log_ratio),
    }
    return loss, metrics


@POLICY_LOSSES.register("kl_cov", "kl-cov")
def compute_policy_loss_kl_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    config: PolicyLossConfig | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch: GlobalBatchInfo | None = None,
    sample_scores: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """KL-Cov: unclipped surrogate ``-A * r``, plus ``ppo_kl_coef * |log r|`` on the top ``kl_cov_ratio``
    share of valid tokens by covariance (Cui et al. 2025, eq. 14)."""
    cfg = _config(config)
    x = LossInputs(old_log_prob, log_prob, advantages, response_mask)
    log_ratio = x.log_ratio()
    pg_losses = -x.advantages * torch.exp(log_ratio)
    num_valid = int(x.mask.sum())
    penalised = torch.zeros_like(x.mask)
    if num_valid > 0 and cfg.kl_cov_ratio > 0:
        k = max(1, int(num_valid * cfg.kl_cov_ratio))
        cov = token_covariance(x).masked_fill(~x.mask, float("-inf"))
        top = torch.topk(cov.reshape(-1), k).indices
        penalised.view(-1)[top] = True
    pg_losses = torch.where(penalised, pg_losses + cfg.ppo_kl_coef * log_ratio.abs(), pg_losses)
    pg_losses = apply_is_weights(pg_losses, rollout_is_weights)
    loss = x.aggregate(pg_losses, loss_agg_mode, global_batch)
    metrics = {
        "pg_clipfrac": x.mean(penalised),
        "pg_clipfrac_lower": torch.zeros((), dtype=loss.dtype, device=loss.device),
        "ppo_kl": x.mean(log_ratio.abs()),
    }
    return loss, metrics


@POLICY_LOSSES.register("geo_mean", "gmpo")
def compute_policy_loss_geo_mean(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: PolicyLossConfig | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch: GlobalBatchInfo | None = None,
    sample_scores: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """GMPO (Zhao et al. 2025, eq. 4): maximise the geometric mean of token ratios, clipped token-wise in
    log space to ``[-clip_ratio_low, clip_ratio_high]`` (the paper uses 0.4).

    The objective is per sequence, so the loss is a mean over sequences whatever ``loss_agg_mode`` says;
    token-level rollout IS weights are reduced to their per-sequence mean (the verl PR's special case).
    """
    cfg = _config(config)
    LOSS_AGGREGATIONS.get(loss_agg_mode)  # reject a misspelt mode even though GMPO ignores it
    x = LossInputs(old_log_prob, log_prob, advantages, response_mask)
    log_ratio = x.log_ratio()
    sign = torch.sign(x.advantages)
    clamped = log_ratio.clamp(-cfg.low, cfg.high)
    # Pessimistic per token: for A > 0 take the smaller log ratio, for A < 0 the larger one.
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clamped)
    seq_ratio = torch.exp(masked_mean(pessimistic, x.mask, dim=-1))  # [B]
    seq_adv = masked_mean(x.advantages, x.mask, dim=-1)  # [B]
    seq_losses = -seq_adv * seq_ratio
    if rollout_is_weights is not None:
        seq_losses = seq_losses * masked_mean(rollout_is_weights.detach().to(seq_losses.dtype), x.mask, dim=-1)
    seq_valid = x.mask.any(dim=-1, keepdim=True)  # [B, 1]
    loss = agg_loss(seq_losses.unsqueeze(-1), seq_valid, "token-mean", global_batch=_per_sequence(global_batch))
    clipped = sign * log_ratio > sign * clamped
    metrics = {
        "pg_clipfrac": x.mean(clipped),
        "pg_clipfrac_lower": torch.zeros((), dtype=loss.dtype, device=loss.device),
        "ppo_kl": x.ppo_kl(log_ratio),
    }
    return loss, metrics


def _per_sequence(info: GlobalBatchInfo | None) -> GlobalBatchInfo | None:
    """Token-mean over a ``[B, 1]`` per-sequence loss divides by the number of valid sequences."""
    if info is None:
        return None
    return GlobalBatchInfo(num_tokens=info.num_seqs, num_seqs=info.num_seqs)


__all__ = [
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_kl_cov",
    "token_covariance",
]
