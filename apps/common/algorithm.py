"""From scored rollouts to training targets, composed from rl-core: rewards -> token rewards (+KL) -> advantages
-> rollout IS weights; and the actor / critic objectives. Shared by the RLVR and agentic pipelines.

``AlgorithmSettings.from_config(config)`` reads the ROLL keys once (an object with the RLVR config's attributes);
``compute_targets`` is then pure tensor math on one rollout batch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from apps.common.policy_args import policy_loss_name
from rl_core.advantages import AdvantageConfig, compute_advantages
from rl_core.batch import RolloutBatch
from rl_core.kl_control import build_kl_controller
from rl_core.losses import LossCoefficients, PolicyLossConfig
from rl_core.rewards import RewardConfig, RunningMoments, build_token_level_rewards, process_sequence_rewards
from rl_core.rollout_corr import rollout_correction
from rl_core.rollout_corr_config import RolloutCorrectionConfig
from rl_core.rollout_is import RolloutISConfig, compute_rollout_is_weights
from rl_core.train_infer_correction import TrainInferCorrectionConfig, compute_train_infer_correction
from rl_engines.objectives import ActorObjective, CriticObjective

logger = logging.getLogger(__name__)


@dataclass
class AlgorithmSettings:
    """rl-core configs built from the ROLL keys of a pipeline config."""

    adv_estimator: str
    advantage: AdvantageConfig
    reward: RewardConfig
    rollout_is: RolloutISConfig
    actor: ActorObjective
    critic: CriticObjective
    correction: RolloutCorrectionConfig | None = None
    """verl 0.9.1's rollout correction (``rollout_correction``), applied after the advantages (see
    :func:`_apply_correction`)."""
    train_infer: TrainInferCorrectionConfig | None = None
    """ROLL's train-infer correction (``train_infer_correction``), applied after the advantages as ROLL does."""

    @classmethod
    def from_config(
        cls, config: Any, temperature: float = 1.0, ratio_type: str = "token", sequence_length: int | None = None
    ) -> AlgorithmSettings:
        """Read ``adv_estimator``, gamma / lambd, reward_*, rollout_is_*, pg_*, loss_agg_mode and loss coefficient
        keys; ``ratio_type``: the agentic pipeline's (``policy_loss_name``); ``sequence_length``: ROLL's resolved
        one (default: the config's, else ``prompt_length + response_length``, as ROLL derives it)."""
        advantage = AdvantageConfig(gamma=config.gamma, lambd=config.lambd, whiten_advantages=config.whiten_advantages,
                                    advantage_clip=config.advantage_clip)  # fmt: skip
        reward = RewardConfig(reward_norm=config.reward_norm, reward_shift=config.reward_shift,
                              reward_scale=config.reward_scale, reward_clip=config.reward_clip,
                              whiten_rewards=config.whiten_rewards, add_len_reward=config.add_len_reward,
                              add_token_level_kl=config.add_token_level_kl, kl_penalty=config.kl_penalty)  # fmt: skip
        rollout_is = RolloutISConfig(
            rollout_is_threshold=config.rollout_is_threshold, rollout_is=config.rollout_is,
            rollout_is_threshold_lower=config.rollout_is_threshold_lower, rollout_is_level=config.rollout_is_level,
            rollout_is_mode=config.rollout_is_mode, rollout_is_veto_threshold=config.rollout_is_veto_threshold,
        )  # fmt: skip
        rollout_is.validate()
        correction = config.rollout_correction
        low, high = clip_range(config)
        policy = PolicyLossConfig(
            clip_ratio=config.pg_clip, clip_ratio_low=low, clip_ratio_high=high,
            clip_ratio_c=1.0 + 2.0 * config.pg_clip if config.dual_clip_loss else None,  # ROLL's dual clip
            rollout_correction=correction if correction is not None and correction.bypass_mode else None,
            **config.actor_policy.loss_knobs(),  # actor_train's tis_* / topr_* / cispo_* / kimi15_tau
        )  # fmt: skip
        policy.validate()
        coefficients = LossCoefficients(rl_loss_coef=config.rl_loss_coef, kl_loss_coef=config.kl_loss_coef,
                                        entropy_loss_coef=config.entropy_loss_coef)  # fmt: skip
        aggregation, norm_length = roll_aggregation(config, sequence_length)
        actor = ActorObjective(policy_loss=policy_loss_name(config, ratio_type), loss_agg_mode=aggregation,
                               policy_loss_config=policy, coefficients=coefficients, use_kl_loss=config.use_kl_loss,
                               kl_loss_type=config.kl_loss_type, temperature=temperature,
                               norm_length=norm_length)  # fmt: skip
        critic = CriticObjective(value_clip=config.value_clip, loss_agg_mode=ROLL_CRITIC_AGGREGATION)
        return cls(
            config.adv_estimator,
            advantage,
            reward,
            rollout_is,
            actor,
            critic,
            config.rollout_correction,
            config.train_infer_correction,
        )


