"""ROLL's sample-level masks and loss weights as pure functions on one rollout batch.

Two calls per step, on the driver, shared by the RLVR and agentic apps:

1. :func:`apply_sample_masks` once scores are known and *before* advantages: ``max_len_mask``,
   ``error_max_len_clip`` and ``difficulty_mask`` take whole samples out of the loss by zeroing their rows of
   ``response_mask`` (ROLL: ``get_sample_level_mask`` in ``roll/utils/functionals.py`` builds
   ``final_response_mask``). Advantages then see only the samples that train, as ROLL's ``compute_advantage``
   does with ``final_response_mask``.
2. :func:`apply_sample_weights` *after* advantages: ``difficulty_loss_weight`` / ``length_loss_weight`` give each
   sample a loss weight ``[B]`` (ROLL: ``ActorWorker.compute_sample_weights`` in
   ``roll/pipeline/rlvr/actor_worker.py``), folded into ``advantages`` (see that function for why this is exact).

With every switch off both calls change nothing and return no metrics.

Group normalisation sees every sample's true score, as ROLL's does: RLVR's ``grpo`` and ``norm_mean_type`` /
``norm_std_type`` normalise the response-level rewards before they are put on the (masked) tokens
(:mod:`apps.rlvr.reward_stage`), so a correct but truncated response under max_len_mask still counts 1 in its
group. rl-core's own group estimators, which ROLL does not have (rloo, opo), read each score back from the masked
token rewards, so there a masked sample enters its group's baseline as 0 (opo: not at all).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rl_core.advantages import GroupIndex, encode_groups, group_moments
from rl_core.batch import RolloutBatch
from rl_core.losses import POLICY_LOSSES
from rl_core.rewards import compute_sample_weights

ADVANTAGE_LINEAR_LOSSES = frozenset({"vanilla", "gspo", "gpg", "tis", "topr", "cispo", "geo_mean"})
"""Canonical rl-core policy losses whose per-token loss is positively homogeneous in the advantage
(``loss(w * A) = w * loss(A)`` for ``w > 0``), so a per-sample loss weight can ride on the advantages.
Not in it: ``kimi15`` (its ``tau / 2 * log_ratio**2`` term ignores A), ``kl_cov`` / ``clip_cov`` (they pick
tokens by the covariance of A with log-probs, which per-sample scaling changes)."""

ROLL_ERROR_MAX_LEN_THRESHOLD = 9_999_999_999
"""ROLL's default ``error_max_len_threshold`` (``roll/pipeline/rlvr/rlvr_config.py``): in effect no length limit."""


