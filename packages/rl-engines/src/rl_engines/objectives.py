"""Training objectives a train strategy minimises, composed from rl-core losses.

An objective maps one micro-batch and the model outputs the strategy computed for it to ``(loss, metrics)``.
Its loss is that micro-batch's share of the mini-batch loss (rl-core's ``GlobalBatchInfo`` normalisation), so
the strategy sums micro-batch losses over gradient accumulation and data-parallel ranks and gets exactly the
loss of the whole mini-batch, however it is split. Objectives are plain dataclasses: they pickle to Ray workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from rl_core.batch import RolloutBatch
from rl_core.losses import (
    POLICY_LOSSES,
    GlobalBatchInfo,
    LossCoefficients,
    PolicyLossConfig,
    agg_loss,
    compose_total_loss,
    compute_kl_loss,
    compute_value_loss,
    get_policy_loss,
)
from rl_core.losses.policy_bypass import compute_policy_loss_bypass_mode
from rl_core.losses.ratio_metrics import SHARE_METRICS, ratio_metrics

Metrics = dict[str, torch.Tensor]

PPO_RATIO_LEVELS = {"vanilla": "token", "sequence_ppo": "sequence", "segment_ppo": "segment"}
"""The PPO losses ROLL's actor workers train (by importance_sampling / ratio_type) and the ratio each clips."""


class Objective(Protocol):
    """What a train strategy's ``train_step`` minimises."""

    @property
    def output(self) -> str:
        """Model output the objective reads: ``"log_probs"`` (actor) or ``"values"`` (critic)."""
        ...

    @property
    def needs_entropy(self) -> bool:
        """Whether the strategy must also compute per-token entropy."""
        ...

    @property
    def temperature(self) -> float:
        """Temperature the log-probs are computed at (the generation temperature)."""
        ...

    def __call__(
        self, outputs: dict[str, torch.Tensor], micro_batch: RolloutBatch, global_batch: GlobalBatchInfo
    ) -> tuple[torch.Tensor, Metrics]: ...


def _tensor(batch: RolloutBatch, key: str, why: str) -> torch.Tensor:
    if key not in batch.batch:
        raise KeyError(f"the training batch has no {key!r}, which {why}; tensors present: {sorted(batch.batch)}")
    return batch.batch[key]


