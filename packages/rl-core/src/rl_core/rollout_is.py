"""Rollout importance sampling (IS): correct the mismatch between the rollout engine and the training policy.

The rollout engine (e.g. vLLM in bf16) samples from pi_rollout, while the loss is computed under pi_train (e.g.
FSDP in fp32). Per token, the IS ratio r = pi_train / pi_rollout = exp(old_log_prob - rollout_log_prob) re-weights
the policy gradient toward pi_train. Design and names follow verl's PR "[BREAKING][rollout, trainer, algo] feat:
implement comprehensive Rollout Importance Sampling framework" (``verl/trainer/ppo/mismatch_helper.py``), the
blog post "When Speed Kills Stability: Demystifying RL Collapse from the Inference-Training Mismatch" (Liu, Li et
al., 2025, https://yingru.notion.site/When-Speed-Kills-Stability-271211a558b7808d8b12d403fd15edda), plus the
``mask`` (rejection-sampling) mode of verl's later "rollout correction".

Two independent axes, one registry each: the IS level (``token`` / ``sequence`` / ``geometric``: how per-token
log ratios become a weight) and the bounding mode (``truncate`` / ``clip`` / ``mask``: how large or small weights
are tamed). A veto drops whole sequences containing a catastrophic token. As in verl's rollout correction
(``verl/trainer/ppo/rollout_corr_helper.py``, verl >= 0.6.1), rejections (``mask`` mode) and vetoes live only in
the returned response mask: the weights there keep their bounded values. All math is in log space; |log ratio| is
clamped to 20 before exp. Padding never influences anything, even when it holds NaN / Inf. The docs are in
``docs/rollout-importance-sampling.md``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from rl_core.registry import Registry
from rl_core.rollout_is_metrics import (
    NON_FINITE_CUTOFF,
    LogGaps,
    Units,
    as_float,
    bound_fractions,
    compute_dtype,
    effective_sample_size,
    float_mask,
    indicator,
    log_gaps,
    masked_row_sum,
    mismatch_tensors,
    non_finite_count,
    ratio_minus_one,
    ratio_tensors,
    to_floats,
    training_ppl_tensors,
)

METRIC_PREFIX = "mismatch/"

# ---------------------------------------------------------------------------------------------------------------
# IS levels: LogGaps -> log ratio per unit, [B, T] (one per token) or [B, 1] (one per sequence, broadcast).

LevelFn = Callable[[LogGaps], torch.Tensor]
IS_LEVELS: Registry[LevelFn] = Registry("rollout IS level", "rollout_is_level")


@IS_LEVELS.register("token")
def token_log_ratio(gaps: LogGaps) -> torch.Tensor:
    """log r_t = log pi_train(y_t) - log pi_rollout(y_t) per token. ``[B, T]``. Biased, low variance."""
    return gaps.log_ratio


@IS_LEVELS.register("sequence")
def sequence_log_ratio(gaps: LogGaps) -> torch.Tensor:
    """log prod_t r_t = sum_t log r_t per sequence. ``[B, 1]``. Unbiased, high variance."""
    return gaps.row_sum


@IS_LEVELS.register("geometric")
def geometric_log_ratio(gaps: LogGaps) -> torch.Tensor:
    """log (prod_t r_t)^(1/T) = mean_t log r_t per sequence. ``[B, 1]``. A length-normalised middle ground."""
    return gaps.row_sum / gaps.valid_count.clamp(min=1)


# ---------------------------------------------------------------------------------------------------------------
# Bounding modes: per-unit ratios and where they leave [lower, upper] -> weights and units kept in the mask.


class UnitRatios(NamedTuple):
    """IS ratios per unit (token ``[B, T]`` or sequence ``[B, 1]``) and their position against the bounds."""

    expm1: torch.Tensor  # ratio - 1, ratio = exp(clamp(log ratio, +-20)); 0 at padding
    above: torch.Tensor  # float 0/1, log ratio > log(upper)
    below: torch.Tensor  # float 0/1, log ratio < log(lower)


class Bounded(NamedTuple):
    """What a bounding mode made of the unit ratios (tensors shaped like them)."""

    weight: torch.Tensor  # bounded IS weight per unit, before padding; fresh (scaled in place later)
    keep: torch.Tensor | None  # float 0/1, units kept in the response mask (weights untouched); None keeps all


@dataclass(frozen=True)
class BoundingMode:
    """One entry of the bounding-mode registry."""

    bound: Callable[[UnitRatios, float], Bounded]
    # Past participle naming the mode's effect in the metrics `rollout_is_[seq_]<affected>_fraction`.
    affected: str
    # Whether ratios below the lower bound are affected too (clip, mask) or only those above the upper (truncate).
    bounds_lower: bool


IS_MODES: Registry[BoundingMode] = Registry("rollout IS mode", "rollout_is_mode")


def _truncate(units: UnitRatios, upper: float) -> Bounded:
    """TIS: w = min(r, upper). Keeps every sample and its gradient direction, caps the variance."""
    return Bounded(units.expm1.clamp(max=upper - 1.0).add_(1.0), None)


def _inside(units: UnitRatios) -> torch.Tensor:
    """Float 0/1: lower <= r <= upper (above and below are never both set)."""
    return (1.0 - units.above).sub_(units.below)


def _clip(units: UnitRatios, upper: float) -> Bounded:
    """CIS: w = r inside [lower, upper], 0 outside (the sample stays in the mask with zero weight)."""
    return Bounded((units.expm1 + 1.0).mul_(_inside(units)), None)


def _mask(units: UnitRatios, upper: float) -> Bounded:
    """MIS / rejection sampling: w = r; units outside [lower, upper] leave the response mask, not the weights."""
    return Bounded(units.expm1 + 1.0, _inside(units))


IS_MODES.register("truncate")(BoundingMode(_truncate, affected="truncated", bounds_lower=False))
IS_MODES.register("clip")(BoundingMode(_clip, affected="clipped", bounds_lower=True))
IS_MODES.register("mask")(BoundingMode(_mask, affected="masked", bounds_lower=True))


# ---------------------------------------------------------------------------------------------------------------
# Configuration


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def check_thresholds(threshold: float, threshold_lower: float | None, veto_threshold: float | None) -> float:
    """Validate the thresholds (errors name the config key) and return the lower one (default 1 / upper)."""
    if not _is_number(threshold) or not threshold >= 1.0:
        raise ValueError(
            "rollout_is_threshold must be a finite number >= 1.0 (a ratio of 1 means no mismatch) or null to "
            f"disable rollout IS, got {threshold!r}"
        )
    lower = 1.0 / threshold if threshold_lower is None else threshold_lower
    if not _is_number(lower) or not 0.0 < lower <= 1.0:
        raise ValueError(
            f"rollout_is_threshold_lower must be in (0, 1] or null (= 1 / rollout_is_threshold), got {lower!r}"
        )
    if veto_threshold is not None and (not _is_number(veto_threshold) or not 0.0 < veto_threshold < 1.0):
        raise ValueError(
            f"rollout_is_veto_threshold must be in (0, 1) or null to disable the veto, got {veto_threshold!r}"
        )
    return float(lower)


@dataclass
class RolloutISConfig:
    """Rollout IS settings; field names are verl's ``algorithm.*`` keys (``ppo_trainer.yaml``)."""

    rollout_is_threshold: float | None = None
    """Upper bound on IS weights (e.g. 2.0); null disables rollout IS entirely: no weights, no metrics."""
    rollout_is: bool = False
    """True applies the weights (and rejections) to the loss; False computes the metrics only."""
    rollout_is_threshold_lower: float | None = None
    """Lower bound for clip / mask modes; null means 1 / rollout_is_threshold."""
    rollout_is_level: str = "token"
    """How token ratios become weights: token, sequence (product) or geometric (geometric mean)."""
    rollout_is_mode: str = "truncate"
    """How weights are bounded: truncate (cap at upper), clip (zero outside bounds), mask (reject outside)."""
    rollout_is_veto_threshold: float | None = 1e-4
    """Drop a whole sequence when any token ratio is below this; null disables the veto."""

    def validate(self) -> None:
        """Raise ``ValueError`` naming the offending key; a disabled config (threshold null) is always valid."""
        if not isinstance(self.rollout_is, bool):
            raise ValueError(f"rollout_is must be true or false, got {self.rollout_is!r}")
        IS_LEVELS.get(self.rollout_is_level)
        IS_MODES.get(self.rollout_is_mode)
        if self.rollout_is_threshold is not None:
            check_thresholds(self.rollout_is_threshold, self.rollout_is_threshold_lower, self.rollout_is_veto_threshold)