ROLL_CRITIC_AGGREGATION = "seq-mean-token-mean"
"""How ROLL's CriticWorker aggregates the value loss, whatever ``loss_agg_mode`` says: each sequence's mean over
its tokens, then the mean over sequences."""


def roll_aggregation(config: Any, sequence_length: int | None = None) -> tuple[str, float | None]:
    """rl-core's aggregation mode for the actor's ``loss_agg_mode`` as ROLL's ``agg_loss`` computes it, and the
    constant divisor of a ``-norm`` mode (None: none). ROLL's ``seq-mean-token-sum-norm`` divides a mini-batch's
    token sums by the width of its loss mask alone: ROLL pads every sample to ``sequence_length`` and masks from the
    second token on, so ``sequence_length - 1``, with no mean over sequences (rl-core's ``token-sum-norm``; rl-core's
    ``seq-mean-token-sum-norm`` is verl's, which also divides by the number of sequences). The other modes are
    rl-core's own."""
    if config.loss_agg_mode != "seq-mean-token-sum-norm":
        return config.loss_agg_mode, None
    length = sequence_length or config.sequence_length or config.prompt_length + config.response_length
    return "token-sum-norm", float(length - 1)


PG_CLIP_RANGE_DEFAULT = 0.2
"""ROLL's default pg_clip_low / pg_clip_high (read only with use_pg_clip_range)."""


def clip_range(config: Any) -> tuple[float | None, float | None]:
    """The PPO clip's lower / upper epsilon as ROLL picks them: ``pg_clip_low`` / ``pg_clip_high`` (0.2 each when
    unset) with ``use_pg_clip_range``, else None (``pg_clip`` on both sides)."""
    if not config.use_pg_clip_range:
        return None, None
    low, high = config.pg_clip_low, config.pg_clip_high
    return (PG_CLIP_RANGE_DEFAULT if low is None else low), (PG_CLIP_RANGE_DEFAULT if high is None else high)


