"""Losses: policy-gradient variants, aggregation, value, entropy, SFT, KL and total loss.

Importing this package registers every policy loss (PPO family, covariance family, ROLL off-policy variants).
"""

from rl_core.losses import policy_cov as _policy_cov  # noqa: F401  (registers clip_cov, kl_cov, geo_mean)
from rl_core.losses import policy_offpolicy as _policy_offpolicy  # noqa: F401  (registers tis, topr, ...)
from rl_core.losses.aggregation import LOSS_AGGREGATIONS, GlobalBatchInfo, agg_loss
from rl_core.losses.config import PolicyLossConfig
from rl_core.losses.policy import POLICY_LOSSES, PolicyLoss, apply_is_weights, get_policy_loss
from rl_core.losses.terms import (
    LossCoefficients,
    compose_total_loss,
    compute_kl_loss,
    compute_sft_loss,
    compute_value_loss,
    entropy_from_logits,
)

__all__ = [
    "LOSS_AGGREGATIONS",
    "POLICY_LOSSES",
    "GlobalBatchInfo",
    "LossCoefficients",
    "PolicyLoss",
    "PolicyLossConfig",
    "agg_loss",
    "apply_is_weights",
    "compose_total_loss",
    "compute_kl_loss",
    "compute_sft_loss",
    "compute_value_loss",
    "entropy_from_logits",
    "get_policy_loss",
]