# ---------------------------------------------------------------------------------------------------------------
# Entry points


def _check_shapes(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> None:
    if old.dim() != 2 or old.shape != rollout.shape or old.shape != mask.shape:
        raise ValueError(
            "old_log_prob, rollout_log_prob and response_mask must all be [batch, response_length], got "
            f"{tuple(old.shape)}, {tuple(rollout.shape)} and {tuple(mask.shape)}"
        )


def _require_rollout(rollout: torch.Tensor | None) -> torch.Tensor:
    if rollout is None:
        raise ValueError(
            "rollout importance sampling needs rollout_log_prob: make the rollout engine return log-probs "
            "(verl: actor_rollout_ref.rollout.calculate_log_probs: true) or set rollout_is_threshold: null"
        )
    return rollout


def _veto(gaps: LogGaps, veto_threshold: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, 1]`` float 0/1 vetoed sequences and the number of catastrophic tokens.

    A valid token is catastrophic when its ratio is below ``veto_threshold`` or its log ratio is not finite (the
    latter even with the veto disabled: it is stored as ``NON_FINITE_GAP``, below any ``log(veto_threshold)``).
    Padding carries log ratio 0, i.e. ratio 1 > veto_threshold.
    """
    cutoff = NON_FINITE_CUTOFF if veto_threshold is None else math.log(veto_threshold)
    n_catastrophic = indicator(gaps.log_ratio, cutoff, above=False).sum()
    return indicator(gaps.row_min, cutoff, above=False), n_catastrophic


def _apply_keep(response_mask: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``response_mask`` (any dtype) zeroed where the float 0/1 ``keep`` (broadcastable) is 0."""
    if response_mask.dtype == torch.bool:  # via uint8: bool kernels are slow on CPU
        return (response_mask.view(torch.uint8) & keep.to(torch.uint8)).view(torch.bool)
    return response_mask * keep.to(response_mask.dtype)


def compute_rollout_is_weights(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    level: str = "token",
    mode: str = "truncate",
    threshold: float | None = 2.0,
    threshold_lower: float | None = None,
    veto_threshold: float | None = 1e-4,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """Rollout IS weights, the response mask with rejections applied, and ``mismatch/`` metrics (verl PR).

    Args:
        old_log_prob: ``[B, T]`` log pi_train of the sampled tokens (recomputed by the training engine).
        rollout_log_prob: ``[B, T]`` log pi_rollout of the same tokens, as returned by the rollout engine.
        response_mask: ``[B, T]`` bool / 0-1, True = the token counts. Padding may hold any log-prob value.
        level: ``token`` (r_t), ``sequence`` (prod_t r_t) or ``geometric`` ((prod_t r_t)^(1/T)), broadcast over
            a sequence's tokens for the last two (config key ``rollout_is_level``).
        mode: ``truncate`` (w = min(r, upper)), ``clip`` (w = r inside [lower, upper], else 0) or ``mask`` (w = r,
            also for rejected units; units outside [lower, upper] are removed from the returned mask only)
            (``rollout_is_mode``).
        threshold: upper bound (``rollout_is_threshold``); None disables IS: returns ``(None, response_mask, {})``.
        threshold_lower: lower bound for clip / mask; None means ``1 / threshold``.
        veto_threshold: a sequence with any valid token ratio below this is dropped from the returned mask (its
            weights are left as the mode made them); None disables the veto. A non-finite log ratio at a valid
            position always drops its sequence.

    Returns:
        ``(weights, response_mask, metrics)``: detached weights ``[B, T]``, the mask with vetoed / rejected tokens
        zeroed (input dtype; never adds tokens), and Python floats keyed ``mismatch/...`` as documented in
        ``docs/rollout-importance-sampling.md``. Weights are 0 at padding; at vetoed / rejected tokens they keep
        the mode's bounded value (verl's convention: rejection is carried by the mask alone), so the loss must use
        the returned mask; ``weights * response_mask`` is what each token actually gets.
    """
    if threshold is None:
        return None, response_mask, {}
    lower = check_thresholds(threshold, threshold_lower, veto_threshold)
    aggregate = IS_LEVELS.get(level)
    bounding = IS_MODES.get(mode)
    rollout = _require_rollout(rollout_log_prob)
    _check_shapes(old_log_prob, rollout, response_mask)
    with torch.no_grad():
        gaps = log_gaps(old_log_prob, rollout, response_mask)
        log_unit = aggregate(gaps)  # [B, T] or [B, 1]
        per_token = log_unit.shape == gaps.valid.shape
        units = _units(ratio_minus_one(log_unit), gaps, per_token)
        above = indicator(log_unit, math.log(threshold), above=True)
        below = indicator(log_unit, math.log(lower), above=False)
        bounded = bounding.bound(UnitRatios(units.expm1, above, below), float(threshold))
        vetoed, n_catastrophic = _veto(gaps, veto_threshold)
        keep = 1.0 - vetoed if bounded.keep is None else bounded.keep * (1.0 - vetoed)
        unit_weight = bounded.weight.mul_(units.pop)  # rejections stay out of the weights: they live in the mask
        weights = unit_weight if per_token else unit_weight * gaps.valid
        new_mask = _apply_keep(response_mask, keep)
        n_seqs = (gaps.valid_count > 0).sum().to(log_unit.dtype)
        named = {
            **ratio_tensors(units, gaps),
            **bound_fractions(above, below, units, gaps, bounding.affected, bounding.bounds_lower),
            "rollout_is_eff_sample_size": effective_sample_size(unit_weight * keep, units.pop.sum()),
            "rollout_is_veto_fraction": vetoed.sum() / n_seqs.clamp(min=1),
            "rollout_is_catastrophic_token_fraction": n_catastrophic / gaps.valid_count.sum().clamp(min=1),
            **mismatch_tensors(old_log_prob, gaps, _token_expm1_row_sum(units, gaps, per_token)),
        }
    return weights, new_mask, to_floats(named, METRIC_PREFIX)


def _units(expm1_unit: torch.Tensor, gaps: LogGaps, per_token: bool) -> Units:
    """The unit view of a batch: one unit per token, or one per sequence (``[B, 1]``, broadcast over its tokens)."""
    row_in = gaps.row_in
    row_sum = expm1_unit.sum(-1)
    if per_token:
        return Units(expm1_unit, row_sum, gaps.valid, gaps.valid * row_in, row_in.squeeze(-1))
    pop = as_float(gaps.valid_count > 0, expm1_unit.dtype)
    return Units(expm1_unit, row_sum, pop, pop * row_in, (gaps.valid_count * row_in).squeeze(-1))


def _token_expm1_row_sum(units: Units, gaps: LogGaps, per_token: bool) -> torch.Tensor:
    """``[B]`` sums over each sequence of per-token ``ratio - 1`` (already there when units are tokens)."""
    return units.expm1_row_sum if per_token else ratio_minus_one(gaps.log_ratio).sum(-1)


def compute_mismatch_metrics(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor | None, response_mask: torch.Tensor
) -> dict[str, float]:
    """The ``mismatch_*`` metrics of the verl PR, **unprefixed** (the IS function adds ``mismatch/``).

    Shapes ``[B, T]``. With ``rollout_log_prob=None`` only ``mismatch_training_ppl`` and
    ``mismatch_training_log_ppl`` are returned. Sequences with a non-finite log-prob gap (or, without rollout
    log-probs, a non-finite training log-prob) at a valid token are left out.
    """
    _check_shapes(old_log_prob, old_log_prob if rollout_log_prob is None else rollout_log_prob, response_mask)
    with torch.no_grad():
        if rollout_log_prob is None:
            valid = float_mask(response_mask, compute_dtype(old_log_prob))
            count = valid.sum(-1, keepdim=True)
            # A sequence with a non-finite training log-prob at a valid token is left out, as with the gaps.
            row_in = ((non_finite_count(old_log_prob, valid) == 0) & (count > 0)).to(valid.dtype)
            return to_floats(training_ppl_tensors(masked_row_sum(old_log_prob, valid), count, row_in))
        gaps = log_gaps(old_log_prob, rollout_log_prob, response_mask)
        return to_floats(mismatch_tensors(old_log_prob, gaps, ratio_minus_one(gaps.log_ratio).sum(-1)))


def apply_rollout_is(
    config: RolloutISConfig,
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """:func:`compute_rollout_is_weights` driven by a :class:`RolloutISConfig`, with metrics-only mode.

    ``rollout_is=False`` computes every metric (what IS *would* do) but returns ``None`` weights and the mask
    unchanged, so the loss is untouched (verl's ``algorithm.rollout_is`` flag). Shapes ``[B, T]``.
    """
    config.validate()
    weights, new_mask, metrics = compute_rollout_is_weights(
        old_log_prob,
        rollout_log_prob,
        response_mask,
        level=config.rollout_is_level,
        mode=config.rollout_is_mode,
        threshold=config.rollout_is_threshold,
        threshold_lower=config.rollout_is_threshold_lower,
        veto_threshold=config.rollout_is_veto_threshold,
    )
    if not config.rollout_is:
        return None, response_mask, metrics
    return weights, new_mask, metrics
