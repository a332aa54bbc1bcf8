"""REINFORCE-style off-policy losses from ROLL's ``pg_variant`` (tis, topr, cispo, kimi15).

They differentiate ``log pi`` weighted by a *detached* (truncated) importance ratio instead of clipping a
surrogate, so their value differs from PPO's while the gradient at ratio 1 is the same ``-A * grad log pi``.
Registered in the shared policy-loss registry; see :mod:`rl_core.losses.policy` for the common signature.
"""

from __future__ import annotations

import torch

from rl_core.losses.aggregation import GlobalBatchInfo
from rl_core.losses.config import PolicyLossConfig
from rl_core.losses.policy import POLICY_LOSSES, LossInputs, Metrics, _config, apply_is_weights
from rl_core.masked import masked_mean


def _weighted_log_prob_loss(x: LossInputs, weight: torch.Tensor) -> torch.Tensor:
    """``-sg(weight) * A * log pi`` per token."""
    return -weight.detach() * x.advantages * x.log_prob


def _finish(
    x: LossInputs,
    pg_losses: torch.Tensor,
    loss_agg_mode: str,
    rollout_is_weights: torch.Tensor | None,
    global_batch: GlobalBatchInfo | None,
    metrics: Metrics,
) -> tuple[torch.Tensor, Metrics]:
    pg_losses = apply_is_weights(pg_losses, rollout_is_weights)
    loss = x.aggregate(pg_losses, loss_agg_mode, global_batch)
    metrics["ppo_kl"] = x.ppo_kl(x.log_ratio())
    return loss, metrics


@POLICY_LOSSES.register("tis")
def compute_policy_loss_tis(
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
    """Truncated IS policy gradient: ``-sg(clip(r, tis_lower_bound, tis_upper_bound)) * A * log pi``."""
    cfg = _config(config)
    x = LossInputs(old_log_prob, log_prob, advantages, response_mask)
    ratio = torch.exp(x.log_ratio())
    weight = ratio.clamp(cfg.tis_lower_bound, cfg.tis_upper_bound)
    metrics = {
        "tis_lower_clipfrac": x.mean(ratio < cfg.tis_lower_bound),
        "tis_upper_clipfrac": x.mean(ratio > cfg.tis_upper_bound),
        "tis_clipped_ratio_mean": x.mean(weight),
    }
    pg_losses = _weighted_log_prob_loss(x, weight)
    return _finish(x, pg_losses, loss_agg_mode, rollout_is_weights, global_batch, metrics)


@POLICY_LOSSES.register("topr")
def compute_policy_loss_topr(
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
    """TOPR (Le Roux et al. 2025, eq. 8): SFT-like ``-A log pi`` on positive sequences, ``[r]_0^1``-truncated
    IS on the others.

    ``sample_scores`` ``[B]`` (the sequence rewards) split positive (> 0) from non-positive sequences, as in
    the paper; without them the sign of each sequence's mean advantage decides.
    """
    cfg = _config(config)
    x = LossInputs(old_log_prob, log_prob, advantages, response_mask)
    if sample_scores is None:
        positive = masked_mean(x.advantages, x.mask, dim=-1) > 0
    else:
        positive = sample_scores.detach().reshape(-1).to(x.log_prob.device) > 0
    positive_tokens = positive.unsqueeze(-1).expand_as(x.mask)
    ratio = torch.exp(x.log_ratio())
    negative_weight = ratio.clamp(0.0, 1.0) * cfg.topr_negative_weight
    positive_weight = torch.full_like(ratio, cfg.topr_positive_weight)
    weight = torch.where(positive_tokens, positive_weight, negative_weight)
    metrics = {
        "topr_positive_fraction": positive.to(x.log_prob.dtype).mean(),
        "topr_negative_clipfrac": x.mean(~positive_tokens & (ratio > 1.0)),
    }
    pg_losses = _weighted_log_prob_loss(x, weight)
    return _finish(x, pg_losses, loss_agg_mode, rollout_is_weights, global_batch, metrics)


@POLICY_LOSSES.register("cispo")
def compute_policy_loss_cispo(
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
    """CISPO (MiniMax-M1 2025, eq. 4): clip the detached IS weight, never the token's gradient:
    ``-sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log pi``; with ``cispo_use_unified_mask`` (eq. 7) tokens
    PPO would clip are dropped."""
    cfg = _config(config)
    x = LossInputs(old_log_prob, log_prob, advantages, response_mask)
    ratio = torch.exp(x.log_ratio())
    lower, upper = 1.0 - cfg.cispo_epsilon_low, 1.0 + cfg.cispo_epsilon_high
    weight = ratio.clamp(lower, upper)
    pg_losses = _weighted_log_prob_loss(x, weight)
    metrics = {
        "cispo_lower_clipfrac": x.mean(ratio < lower),
        "cispo_upper_clipfrac": x.mean(ratio > upper),
    }
    if cfg.cispo_use_unified_mask:
        dropped = ((x.advantages > 0) & (ratio > upper)) | ((x.advantages < 0) & (ratio < lower))
        pg_losses = torch.where(dropped, torch.zeros_like(pg_losses), pg_losses)
        metrics["cispo_masked_fraction"] = x.mean(dropped)
    return _finish(x, pg_losses, loss_agg_mode, rollout_is_weights, global_batch, metrics)


@POLICY_LOSSES.register("kimi15")
def compute_policy_loss_kimi15(
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
    """Kimi k1.5 (2025, eq. 3) online mirror descent surrogate:
    ``-A * log pi + tau / 2 * (log pi - log pi_old)**2``."""
    cfg = _config(config)
    x = LossInputs(old_log_prob, log_prob, advantages, response_mask)
    log_ratio = x.log_prob - x.old_log_prob
    pg_losses = -x.advantages * x.log_prob + 0.5 * cfg.kimi15_tau * log_ratio.square()
    metrics = {"kimi15_log_ratio_abs_mean": x.mean(log_ratio.abs())}
    return _finish(x, pg_losses, loss_agg_mode, rollout_is_weights, global_batch, metrics)
