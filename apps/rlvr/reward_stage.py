"""ROLL's RLVR reward stage (``reward_postprocess`` then ``compute_advantage`` in ``roll/utils/functionals.py``) on
top of the shared :class:`apps.common.algorithm.AlgorithmSettings`: which normalisation the response rewards get, and
what ``grpo`` is."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from apps.common.algorithm import AlgorithmSettings

ROLL_REWARD_NORMS: dict[tuple[str | None, str | None], tuple[str, bool, bool]] = {
    ("batch", "batch"): ("batch", False, False),
    ("group", "group"): ("group", False, False),
    ("batch", None): ("batch", True, False),
    ("group", None): ("group", True, False),
    (None, "batch"): ("batch", False, True),
}
"""ROLL's ``(norm_mean_type, norm_std_type)`` -> rl-core's ``(reward_norm, reward_shift, reward_scale)``: the mean
subtracted (none: 0) and the unbiased std (+1e-6) divided by, both of the batch or of each prompt group. ROLL's
other pairs (a group std without a group mean) broadcast a group-shaped std over the flat batch and fail."""


def rlvr_reward_stage(settings: AlgorithmSettings, config: Any) -> AlgorithmSettings:
    """``settings`` with ROLL's RLVR reward stage (``reward_postprocess`` then ``compute_advantage``): every
    estimator's response-level rewards are normalised by ``norm_mean_type`` / ``norm_std_type`` before
    ``reward_clip``; ``grpo`` forces both to ``group`` and is then the reinforce return of the token rewards (with
    ``gamma``, the token-level KL and ``whiten_rewards`` as for reinforce). Without those options it equals the
    group-normalised outcome advantage; with them ROLL's grpo is this one, not rl-core's outcome estimator."""
    pair = (config.norm_mean_type, config.norm_std_type)
    if config.adv_estimator == "grpo":
        pair, settings = ("group", "group"), replace(settings, adv_estimator="reinforce")
    if pair == (None, None):
        return settings
    norm, shift, scale = ROLL_REWARD_NORMS[pair]
    reward = replace(settings.reward, reward_norm=norm, reward_shift=shift, reward_scale=scale)
    return replace(settings, reward=reward)
