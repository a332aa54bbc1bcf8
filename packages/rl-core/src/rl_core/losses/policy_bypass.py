"""verl's bypass mode (verl 0.9.1 ``compute_policy_loss_bypass_mode``, its ``bypass_mode`` loss mode).

Not in :data:`rl_core.losses.POLICY_LOSSES`: it is not a loss one picks by name (verl's trainer switches to it when
``rollout_correction.bypass_mode`` is true, and the old log-probs must then be the rollout's), and it computes its
own IS weights, so the registry's contract (external ``rollout_is_weights``, no required config) does not hold.

In bypass mode the pipeline skips the old-log-prob pass and trains against the rollout engine's log-probs:
``old_log_prob`` here *is* ``rollout_log_prob``. Per micro-batch, without gradients, the rollout correction of
``config.rollout_correction`` (:class:`rl_core.rollout_corr.RolloutCorrectionConfig`) runs between the current policy
and the rollout policy (``log_ratio = log_prob - rollout_log_prob``): its rejections shrink the mask, its IS weights
(``loss_type: reinforce`` only) weight the loss, and its ``rollout_corr/*`` metrics join the loss's metrics.

- ``ppo_clip``: clipped PPO (the ``vanilla`` loss, dual clip included) with the rollout policy as the old one, on
  the rejection mask; IS weights are computed for the metrics but not applied (verl's choice).
- ``reinforce``: ``-A * log_prob * w`` (``w`` detached; 1 without IS), no ratio and no clipping, on the rejection
  mask; ``ppo_kl`` = mean of ``rollout_log_prob - log_prob`` over the kept tokens.

Aggregation uses ``global_batch`` as given: computed from the unmodified mask (as verl's engine does), rejected
tokens leave the numerator of ``token-mean`` but not its denominator.
"""

from __future__ import annotations

import torch

from rl_core.losses.aggregation import GlobalBatchInfo
from rl_core.losses.config import PolicyLossConfig
from rl_core.losses.policy import LossInputs, Metrics, apply_is_weights, compute_policy_loss_vanilla
from rl_core.masked import any_set
from rl_core.rollout_corr import AllReduce, rollout_correction
from rl_core.rollout_corr_config import RolloutCorrectionConfig


def _correction(config: PolicyLossConfig | None) -> RolloutCorrectionConfig:
    correction = None if config is None else config.rollout_correction
    if not isinstance(correction, RolloutCorrectionConfig) or not correction.bypass_mode:
        raise ValueError(
            "the bypass_mode loss needs the rollout correction config with bypass_mode: true "
            "(config.rollout_correction); the pipeline must train against the rollout log-probs as the old policy."
        )
    return correction


def compute_policy_loss_bypass_mode(
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
    """verl's bypass-mode loss; ``old_log_prob`` holds the rollout log-probs. ``rollout_is_weights`` must be None
    (this loss computes its own)."""
    correction = _correction(config)
    if rollout_is_weights is not None:
        raise ValueError("the bypass_mode loss computes its own IS weights; pass rollout_is_weights=None.")
    weights: torch.Tensor | None = None
    kept, corr_metrics = response_mask, dict[str, float]()
    all_reduce = _data_parallel_sum(correction)
    if any_set(response_mask):
        with torch.no_grad():
            weights, kept, corr_metrics = rollout_correction(
                log_prob.detach(), old_log_prob.detach(), response_mask,
                rollout_is=correction.rollout_is, rollout_is_threshold=correction.rollout_is_threshold,
                rollout_is_batch_normalize=correction.rollout_is_batch_normalize, rollout_rs=correction.rollout_rs,
                rollout_rs_threshold=correction.rollout_rs_threshold, all_reduce=all_reduce,
            )  # fmt: skip
    elif all_reduce is not None:  # nothing to correct here, but the other ranks' batch mean waits for this one
        all_reduce(torch.zeros(2, dtype=torch.float64, device=log_prob.device))
    loss, metrics = BYPASS_LOSSES[correction.loss_type](
        old_log_prob, log_prob, advantages, kept, weights, loss_agg_mode, config, global_batch
    )
    device = log_prob.device
    metrics.update({name: torch.tensor(value, device=device) for name, value in corr_metrics.items()})
    return loss, metrics


def _data_parallel_sum(correction: RolloutCorrectionConfig) -> AllReduce | None:
    """With IS batch normalisation inside ``torch.distributed`` (verl's condition), the sum over all ranks of the
    default process group, which every rank's micro-batch loss joins: the batch mean is over all ranks' current
    micro-batches, as verl's. Ranks that hold the same samples (tensor / sequence parallel peers) count them
    equally often, which leaves the mean unchanged. None otherwise."""
    normalizes = correction.rollout_is is not None and correction.rollout_is_threshold is not None
    if not (normalizes and correction.rollout_is_batch_normalize):
        return None
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None

    def all_ranks_sum(values: torch.Tensor) -> torch.Tensor:
        torch.distributed.all_reduce(values)
        return values

    return all_ranks_sum


def _ppo_clip(
    rollout: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor, kept: torch.Tensor,
    _weights: torch.Tensor | None, loss_agg_mode: str, config: PolicyLossConfig | None,
    global_batch: GlobalBatchInfo | None,
) -> tuple[torch.Tensor, Metrics]:  # fmt: skip
    """Clipped PPO against the rollout policy on the kept tokens; the IS weights are not applied (verl)."""
    return compute_policy_loss_vanilla(rollout, log_prob, advantages, kept, loss_agg_mode=loss_agg_mode,
                                       config=config, global_batch=global_batch)  # fmt: skip


def _reinforce(
    rollout: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor, kept: torch.Tensor,
    weights: torch.Tensor | None, loss_agg_mode: str, _config: PolicyLossConfig | None,
    global_batch: GlobalBatchInfo | None,
) -> tuple[torch.Tensor, Metrics]:  # fmt: skip
    """``-A * log_prob * w`` on the kept tokens (``w`` detached; 1 without IS)."""
    x = LossInputs(rollout, log_prob, advantages, kept)
    loss = x.aggregate(apply_is_weights(-x.advantages * x.log_prob, weights), loss_agg_mode, global_batch)
    return loss, {"ppo_kl": x.mean(x.old_log_prob - x.log_prob)}


BYPASS_LOSSES = {"ppo_clip": _ppo_clip, "reinforce": _reinforce}
"""Bypass mode's ``loss_type`` -> its loss (keys: :data:`rl_core.rollout_corr_config.BYPASS_LOSS_TYPES`)."""