@dataclass
class ActorObjective:
    """PPO-family actor loss: ``rl * pg + kl * kl_loss - ent * entropy`` (ROLL actor_train loss).

    Reads ``old_log_probs``, ``advantages``, ``response_mask``; ``ref_log_probs`` when ``use_kl_loss``;
    ``rollout_is_weights`` when present (rl-core rollout IS). All ``[B, R]``. And ``sample_scores`` ``[B]`` when
    present: each sample's score, which splits TOPR's positive and negative samples (ROLL: ``scores > 0``).
    """

    policy_loss: str = "vanilla"
    """Registered rl-core policy loss (pg_variant / loss_mode)."""
    loss_agg_mode: str = "token-mean"
    """rl-core loss aggregation mode."""
    policy_loss_config: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """Clip ratios and variant knobs."""
    coefficients: LossCoefficients = field(default_factory=LossCoefficients)
    """rl_loss_coef, kl_loss_coef, entropy_loss_coef, sft_loss_coef."""
    use_kl_loss: bool = False
    """Add the KL-to-reference loss (GRPO style) weighted by kl_loss_coef."""
    kl_loss_type: str = "low_var_kl"
    """rl-core KL estimator of the KL loss."""
    temperature: float = 1.0
    """Generation temperature; log-probs are of logits / temperature."""
    norm_length: float | None = None
    """The constant divisor of the ``-norm`` aggregation modes (``GlobalBatchInfo.norm_length``); None: the padded
    response width of each micro-batch."""

    def _policy_loss(self) -> Any:
        """The registered loss, or verl's bypass-mode loss when ``policy_loss_config.rollout_correction`` asks for
        bypass mode (old_log_probs are then the rollout's; see rl_core.losses.policy_bypass)."""
        correction = self.policy_loss_config.rollout_correction
        if correction is not None and getattr(correction, "bypass_mode", False):
            return compute_policy_loss_bypass_mode
        return get_policy_loss(self.policy_loss)

    def __post_init__(self) -> None:
        get_policy_loss(self.policy_loss)  # unknown names fail here, on the driver, with the valid names listed
        self.policy_loss_config.validate()
        if self.coefficients.sft_loss_coef:
            raise ValueError("sft_loss_coef needs SFT data, which the RL actor objective does not carry; set it 0.")

    @property
    def output(self) -> str:
        """Reads log-probs."""
        return "log_probs"

    @property
    def needs_entropy(self) -> bool:
        """Entropy is computed only when it is part of the loss."""
        return self.coefficients.entropy_loss_coef != 0.0

    def __call__(
        self, outputs: dict[str, torch.Tensor], micro_batch: RolloutBatch, global_batch: GlobalBatchInfo
    ) -> tuple[torch.Tensor, Metrics]:
        """Loss share and metrics of one micro-batch."""
        if self.norm_length is not None:
            global_batch = replace(global_batch, norm_length=self.norm_length)
        log_prob = outputs["log_probs"]
        mask = _tensor(micro_batch, "response_mask", "every loss masks by").to(log_prob.device)
        old = _tensor(micro_batch, "old_log_probs", "the policy ratio needs").to(log_prob.device)
        adv = _tensor(micro_batch, "advantages", "the policy gradient needs").to(log_prob.device)
        weights, scores = micro_batch.batch.get("rollout_is_weights"), micro_batch.batch.get("sample_scores")
        pg_loss, metrics = self._policy_loss()(
            old, log_prob, adv, mask,
            loss_agg_mode=self.loss_agg_mode, config=self.policy_loss_config,
            rollout_is_weights=None if weights is None else weights.to(log_prob.device),
            global_batch=global_batch, sample_scores=None if scores is None else scores.to(log_prob.device),
        )  # fmt: skip
        kl_loss = entropy = None
        if self.use_kl_loss:
            ref = _tensor(micro_batch, "ref_log_probs", "use_kl_loss needs").to(log_prob.device)
            kl_loss = compute_kl_loss(log_prob, ref, mask, kl_loss_type=self.kl_loss_type,
                                      loss_agg_mode=self.loss_agg_mode, global_batch=global_batch)  # fmt: skip
            metrics["kl_loss"] = kl_loss.detach()
        if "entropy" in outputs:
            entropy = agg_loss(outputs["entropy"], mask, self.loss_agg_mode, global_batch=global_batch)
            metrics["entropy"] = entropy.detach()
        total = compose_total_loss(self.coefficients, pg_loss=pg_loss, kl_loss=kl_loss, entropy=entropy)
        metrics["pg_loss"] = pg_loss.detach()
        metrics["total_loss"] = total.detach()
        metrics.update(self._ratio_metrics(old, log_prob, adv, mask, global_batch))
        return total, metrics

    def _ratio_metrics(self, old: torch.Tensor, log_prob: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                       global_batch: GlobalBatchInfo) -> Metrics:  # fmt: skip
        """ROLL's names for the ratio's statistics (rl_core.losses.ratio_metrics); a PPO loss adds its clip
        fractions, at the ratio level the loss clips (ROLL's importance_sampling / ratio_type)."""
        name = POLICY_LOSSES.canonical_name(self.policy_loss)
        ppo = name in PPO_RATIO_LEVELS and self._policy_loss() is not compute_policy_loss_bypass_mode
        cfg = self.policy_loss_config
        return ratio_metrics(
            old, log_prob, adv, mask, loss_agg_mode=self.loss_agg_mode, global_batch=global_batch,
            ratio_level=PPO_RATIO_LEVELS.get(name, "token"), ppo_clip=(cfg.low, cfg.high) if ppo else None,
        )  # fmt: skip


@dataclass
class CriticObjective:
    """Clipped value loss of the critic (PPO / GAE). Reads ``values`` (old), ``returns``, ``response_mask``."""

    value_clip: float | None = 0.5
    """Clip range of the new values around the old ones; None = plain squared error."""
    loss_agg_mode: str = "token-mean"
    """rl-core loss aggregation mode."""

    @property
    def output(self) -> str:
        """Reads values."""
        return "values"

    @property
    def needs_entropy(self) -> bool:
        """Never."""
        return False

    @property
    def temperature(self) -> float:
        """Unused by the critic."""
        return 1.0

    def __call__(
        self, outputs: dict[str, torch.Tensor], micro_batch: RolloutBatch, global_batch: GlobalBatchInfo
    ) -> tuple[torch.Tensor, Metrics]:
        """Loss share and metrics of one micro-batch."""
        values = outputs["values"]
        mask = _tensor(micro_batch, "response_mask", "every loss masks by").to(values.device)
        old = _tensor(micro_batch, "values", "value clipping needs (the critic's values at rollout)")
        returns = _tensor(micro_batch, "returns", "the value target needs")
        loss, metrics = compute_value_loss(
            values, old.to(values.device), returns.to(values.device), mask,
            value_clip=self.value_clip, loss_agg_mode=self.loss_agg_mode, global_batch=global_batch,
        )  # fmt: skip
        metrics["value_loss"] = loss.detach()
        return loss, metrics


# Metrics that are sums over micro-batches (each micro-batch's share of a mini-batch total); everything else is
# a per-micro-batch mean and is averaged weighted by its share of the mini-batch's valid tokens.
ADDITIVE_METRICS = frozenset({"pg_loss", "total_loss", "kl_loss", "entropy", "value_loss", "load_balancing_loss",
                              *SHARE_METRICS})  # fmt: skip
