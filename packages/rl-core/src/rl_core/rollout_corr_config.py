"""verl 0.9.1's rollout-correction config: its keys (``RolloutCorrectionConfig``) and its presets by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rl_core.rollout_corr import IS_LEVELS, parse_is_threshold, parse_rs


def _preset(
    rollout_is: str | None = None, threshold: str | float = 2.0, rs: str | None = None, rs_threshold: Any = None,
    bypass: bool = False, loss_type: str = "ppo_clip",
) -> dict[str, Any]:  # fmt: skip
    return {"rollout_is": rollout_is, "rollout_is_threshold": threshold, "rollout_is_batch_normalize": False,
            "rollout_rs": rs, "rollout_rs_threshold": rs_threshold, "bypass_mode": bypass,
            "loss_type": loss_type}  # fmt: skip


PRESETS: dict[str, dict[str, Any]] = {
    "decoupled_token_is": _preset("token"),
    "decoupled_seq_is": _preset("sequence"),
    "decoupled_token_icepop": _preset("token", "0.5_5.0"),
    "decoupled_seq_is_rs": _preset("sequence", 2.0, "seq_sum_k1", "0.5_2.0"),
    "decoupled_geo_rs": _preset(None, 2.0, "seq_mean_k1", "0.999_1.001"),
    "bypass_ppo_clip": _preset(bypass=True),
    "bypass_ppo_clip_geo_rs": _preset(None, 2.0, "seq_mean_k1", "0.999_1.001", bypass=True),
    "bypass_ppo_clip_k3_rs": _preset(None, 2.0, "seq_mean_k3", 0.01, bypass=True),
    "bypass_pg_is": _preset("sequence", bypass=True, loss_type="reinforce"),
    "bypass_pg_token_icepop": _preset("token", "0.5_5.0", bypass=True, loss_type="reinforce"),
    "bypass_pg_geo_rs": _preset(None, 2.0, "seq_mean_k1", "0.999_1.001", bypass=True, loss_type="reinforce"),
    "decoupled_geo_rs_seq_tis": _preset("sequence", 2.0, "seq_mean_k1", "0.999_1.001"),
    "decoupled_geo_rs_token_tis": _preset("token", 2.0, "seq_mean_k1", "0.999_1.001"),
    "bypass_pg_geo_rs_seq_tis": _preset("sequence", 2.0, "seq_mean_k1", "0.999_1.001", True, "reinforce"),
    "bypass_pg_geo_rs_token_tis": _preset("token", 2.0, "seq_mean_k1", "0.999_1.001", True, "reinforce"),
    "decoupled_k3_rs": _preset(None, 2.0, "seq_mean_k3", 0.01),
    "decoupled_k3_rs_seq_tis": _preset("sequence", 2.0, "seq_mean_k3", 0.01),
    "decoupled_k3_rs_token_tis": _preset("token", 2.0, "seq_mean_k3", 0.01),
    "disabled": _preset(),
}
"""verl's ``RolloutCorrectionConfig`` presets at their default arguments: name -> every key's value."""


@dataclass
class RolloutCorrectionConfig:
    """verl's ``algorithm.rollout_correction`` keys (verl 0.9.1 ``RolloutCorrectionConfig``, yaml defaults)."""

    rollout_is: str | None = None
    """IS level, ``token`` or ``sequence``; null = no IS weights."""
    rollout_is_threshold: str | float | None = 2.0
    """A number: TIS upper bound; ``"lower_upper"``: IcePop band; null = no IS weights."""
    rollout_is_batch_normalize: bool = False
    """Divide the weights by their batch mean."""
    rollout_rs: str | None = None
    """Comma-separated rejection options (:data:`RS_OPTIONS`); null = no rejection."""
    rollout_rs_threshold: str | float | None = None
    """One spec for all options or one per option (required with ``rollout_rs``)."""
    bypass_mode: bool = False
    """Train against the rollout log-probs as the old policy (no old-log-prob pass) with the ``bypass_mode`` loss."""
    loss_type: str = "ppo_clip"
    """Bypass mode's loss: ``ppo_clip`` (clipped PPO against the rollout policy) or ``reinforce`` (IS-weighted PG)."""

    @classmethod
    def preset(cls, name: str) -> RolloutCorrectionConfig:
        """One of verl's presets by name (:data:`PRESETS`)."""
        if name not in PRESETS:
            raise ValueError(f"unknown rollout correction preset {name!r}; valid: {sorted(PRESETS)}.")
        return cls(**PRESETS[name])

    def validate(self, prefix: str = "rollout_correction") -> None:
        """Raise ``ValueError`` / ``TypeError`` naming ``<prefix>.<key>`` for the first bad value."""
        if self.rollout_is is not None and self.rollout_is not in IS_LEVELS:
            raise ValueError(f"{prefix}.rollout_is={self.rollout_is!r}; use one of {list(IS_LEVELS)} or null.")
        if self.rollout_is is not None and self.rollout_is_threshold is not None:
            try:
                parse_is_threshold(self.rollout_is_threshold)
            except (TypeError, ValueError) as err:
                raise type(err)(f"{prefix}: {err}") from None
        if self.rollout_rs is not None:
            try:
                parse_rs(self.rollout_rs, self.rollout_rs_threshold)
            except (TypeError, ValueError) as err:
                raise type(err)(f"{prefix}: {err}") from None
        if self.loss_type not in BYPASS_LOSS_TYPES:
            raise ValueError(f"{prefix}.loss_type={self.loss_type!r}; use one of {list(BYPASS_LOSS_TYPES)}.")


BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")
