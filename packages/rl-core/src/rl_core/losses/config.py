"""Hyper-parameters of the policy losses: one typed dataclass, each field documented once."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rl_core.rollout_corr_config import RolloutCorrectionConfig


@dataclass
class PolicyLossConfig:
    """Knobs read by the registered policy losses; each loss reads only its own fields.

    Names follow verl's ``actor.policy_loss`` / ``actor`` keys and ROLL's pg_variant keys.
    """

    clip_ratio: float = 0.2
    """Symmetric PPO clip epsilon (verl ``clip_ratio``, ROLL ``pg_clip``); default for low / high."""
    clip_ratio_low: float | None = None
    """Lower clip epsilon: ratio clipped below 1 - clip_ratio_low. None = clip_ratio."""
    clip_ratio_high: float | None = None
    """Upper clip epsilon (DAPO clip-higher): ratio clipped above 1 + clip_ratio_high. None = clip_ratio."""
    clip_ratio_c: float | None = 3.0
    """Dual-clip constant c > 1 (Ye et al. 2020): for A < 0 the loss is capped at -c * A. None disables."""
    clip_cov_ratio: float = 0.0002
    """Clip-Cov: fraction of valid tokens whose gradient is detached (Cui et al. 2025)."""
    clip_cov_lb: float = 1.0
    """Clip-Cov: lower bound of the covariance window from which tokens are drawn."""
    clip_cov_ub: float = 5.0
    """Clip-Cov: upper bound of the covariance window from which tokens are drawn."""
    kl_cov_ratio: float = 0.0002
    """KL-Cov: fraction of valid tokens (highest covariance) that get the KL penalty."""
    ppo_kl_coef: float = 0.1
    """KL-Cov: coefficient of the |log ratio| penalty on the selected tokens."""
    tis_lower_bound: float = 0.0
    """TIS (ROLL pg_variant 'tis'): lower truncation of the detached ratio."""
    tis_upper_bound: float = 1.0
    """TIS: upper truncation of the detached ratio."""
    topr_positive_weight: float = 1.0
    """TOPR (Le Roux et al. 2025): weight of the SFT-like term on positive-reward sequences."""
    topr_negative_weight: float = 1.0
    """TOPR: weight of the [0, 1]-truncated IS term on non-positive-reward sequences."""
    cispo_epsilon_low: float = 0.1
    """CISPO (MiniMax-M1 2025): detached ratio clipped below 1 - cispo_epsilon_low."""
    cispo_epsilon_high: float = 0.1
    """CISPO: detached ratio clipped above 1 + cispo_epsilon_high."""
    cispo_use_unified_mask: bool = False
    """CISPO: drop tokens PPO would clip (A > 0 and r > 1+eps_high, or A < 0 and r < 1-eps_low), eq. 7."""
    kimi15_tau: float = 0.1
    """Kimi k1.5 (2025, eq. 3): weight tau of the squared log-ratio regulariser."""
    seed: int | None = None
    """Seed for the random token choice of Clip-Cov; None uses torch's global generator."""
    rollout_correction: RolloutCorrectionConfig | None = None
    """verl's bypass mode (loss ``bypass_mode``): the :class:`rl_core.rollout_corr.RolloutCorrectionConfig` whose IS
    weights / rejections it applies against the rollout policy; None elsewhere."""

    @property
    def low(self) -> float:
        """Effective lower clip epsilon."""
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def high(self) -> float:
        """Effective upper clip epsilon."""
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field."""
        for name in (
            "clip_ratio",
            "clip_cov_ratio",
            "kl_cov_ratio",
            "cispo_epsilon_low",
            "cispo_epsilon_high",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.low < 0 or self.high < 0:
            raise ValueError(f"clip_ratio_low / clip_ratio_high must be >= 0, got {self.low} / {self.high}")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            raise ValueError(
                f"clip_ratio_c must be > 1.0 for dual-clip PPO, got {self.clip_ratio_c}; "
                "set it to null to disable dual clipping"
            )
        if self.clip_cov_lb > self.clip_cov_ub:
            raise ValueError(f"clip_cov_lb ({self.clip_cov_lb}) must be <= clip_cov_ub ({self.clip_cov_ub})")
        if self.tis_lower_bound > self.tis_upper_bound:
            raise ValueError(
                f"tis_lower_bound ({self.tis_lower_bound}) must be <= tis_upper_bound ({self.tis_upper_bound})"
            )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> PolicyLossConfig:
        """Build from a mapping, rejecting unknown keys by name."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown policy loss key(s) {unknown}; valid keys: {sorted(known)}")
        config = cls(**values)
        config.validate()
        return config