@dataclass(frozen=True)
class SampleShaping:
    """The ROLL sample-mask and loss-weight keys, read once from a pipeline config."""

    max_len_mask: bool = False
    """Drop responses cut at the length limit (finish reason ``length``) from the loss."""
    error_max_len_clip: bool = False
    """Keep only correct samples (score 1) and wrong ones (score 0) shorter than error_max_len_threshold."""
    error_max_len_threshold: int = ROLL_ERROR_MAX_LEN_THRESHOLD
    """Response tokens from which a wrong sample is dropped by error_max_len_clip (ROLL's default: no length limit,
    so the rule drops only the scores that are neither 0 nor 1)."""
    difficulty_mask: bool = False
    """Drop prompt groups whose mean score is not strictly inside (low, high)."""
    difficulty_low_threshold: float = 0.0
    """A group is kept only if its mean score is > this."""
    difficulty_high_threshold: float = 1.0
    """A group is kept only if its mean score is < this."""
    difficulty_loss_weight: bool = False
    """Weight samples by ``0.5 + 1.5 * clamp(difficulty, 0, 1)`` (per-sample ``difficulty`` column)."""
    length_loss_weight: bool = False
    """Weight samples by ``1.5 - min-max-normalised length`` (longer responses weigh less)."""
    response_length: int = 1024
    """Generation limit; a response this long counts as truncated when the batch has no finish reasons."""
    pg_variant: str = "vanilla"
    """Policy loss the advantages feed; loss weights need one in ADVANTAGE_LINEAR_LOSSES."""

    def __post_init__(self) -> None:
        if self.difficulty_low_threshold > self.difficulty_high_threshold:
            raise ValueError(
                f"difficulty_low_threshold ({self.difficulty_low_threshold}) must be <= "
                f"difficulty_high_threshold ({self.difficulty_high_threshold})"
            )
        if self.error_max_len_threshold < 1:
            raise ValueError(f"error_max_len_threshold must be >= 1, got {self.error_max_len_threshold}")
        if self.weights_samples and POLICY_LOSSES.canonical_name(self.pg_variant) not in ADVANTAGE_LINEAR_LOSSES:
            raise ValueError(
                f"difficulty_loss_weight / length_loss_weight scale the advantages, which equals weighting the "
                f"loss only for policy losses linear in the advantage ({', '.join(sorted(ADVANTAGE_LINEAR_LOSSES))}"
                f"); pg_variant {self.pg_variant!r} is not one of them. Turn the weights off or pick one of those."
            )

    @classmethod
    def from_config(cls, config: Any) -> SampleShaping:
        """Read the keys from an object with RLVRConfig's attributes (``response_length``, ``pg_variant`` too).

        ``error_max_len_threshold`` is ROLL's key; when the config has none (or null) it is ROLL's default
        (9999999999), under which error_max_len_clip drops only the scores that are neither 0 nor 1.
        """
        threshold = getattr(config, "error_max_len_threshold", None)
        return cls(
            max_len_mask=config.max_len_mask,
            error_max_len_clip=config.error_max_len_clip,
            error_max_len_threshold=int(ROLL_ERROR_MAX_LEN_THRESHOLD if threshold is None else threshold),
            difficulty_mask=config.difficulty_mask,
            difficulty_low_threshold=config.difficulty_low_threshold,
            difficulty_high_threshold=config.difficulty_high_threshold,
            difficulty_loss_weight=config.difficulty_loss_weight,
            length_loss_weight=config.length_loss_weight,
            response_length=config.response_length,
            pg_variant=getattr(config, "pg_variant", "vanilla"),
        )

    @property
    def masks_samples(self) -> bool:
        """Whether :func:`apply_sample_masks` has anything to do."""
        return self.max_len_mask or self.error_max_len_clip or self.difficulty_mask

    @property
    def weights_samples(self) -> bool:
        """Whether :func:`apply_sample_weights` has anything to do."""
        return self.difficulty_loss_weight or self.length_loss_weight


# ---------------------------------------------------------------------------------------------- sample masks
def truncated_samples(batch: RolloutBatch, response_length: int) -> torch.Tensor:
    """Bool ``[B]``: True where generation stopped at the length limit.

    Uses the engine's ``finish_reasons`` (``"length"``) when the batch has them. Otherwise falls back to ROLL's
    test (``roll/utils/functionals.py``: response length == padded response width), with ``response_length``
    as the width so that padding a batch to its longest response cannot mark that response truncated.
    """
    mask = batch.batch["response_mask"]
    if "finish_reasons" in batch.non_tensor_batch:
        reasons = np.asarray(batch.non_tensor_batch["finish_reasons"]) == "length"
        return torch.from_numpy(reasons.astype(bool)).to(mask.device)
    return mask.to(torch.long).sum(dim=-1) >= response_length


def error_length_keep(scores: torch.Tensor, lengths: torch.Tensor, threshold: int) -> torch.Tensor:
    """ROLL's ``error_max_len_clip`` rule, bool ``[B]``: keep ``score == 1``, or ``score == 0`` and
    ``length < threshold``.

    Exactly as ROLL (``get_sample_level_mask``): it is a mask, the scores are not changed, and a sample whose
    score is neither exactly 0 nor exactly 1 (partial credit, a length penalty, -1) is dropped too, since the
    rule is written for binary verifiable rewards.
    """
    correct = scores == 1
    short_error = (scores == 0) & (lengths.to(scores.device) < threshold)
    return correct | short_error


def difficulty_keep(scores: torch.Tensor, group_index: GroupIndex, low: float, high: float) -> torch.Tensor:
    """ROLL's ``difficulty_mask`` rule, bool ``[B]``: keep a sample iff its prompt group's mean score lies strictly
    inside ``(low, high)``; a mean equal to either threshold drops the group (ROLL: ``mean > low`` and
    ``mean < high``).

    The mean is over every sample of the group, including samples other masks drop, on the raw scores (as
    ROLL). Groups of one sample are always kept: ROLL applies the rule only when ``num_return_sequences > 1``.
    Computed in float64: in float32 a mean of 2/3 and a threshold 0.6666667 round to the same number.
    """
    inverse, num_groups = encode_groups(group_index, scores.shape[0], what="difficulty_mask")
    mean, _, count = group_moments(scores.detach().to(torch.float64), inverse, num_groups)
    inside = (mean > low) & (mean < high)
    return inside | (count <= 1)


