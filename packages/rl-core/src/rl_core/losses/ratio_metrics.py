"""ROLL's actor metrics of the policy ratio, under ROLL's names and meanings (its RLVR ``ActorWorker`` /
``ActorPGWorker`` ``loss_func``), logged beside the policy losses' own metrics (verl's names: ``pg_clipfrac``,
``ppo_kl``), so that a ROLL user's dashboards find what they plot.

All are detached 0-dim tensors over the tokens of ``response_mask``. With ``global_batch`` the additive ones are
this micro-batch's share of the mini-batch value (summed over micro-batches and ranks they give it, as ROLL's
``@sum`` metrics); ``ratio_max`` / ``ratio_min`` are this micro-batch's extremes (ROLL's ``@max`` / ``@min``;
-inf / inf without a token), reduced by max / min.

- ``ratio_mean``: mean over samples of each sample's mean ratio ``pi / pi_old``; ``ratio_max`` / ``ratio_min``.
- ``approxkl``: ``0.5 * log_ratio^2`` and ``policykl``: ``log_ratio`` (= ``log pi - log pi_old``), aggregated by
  ``loss_agg_mode`` as ROLL does.
- With ``ppo_clip`` (ROLL's PPO ``ActorWorker``): ``ppo_ratio_high_clipfrac`` / ``ppo_ratio_low_clipfrac`` (token
  fractions with ratio above ``1 + clip_high`` / below ``1 - clip_low``), ``ppo_ratio_clipfrac`` (their sum) and
  ``clipfrac`` (where the clipped surrogate is the smaller one, aggregated by ``loss_agg_mode`` as ROLL does).

``ratio_level``: ``token``; ``sequence``, one ratio per sample, ``exp`` of its mean token log-ratio (ROLL's RLVR
``importance_sampling: seq``); ``segment``, one per run of response tokens (ROLL's agentic ``ratio_type: segment``).
``approxkl`` / ``policykl`` read the token log-ratios whatever the level, as ROLL's do. As in ROLL the ratio is not
clamped (a ratio that overflows shows as inf).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from rl_core.losses.aggregation import GlobalBatchInfo, aggregate_masked
from rl_core.masked import is_set, masked_mean, segment_mean

RATIO_LEVELS = ("token", "sequence", "segment")

EXTREME_METRICS = {"ratio_max": "max", "ratio_min": "min"}
"""The metrics reduced by max / min over micro-batches, ranks and mini-batches (the others add up)."""
SHARE_METRICS = frozenset({"ratio_mean", "approxkl", "policykl", "ppo_ratio_high_clipfrac",
                           "ppo_ratio_low_clipfrac", "ppo_ratio_clipfrac", "clipfrac"})  # fmt: skip
"""The metrics that are a micro-batch's share of the mini-batch value when given ``global_batch``."""


def ratio_metrics(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    global_batch: GlobalBatchInfo | None = None,
    ratio_level: str = "token",
    ppo_clip: tuple[float, float] | None = None,
) -> dict[str, torch.Tensor]:
    """ROLL's ratio metrics of one micro-batch (see the module docstring); ``ppo_clip``: ``(clip_low,
    clip_high)`` of a PPO loss, which adds its clip fractions."""
    with torch.no_grad():
        mask = is_set(response_mask)
        maskf = mask.to(log_prob.dtype)
        zero = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
        log_ratio = torch.where(mask, log_prob - old_log_prob.to(log_prob.dtype), zero)
        shared = _shared_log_ratio(log_ratio, mask, ratio_level)
        ratio = torch.where(mask, torch.exp(shared), zero)

        def aggregate(values: torch.Tensor, mode: str) -> torch.Tensor:
            return aggregate_masked(torch.where(mask, values.to(maskf.dtype), zero), maskf, mode, global_batch)

        out = {
            "ratio_mean": aggregate(ratio, "seq-mean-token-mean"),
            "ratio_max": torch.where(mask, ratio, -math.inf).amax() if mask.numel() else zero - math.inf,
            "ratio_min": torch.where(mask, ratio, math.inf).amin() if mask.numel() else zero + math.inf,
            "approxkl": aggregate(0.5 * log_ratio * log_ratio, loss_agg_mode),
            "policykl": aggregate(log_ratio, loss_agg_mode),
        }
        if ppo_clip is not None:
            out.update(_clip_fractions(ratio, torch.where(mask, advantages.to(ratio.dtype), zero), ppo_clip,
                                       aggregate, loss_agg_mode))  # fmt: skip
    return out


def _shared_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """The log-ratio each token's ratio is ``exp`` of at ``level`` (0 at padding)."""
    if level == "token":
        return log_ratio
    if level == "segment":
        return segment_mean(log_ratio, mask)
    if level != "sequence":
        raise ValueError(f"ratio_level={level!r}: use one of {list(RATIO_LEVELS)}.")
    per_sample = masked_mean(log_ratio, mask, dim=-1).unsqueeze(-1).expand_as(log_ratio)
    return torch.where(mask, per_sample, torch.zeros_like(log_ratio))


def _clip_fractions(
    ratio: torch.Tensor, advantages: torch.Tensor, clip: tuple[float, float],
    aggregate: Callable[[torch.Tensor, str], torch.Tensor], loss_agg_mode: str,
) -> dict[str, torch.Tensor]:  # fmt: skip
    low, high = clip
    below, above = ratio < 1.0 - low, ratio > 1.0 + high
    surrogate, clipped = ratio * advantages, ratio.clamp(1.0 - low, 1.0 + high) * advantages
    return {
        "ppo_ratio_high_clipfrac": aggregate(above, "token-mean"),
        "ppo_ratio_low_clipfrac": aggregate(below, "token-mean"),
        "ppo_ratio_clipfrac": aggregate(above | below, "token-mean"),
        "clipfrac": aggregate(clipped < surrogate, loss_agg_mode),
    }