class TargetBuilder:
    """Stateful across steps (KL controller, running reward moments); one call per rollout batch.

    With ``domains`` (RLVR's ``domain_interleave_probs``) each domain's samples get their rewards processed, their
    KL and their advantages computed apart, with running reward moments of their own, as ROLL does per domain.
    """

    def __init__(self, settings: AlgorithmSettings, config: Any, domains: list[str] | None = None) -> None:
        self.settings = settings
        self.kl_controller = build_kl_controller(config.init_kl_coef, config.target_kl, config.kl_horizon)
        self.running = RunningMoments()
        self.domain_running = {domain: RunningMoments() for domain in domains or []}

    def __call__(
        self, batch: RolloutBatch, sequence_rewards: torch.Tensor, group_index: list[Any],
        scores: torch.Tensor | None = None, domains: list[str] | None = None, kl_mask: torch.Tensor | None = None,
    ) -> dict[str, float]:  # fmt: skip
        """Add ``token_level_rewards``, ``advantages``, ``returns`` (and ``rollout_is_weights``) to ``batch``.

        Reads ``response_mask``, ``old_log_probs``, optional ``ref_log_probs``, ``values``, ``rollout_log_probs``.
        ``sequence_rewards`` ``[B]`` are the rewards to train on (ROLL's ``response_level_rewards``);
        ``group_index`` ``[B]`` the prompt id of each sample; ``scores`` ``[B]`` how right each response is, for
        ``critic/score/mean`` (the rewards when not given); ``domains`` ``[B]`` each sample's domain when the
        builder has domains (their metrics come prefixed ``<domain>/``); ``kl_mask`` ``[B, T]`` the responses as
        generated, before the sample masks, over which ROLL measures the KL its controller follows (default:
        ``response_mask``). Returns the step's algorithm metrics: ``critic/kl_coef`` is, as in ROLL, the coefficient
        subtracted from the rewards (0 without ``add_token_level_kl``).
        """
        scores = sequence_rewards if scores is None else scores
        tensors = batch.batch
        correction = _rollout_correction(tensors, self.settings.correction)
        if not self.domain_running:
            rewards, metrics = self._targets(tensors, sequence_rewards, scores, group_index, self.running, kl_mask)
        else:
            rewards, metrics = self._by_domain(tensors, sequence_rewards, scores, group_index, domains, kl_mask)
        if correction is not None:
            metrics.update(_apply_correction(tensors, *correction))
        if self.settings.train_infer is not None:
            metrics.update(_train_infer_correction(tensors, self.settings.train_infer))
        metrics.update(_is_weights(batch, self.settings.rollout_is))
        metrics.update(_summary(tensors, scores, rewards))
        return metrics

    def state_dict(self) -> dict[str, Any]:
        """The running moments (every domain's too) and the KL controller, for a checkpoint."""
        return {"kl_controller": self.kl_controller.state_dict(), "running_moments": self.running.state_dict(),
                "domain_running_moments": {d: m.state_dict() for d, m in self.domain_running.items()}}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s output."""
        self.kl_controller.load_state_dict(state["kl_controller"])
        self.running.load_state_dict(state["running_moments"])
        for domain, moments in state.get("domain_running_moments", {}).items():
            self.domain_running[domain].load_state_dict(moments)

    def _applied_kl_coef(self) -> float:
        """The KL coefficient the token rewards get now (ROLL's ``critic/kl_coef``)."""
        return self.kl_controller.value if self.settings.reward.add_token_level_kl else 0.0

    def _targets(
        self, tensors: dict[str, torch.Tensor], sequence_rewards: torch.Tensor, scores: torch.Tensor,
        group_index: list[Any], running: RunningMoments, kl_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:  # fmt: skip
        """Rewards -> token rewards (+KL, updating the controller) -> advantages of one set of samples, into
        ``tensors``; returns the processed sequence rewards and the KL metrics. ``scores`` say which responses are
        right (the length reward's ``correct``)."""
        settings, mask = self.settings, tensors["response_mask"]
        rewards = process_sequence_rewards(sequence_rewards, mask, config=settings.reward, group_index=group_index,
                                           running=running, correct=scores > 0)  # fmt: skip
        token_rewards, batch_kl = build_token_level_rewards(
            rewards, mask, config=settings.reward, kl_coef=self.kl_controller.value,
            log_prob=tensors["old_log_probs"] if "ref_log_probs" in tensors else None,
            ref_log_prob=tensors.get("ref_log_probs"), kl_mask=kl_mask,
        )  # fmt: skip
        metrics = {"critic/kl_coef": self._applied_kl_coef()}
        if batch_kl is not None:
            self.kl_controller.update(batch_kl, n_steps=len(sequence_rewards))
            metrics["critic/kl"] = batch_kl
        advantages, returns = compute_advantages(settings.adv_estimator, token_rewards, mask,
                                                 config=settings.advantage, values=tensors.get("values"),
                                                 group_index=group_index)  # fmt: skip
        tensors.update(token_level_rewards=token_rewards, advantages=advantages, returns=returns)
        return rewards, metrics

    def _by_domain(
        self, tensors: dict[str, torch.Tensor], sequence_rewards: torch.Tensor, scores: torch.Tensor,
        group_index: list[Any], domains: list[str] | None, kl_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:  # fmt: skip
        if domains is None or len(domains) != len(sequence_rewards):
            raise ValueError("a TargetBuilder with domains needs each sample's domain")
        inputs: list[str] = [k for k in ("response_mask", "old_log_probs", "ref_log_probs", "values") if k in tensors]
        outputs = {key: torch.zeros_like(tensors["response_mask"], dtype=torch.float32)
                   for key in ("token_level_rewards", "advantages", "returns")}  # fmt: skip
        rewards = torch.zeros_like(sequence_rewards, dtype=torch.float32)
        metrics: dict[str, float] = {"critic/kl_coef": self._applied_kl_coef()}
        kl_sum, kl_tokens = 0.0, 0.0
        for domain in dict.fromkeys(domains):
            rows = torch.tensor([i for i, d in enumerate(domains) if d == domain])
            part: dict[str, torch.Tensor] = {key: tensors[key][rows] for key in inputs}
            part_rewards, part_metrics = self._targets(
                part, sequence_rewards[rows], scores[rows], [group_index[i] for i in rows.tolist()],
                self.domain_running[domain], None if kl_mask is None else kl_mask[rows],
            )  # fmt: skip
            for key in outputs:
                outputs[key][rows] = part[key].to(outputs[key].dtype)
            rewards[rows] = part_rewards.to(rewards.dtype)
            part_metrics.update(_summary(part, scores[rows], part_rewards))
            metrics.update({f"{domain}/{key}": value for key, value in part_metrics.items()})
            if "critic/kl" in part_metrics:
                tokens = float((part["response_mask"] if kl_mask is None else kl_mask[rows]).sum())
                kl_sum, kl_tokens = kl_sum + part_metrics["critic/kl"] * tokens, kl_tokens + tokens
        tensors.update(outputs)
        if kl_tokens:
            metrics["critic/kl"] = kl_sum / kl_tokens
        return rewards, metrics


def _summary(tensors: dict[str, torch.Tensor], scores: torch.Tensor, rewards: torch.Tensor) -> dict[str, float]:
    """Score, processed reward, advantage and return means (the last two over response tokens)."""
    valid = tensors["response_mask"].to(torch.bool)
    advantages, returns = tensors["advantages"], tensors["returns"]
    return {
        "critic/score/mean": float(scores.mean()), "critic/rewards/mean": float(rewards.mean()),
        "critic/advantages/mean": float(advantages[valid].mean()) if valid.any() else 0.0,
        "critic/returns/mean": float(returns[valid].mean()) if valid.any() else 0.0,
    }  # fmt: skip


Correction = tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]
"""verl's decoupled correction of a batch: IS weights (or None), the response mask without rejected tokens, metrics."""


def _rollout_correction(tensors: dict[str, torch.Tensor], config: RolloutCorrectionConfig | None) -> Correction | None:
    """verl 0.9.1's decoupled rollout correction of the batch's rows that hold a real token (rows the sample masks
    emptied are not samples of this step: verl drops them before it corrects). None without a config, in bypass mode
    (the actor's loss corrects each micro-batch), without rollout log-probs (as in verl) or without a real token."""
    if config is None or config.bypass_mode or "rollout_log_probs" not in tensors:
        return None
    mask = tensors["response_mask"]
    rows = mask.bool().any(dim=-1)
    if not bool(rows.any()):
        return None
    weights, kept, metrics = rollout_correction(
        tensors["old_log_probs"][rows], tensors["rollout_log_probs"][rows], mask[rows],
        rollout_is=config.rollout_is, rollout_is_threshold=config.rollout_is_threshold,
        rollout_is_batch_normalize=config.rollout_is_batch_normalize, rollout_rs=config.rollout_rs,
        rollout_rs_threshold=config.rollout_rs_threshold,
    )  # fmt: skip
    full_mask = mask.clone()
    full_mask[rows] = kept
    full_weights = None
    if weights is not None:
        full_weights = torch.zeros(mask.shape, dtype=weights.dtype)
        full_weights[rows] = weights
    return full_weights, full_mask, metrics


def _apply_correction(
    tensors: dict[str, torch.Tensor], weights: torch.Tensor | None, kept: torch.Tensor, metrics: dict[str, float]
) -> dict[str, float]:
    """After the advantages (computed on the mask as generated, so every sample's score still counts in its group,
    as in verl's outcome estimators, which sum the rewards without the mask): rejected tokens leave
    ``response_mask`` and get no advantage or return; the IS weights go into the batch. verl applies the rejection
    before its advantages, which differs where an estimator reads the mask (docs/rollout-importance-sampling.md).
    A batch left without a token reports ``mask/final_mask_sum_eq_0`` (the pipelines then skip training, as for the
    sample masks)."""
    tensors["response_mask"] = kept
    keep = kept.to(tensors["advantages"].dtype)
    tensors["advantages"] = tensors["advantages"] * keep
    tensors["returns"] = tensors["returns"] * keep.to(tensors["returns"].dtype)
    if weights is not None:
        tensors["rollout_is_weights"] = weights
    if not bool(kept.bool().any()):
        return {**metrics, "mask/final_mask_sum_eq_0": 1.0}
    return metrics


def _train_infer_correction(tensors: dict[str, torch.Tensor], config: TrainInferCorrectionConfig) -> dict[str, float]:
    """ROLL's ``apply_train_infer_correction_to_batch``: from the old (training engine) and rollout (inference engine)
    log-probs, the IS weights into the batch when enabled and the filters out of ``response_mask``; its metrics.
    Without rollout log-probs (an engine or replay that recorded none) ROLL skips it with a warning; so does this."""
    if "rollout_log_probs" not in tensors:
        logger.warning("train_infer_correction: the rollout has no rollout_log_probs (the inference engine's), so "
                       "it is skipped for this step, as ROLL skips it.")  # fmt: skip
        return {}
    mask = tensors["response_mask"]
    weights, keep, metrics = compute_train_infer_correction(config, mask, tensors["old_log_probs"],
                                                            tensors["rollout_log_probs"])  # fmt: skip
    kept = mask * keep.to(mask.dtype)
    return _apply_correction(tensors, weights if config.is_weight.enabled else None, kept, metrics)


def _is_weights(batch: RolloutBatch, config: RolloutISConfig) -> dict[str, float]:
    """Rollout IS (verl PR): weights into the batch when applied; ``mismatch/`` metrics whenever enabled."""
    tensors = batch.batch
    if config.rollout_is_threshold is None or "rollout_log_probs" not in tensors:
        return {}
    weights, mask, metrics = compute_rollout_is_weights(
        tensors["old_log_probs"], tensors["rollout_log_probs"], tensors["response_mask"],
        level=config.rollout_is_level, mode=config.rollout_is_mode, threshold=config.rollout_is_threshold,
        threshold_lower=config.rollout_is_threshold_lower, veto_threshold=config.rollout_is_veto_threshold,
    )  # fmt: skip
    if config.rollout_is and weights is not None:
        tensors["rollout_is_weights"] = weights
        tensors["response_mask"] = mask
    return {key: float(value) for key, value in metrics.items()}