def _sample_keep_rules(
    batch: RolloutBatch, scores: torch.Tensor, group_index: GroupIndex, shaping: SampleShaping
) -> dict[str, torch.Tensor]:
    """Each enabled rule's keep mask ``[B]`` (bool, on the response mask's device) under its ROLL metric name."""
    mask = batch.batch["response_mask"]
    lengths = mask.to(torch.long).sum(dim=-1)
    rules: dict[str, torch.Tensor] = {}
    if shaping.max_len_mask:
        rules["actor/max_len_mask_ratio"] = ~truncated_samples(batch, shaping.response_length)
    if shaping.difficulty_mask:
        low, high = shaping.difficulty_low_threshold, shaping.difficulty_high_threshold
        rules["actor/difficulty_mask_ratio"] = difficulty_keep(scores, group_index, low, high)
    if shaping.error_max_len_clip:
        rules["actor/error_len_mask_ratio"] = error_length_keep(scores, lengths, shaping.error_max_len_threshold)
    return {name: keep.to(mask.device) for name, keep in rules.items()}


def apply_sample_masks(
    batch: RolloutBatch, scores: torch.Tensor, group_index: GroupIndex, shaping: SampleShaping
) -> tuple[torch.Tensor, dict[str, float]]:
    """Take the samples ROLL's ``max_len_mask`` / ``difficulty_mask`` / ``error_max_len_clip`` reject out of the loss.

    Call after scoring and before advantages. ``batch`` holds ``response_mask`` ``[B, R]`` (and, for
    max_len_mask, non-tensor ``finish_reasons`` ``[B]``); ``scores`` ``[B]`` are the verifiable rewards;
    ``group_index`` ``[B]`` the prompt id of each sample (``prompt_uid``). Every rule is decided on these inputs,
    independently of the others, and a sample stays only if every enabled rule keeps it; its row of
    ``response_mask`` is zeroed otherwise (the dict entry is replaced, the old tensor is left as it was).

    Returns ``(scores, metrics)``. ROLL's rules only mask, so ``scores`` is returned unchanged. Metrics use
    ROLL's names *and* meanings: ``actor/<rule>_mask_ratio`` is the fraction of samples the rule **keeps**;
    ``actor/final_mask_ratio`` / ``actor/samples_used`` / ``actor/samples_total`` count what all rules keep;
    ``mask/final_mask_sum_eq_0`` is 1 when no token is left (ROLL skips such a step). All switches off: no change
    and ``{}``.
    """
    if not shaping.masks_samples:
        return scores, {}
    if scores.shape != (len(batch),):
        raise ValueError(f"scores must be [batch] = [{len(batch)}], got shape {tuple(scores.shape)}")
    rules = _sample_keep_rules(batch, scores, group_index, shaping)
    mask = batch.batch["response_mask"]
    keep = torch.ones(mask.shape[0], dtype=torch.bool, device=mask.device)
    for rule_keep in rules.values():
        keep = keep & rule_keep
    new_mask = torch.where(keep.unsqueeze(-1), mask, torch.zeros_like(mask))
    batch.batch["response_mask"] = new_mask
    metrics = {name: float(rule_keep.float().mean()) for name, rule_keep in rules.items()}
    metrics["actor/final_mask_ratio"] = float(keep.float().mean())
    metrics["actor/samples_used"] = float(keep.sum())
    metrics["actor/samples_total"] = float(keep.shape[0])
    metrics["mask/final_mask_sum_eq_0"] = float(not bool(new_mask.any()))
    return scores, metrics


# ---------------------------------------------------------------------------------------------- loss weights
def _difficulty(batch: RolloutBatch) -> torch.Tensor:
    """The per-sample ``difficulty`` column as float ``[B]``; raises naming the key when it is missing or bad."""
    if "difficulty" not in batch.non_tensor_batch:
        raise ValueError(
            "difficulty_loss_weight needs a per-sample 'difficulty' in [0, 1] (a dataset column copied into "
            "non_tensor_batch['difficulty']); this batch has none. Add the column or set difficulty_loss_weight "
            "false."
        )
    try:
        values = np.asarray(batch.non_tensor_batch["difficulty"], dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(
            "difficulty_loss_weight: non_tensor_batch['difficulty'] must hold numbers in [0, 1], got e.g. "
            f"{batch.non_tensor_batch['difficulty'][:3].tolist()!r}"
        ) from None
    if not np.isfinite(values).all():
        raise ValueError("difficulty_loss_weight: non_tensor_batch['difficulty'] holds NaN or Inf")
    return torch.from_numpy(values)


def sample_loss_weights(
    response_mask: torch.Tensor,
    difficulty: torch.Tensor | None = None,
    *,
    difficulty_loss_weight: bool = False,
    length_loss_weight: bool = False,
) -> torch.Tensor:
    """ROLL's per-sample loss weights ``[B]`` over the samples still in the loss; 1 for the others.

    Live samples (any True in their ``response_mask`` row ``[B, R]``) get rl-core's
    :func:`~rl_core.rewards.compute_sample_weights` (ROLL's formulas): ``0.5 + 1.5 * clamp(difficulty, 0, 1)``
    times ``1.5 - (len - min) / (max - min + 1e-8)``, renormalised to mean 1, with min, max and the mean taken over
    the live samples. Differences from ROLL, on purpose: ROLL normalises per *micro-batch* inside the loss, so its
    weights depend on the micro-batch size and order; here the scope is the whole batch, the same however training
    splits it. And ROLL includes masked samples (at their unmasked length) in min / max / mean; here they have
    no say, as they do not train. ``difficulty`` ``[B]`` is required when ``difficulty_loss_weight``.
    """
    weights = torch.ones(response_mask.shape[0], dtype=torch.float32, device=response_mask.device)
    live = response_mask.to(torch.bool).any(dim=-1)
    if not bool(live.any()):
        return weights
    live_difficulty = None if difficulty is None else difficulty.to(weights.device)[live]
    weights[live] = compute_sample_weights(
        response_mask[live], difficulty=live_difficulty,
        difficulty_loss_weight=difficulty_loss_weight, length_loss_weight=length_loss_weight,
    )  # fmt: skip
    return weights


def apply_sample_weights(batch: RolloutBatch, shaping: SampleShaping) -> dict[str, float]:
    """Weight each sample's policy loss by ROLL's ``difficulty_loss_weight`` / ``length_loss_weight`` by scaling its
    row of ``batch.batch["advantages"]`` ``[B, R]`` (the dict entry is replaced).

    Call after advantages (after whitening and clipping, as ROLL weights the loss built from final advantages).
    ROLL passes the weights to ``agg_loss(weights=...)``, which multiplies each sample's per-token PPO loss by
    ``w``. For ``w > 0`` scaling the advantage instead is exactly the same loss:
    ``-min(r * wA, clip(r) * wA) = -w * min(r * A, clip(r) * A)``; the dual-clip cap ``c * |wA| = w * c * |A|``
    scales alike, the sign of ``wA`` is that of ``A``, and every aggregation mode is linear in the per-token loss.
    That holds for every loss in :data:`ADVANTAGE_LINEAR_LOSSES` (SampleShaping rejects the others). The KL and
    entropy terms do not involve the advantage and stay unweighted, as in ROLL; so do the critic's returns.
    Weights are always > 0 (at least 0.5 * 0.5 before the mean-1 rescale).

    Reads ``response_mask`` (lengths, live samples) and, for difficulty_loss_weight, non-tensor ``difficulty``
    ``[B]``. Returns ROLL's ``actor/sample_weights_{mean,min,max}`` over the live samples (1.0 when none is
    live); all switches off: no change and ``{}``.
    """
    if not shaping.weights_samples:
        return {}
    if "advantages" not in batch.batch:
        raise KeyError("apply_sample_weights needs batch.batch['advantages']; call it after the advantages")
    mask = batch.batch["response_mask"]
    difficulty = _difficulty(batch) if shaping.difficulty_loss_weight else None
    weights = sample_loss_weights(mask, difficulty, difficulty_loss_weight=shaping.difficulty_loss_weight,
                                  length_loss_weight=shaping.length_loss_weight)  # fmt: skip
    advantages = batch.batch["advantages"]
    batch.batch["advantages"] = advantages * weights.to(device=advantages.device, dtype=advantages.dtype).unsqueeze(-1)
    live = mask.to(torch.bool).any(dim=-1)
    shown = weights[live] if bool(live.any()) else weights.new_ones(1)
    return {
        "actor/sample_weights_mean": float(shown.mean()),
        "actor/sample_weights_min": float(shown.min()),
        "actor/sample_weights_max": float(shown.max()),
    }
