"""verl's current rollout correction (verl 0.9.1, ``verl/trainer/ppo/rollout_corr_helper.py``), next to the seed's
:mod:`rl_core.rollout_is` (verl 0.6's API), which stays as it is.

verl split rollout correction into two independent parts, both reading ``log_ratio = old_log_prob -
rollout_log_prob`` (log pi_train / pi_rollout) and the original response mask:

- **IS weights** (``rollout_is``: ``token`` or ``sequence``) bounded by ``rollout_is_threshold``: a number truncates
  the weights at it (TIS); a ``"lower_upper"`` string zeroes weights outside ``[lower, upper]`` (IcePop) and leaves
  the mask alone. ``rollout_is_batch_normalize`` then divides the (detached) weights by their batch mean.
- **Rejection sampling** (``rollout_rs``, comma-separated options, every one must keep a token) with
  ``rollout_rs_threshold`` (one spec, or one per option): per-token divergences ``k1 = -l``, ``k2 = l^2 / 2``,
  ``k3 = exp(l) - 1 - l`` of the clamped log ratio ``l``, taken per token, summed, averaged or maxed per sequence.
  A ``k1`` spec bounds ``exp(k1) = pi_rollout / pi_train`` (verl's direction: ``"0.1_1.2"`` keeps ratios
  pi_train / pi_rollout in [1/1.2, 1/0.1]); a single value ``u`` means ``1/u _ u``. ``k2`` / ``k3`` specs are upper
  bounds. Rejected tokens leave the returned mask only; their IS weights stay.

Means follow verl's ``masked_mean`` (``sum / (count + 1e-8)``), log ratios are clamped to +-20 before ``exp``, and a
NaN log ratio of a real token propagates (verl does not clean it) and is rejected by every rejection option. One
deliberate difference: a padding position's weight is 0 even when its log ratio is NaN (verl gives NaN there,
which its token-sum losses ignore). :func:`rollout_correction` runs both parts and returns verl's metrics
(:mod:`rl_core.rollout_corr_metrics`) under ``rollout_corr/``.
"""

from __future__ import annotations

import functools
import math
import numbers
import operator
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from rl_core.fused import call as fused_call
from rl_core.fused import restore_mask
from rl_core.masked import any_set, is_set, mask_as
from rl_core.rollout_corr_metrics import (
    EPS,
    Metrics,
    is_metrics,
    masked_mean,
    row_counts,
    row_sums,
    rs_option_metrics,
    rs_overall_metrics,
)
from rl_core.rollout_is_metrics import named_floats, stacked, to_floats

SAFETY_BOUND = 20.0
"""|log ratio| is clamped to this before ``exp`` (verl's ``SAFETY_BOUND``)."""
EXP_BOUNDS = (math.exp(-SAFETY_BOUND), math.exp(SAFETY_BOUND))
"""``exp`` of the clamped log ratio's bounds (:func:`clamped_exp`)."""
METRIC_PREFIX = "rollout_corr/"
IS_LEVELS = ("token", "sequence")
RS_OPTIONS = (
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
)  # fmt: skip
"""verl's ``SUPPORTED_ROLLOUT_RS_OPTIONS``."""


# ---- thresholds ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ISBounds:
    """``rollout_is_threshold`` parsed: ``upper`` always; ``lower`` for IcePop (a ``"lower_upper"`` string)."""

    upper: float
    lower: float | None = None


def parse_is_threshold(spec: object) -> ISBounds:
    """A number or numeric string: TIS at that upper bound; ``"lower_upper"``: IcePop. Both bounds > 0, lower <=
    upper (an upper bound below 1 is allowed, as in verl). Errors name ``rollout_is_threshold``."""
    if isinstance(spec, bool):
        raise TypeError(f"rollout_is_threshold={spec!r} must be a number or a 'lower_upper' string, not a boolean.")
    if isinstance(spec, numbers.Real):
        bounds = ISBounds(float(spec))
    elif isinstance(spec, str) and spec.strip():
        text = spec.strip()
        try:
            if "_" in text:
                low, high = text.split("_", 1)
                bounds = ISBounds(float(high), float(low))
            else:
                bounds = ISBounds(float(text))
        except ValueError:
            raise ValueError(
                f"Invalid rollout_is_threshold {spec!r}: give a number (TIS) or 'lower_upper' such as '0.5_5.0' "
                "(IcePop)."
            ) from None
    else:
        raise TypeError(f"rollout_is_threshold={spec!r} must be a number or a 'lower_upper' string.")
    if not bounds.upper > 0 or (bounds.lower is not None and not 0 < bounds.lower <= bounds.upper):
        raise ValueError(f"rollout_is_threshold={spec!r}: bounds must be > 0 with lower <= upper.")
    return bounds


@dataclass(frozen=True)
class RSBounds:
    """One rejection option and its bounds (``lower`` for the k1 options only)."""

    option: str
    upper: float
    lower: float | None = None


def parse_rs(rollout_rs: object, rollout_rs_threshold: object) -> list[RSBounds]:
    """``rollout_rs`` (comma-separated options, duplicates dropped keeping the first) paired with
    ``rollout_rs_threshold`` (one spec for all, or one per option, comma-separated). Errors name the key."""
    if not isinstance(rollout_rs, str):
        raise ValueError(f"rollout_rs={rollout_rs!r} must be a comma-separated string of {list(RS_OPTIONS)}.")
    if rollout_rs_threshold is None:
        raise ValueError(f"rollout_rs={rollout_rs!r} needs rollout_rs_threshold (no default): set it explicitly.")
    options = list(dict.fromkeys(o.strip() for o in rollout_rs.split(",") if o.strip()))
    if not options:
        raise ValueError(f"rollout_rs={rollout_rs!r} names no option; use one or more of {list(RS_OPTIONS)}.")
    unknown = [o for o in options if o not in RS_OPTIONS]
    if unknown:
        raise ValueError(f"Invalid rollout_rs option(s) {unknown}; valid: {list(RS_OPTIONS)}.")
    specs = _rs_specs(rollout_rs_threshold)
    if len(specs) not in (1, len(options)):
        raise ValueError(
            f"rollout_rs_threshold={rollout_rs_threshold!r} gives {len(specs)} specs for {len(options)} options "
            f"{options}: give one spec for all, or one per option."
        )
    pairs = specs * len(options) if len(specs) == 1 else specs
    return [_rs_bounds(option, spec) for option, spec in zip(options, pairs)]


def _rs_specs(value: object) -> list[str]:
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return [str(value)]
    if not isinstance(value, str):
        raise TypeError(f"rollout_rs_threshold={value!r} must be a number or a string.")
    specs = [part.strip() for part in value.split(",") if part.strip()]
    if not specs:
        raise ValueError(f"rollout_rs_threshold={value!r} holds no spec.")
    return specs


def _rs_bounds(option: str, spec: str) -> RSBounds:
    k1 = option.endswith("k1")
    if not k1 and "_" in spec:
        raise ValueError(f"rollout_rs_threshold {spec!r} for {option}: k2 / k3 take one upper bound, no '_'.")
    try:
        if k1 and "_" in spec:
            low, high = spec.split("_", 1)
            bounds = RSBounds(option, float(high), float(low))
        elif k1:  # one value u: the symmetric band [1/u, u]
            upper = float(spec)
            bounds = RSBounds(option, upper, 1.0 / upper if upper > 0 else math.nan)
        else:
            bounds = RSBounds(option, float(spec))
    except ValueError:
        raise ValueError(f"Invalid rollout_rs_threshold {spec!r} for {option}: not a number.") from None
    lower = bounds.lower
    if not bounds.upper > 0 or (lower is not None and not 0 < lower <= bounds.upper):
        raise ValueError(f"rollout_rs_threshold {spec!r} for {option}: bounds must be > 0 with lower <= upper.")
    return bounds


def row_sum(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` sums over each row's real tokens, accumulated in float64 and rounded back to ``values``' dtype (the
    same value whatever the order of the additions: eager and fused paths agree)."""
    return row_sums(values, response_mask).to(values.dtype)


# ---- IS weights -------------------------------------------------------------------------------------------------
def clamped_exp(ratio: torch.Tensor) -> torch.Tensor:
    """``exp(clamp(l, +-20))`` from ``ratio = exp(l)``: ``exp`` is monotonic, so clamping its value to
    ``[e^-20, e^20]`` equals clamping its argument (to the last bit inside the bounds; at them the bound itself, the
    float32 of ``math.exp``, where ``exp`` of the float bound may differ in the last bit). Every ``exp`` of the
    log ratio in a correction is then the same ``exp(l)``, which the compiled graph computes once. In a dtype whose
    range ends below e^20 (float16) the upper bound is infinity, as ``exp(20)`` is there."""
    low, high = EXP_BOUNDS
    return ratio.clamp(low, high if high <= torch.finfo(ratio.dtype).max else math.inf)


def _exp_of(log_ratio: torch.Tensor, ratio: torch.Tensor | None) -> torch.Tensor:
    """``ratio`` (``exp(log_ratio)``, when the caller has computed it) or ``exp(log_ratio)``."""
    return torch.exp(log_ratio) if ratio is None else ratio


def raw_weights(
    log_ratio: torch.Tensor, response_mask: torch.Tensor, level: str, ratio: torch.Tensor | None = None
) -> torch.Tensor:
    """``[B, T]`` unbounded weights: per token ``exp(clamp(l))``, per sequence ``exp(clamp(sum of l))`` on every
    token of the row; 0 at padding. ``ratio``: ``exp(log_ratio)`` when the caller has it (one exp per token)."""
    if level not in IS_LEVELS:
        raise ValueError(f"Invalid rollout_is: {level!r}. Must be one of {list(IS_LEVELS)} (or null).")
    valid = is_set(response_mask)
    if level == "token":
        raw = clamped_exp(_exp_of(log_ratio, ratio))
    else:
        total = row_sum(log_ratio, response_mask)
        raw = torch.exp(total.clamp(-SAFETY_BOUND, SAFETY_BOUND)).unsqueeze(-1).expand_as(log_ratio)
    return torch.where(valid, raw, torch.zeros((), dtype=raw.dtype, device=raw.device))


def bound_weights(raw: torch.Tensor, bounds: ISBounds) -> torch.Tensor:
    """TIS: ``min(raw, upper)``; IcePop: ``raw`` inside ``[lower, upper]`` (inclusive), 0 outside."""
    if bounds.lower is None:
        return raw.clamp(max=bounds.upper)
    keep = (raw >= bounds.lower) & (raw <= bounds.upper)
    return torch.where(keep, raw, torch.zeros((), dtype=raw.dtype, device=raw.device))


def normalize_weights(
    weights: torch.Tensor, response_mask: torch.Tensor, level: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Divide by the batch mean weight (token level: over real tokens; sequence level: each non-empty sequence's
    mean counted once) when it exceeds 1e-8; returns the weights and the 0-dim factor divided by (1.0 if skipped)."""
    if level == "token":
        mean = masked_mean(weights, response_mask)
    else:
        per_row = masked_mean(weights, response_mask, dim=-1)
        rows = (response_mask.to(weights.dtype).sum(-1) > 0).to(weights.dtype)
        mean = (per_row * rows).sum() / rows.sum().clamp_min(EPS)
    return _divided_by_mean(weights, mean)


def _divided_by_mean(weights: torch.Tensor, mean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weights / mean`` and the 0-dim factor when the mean exceeds 1e-8, else ``weights`` and 1.0 (also for the
    NaN of 0 / 0)."""
    applies = mean > EPS
    normalized = torch.where(applies, weights / mean.to(weights.dtype), weights)
    return normalized, torch.where(applies, mean, torch.ones_like(mean))


AllReduce = Callable[[torch.Tensor], torch.Tensor]
"""Sums a small tensor over the data-parallel ranks and returns the sums (every rank must call it alike)."""


def normalize_weights_across(
    weights: torch.Tensor, response_mask: torch.Tensor, level: str, all_reduce: AllReduce
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`normalize_weights` with the mean taken over every rank's batch (verl's ``distributed_masked_mean``:
    the ranks' weight sums over their counts, token level over real tokens, sequence level over non-empty rows'
    mean weights). A rank without a real token contributes nothing but still joins the sum."""
    mask = is_set(response_mask)
    if level == "token":
        values, counted = weights.double(), mask
    else:
        values, counted = masked_mean(weights, response_mask, dim=-1), mask.any(dim=-1)
    zero = values.new_zeros(())
    local = torch.stack([torch.where(counted, values, zero).sum(), counted.double().sum()])
    total = all_reduce(local)
    return _divided_by_mean(weights, total[0] / total[1])  # 0 / 0 when no rank holds a token: left as they are


def batch_normalize(weights: torch.Tensor, response_mask: torch.Tensor, level: str) -> tuple[torch.Tensor, float]:
    """:func:`normalize_weights` with the factor as a Python float."""
    normalized, factor = normalize_weights(weights, response_mask, level)
    return normalized, float(factor)


def rollout_correction_weights(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str = "token",
    rollout_is_threshold: object = 2.0,
    rollout_is_batch_normalize: bool = False,
) -> tuple[torch.Tensor, float | None]:
    """verl's ``compute_rollout_correction_weights`` without its metrics: detached ``[B, T]`` weights and the
    batch-normalisation factor (None without normalisation)."""
    bounds = parse_is_threshold(rollout_is_threshold)
    weights = bound_weights(raw_weights(log_ratio, response_mask, rollout_is), bounds).detach()
    if not rollout_is_batch_normalize:
        return weights, None
    return batch_normalize(weights, response_mask, rollout_is)


# ---- rejection sampling -------------------------------------------------------------------------------------
def divergence(log_ratio: torch.Tensor, kind: str, ratio: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token ``k1 = -l``, ``k2 = l^2 / 2`` or ``k3 = exp(l) - 1 - l`` of ``l = clamp(log_ratio, +-20)``
    (``ratio``: ``exp(log_ratio)`` when the caller has it)."""
    clamped = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    if kind == "k1":
        return -clamped
    if kind == "k2":
        return 0.5 * clamped * clamped
    return clamped_exp(_exp_of(log_ratio, ratio)) - 1.0 - clamped


def _statistic(
    log_ratio: torch.Tensor, response_mask: torch.Tensor, option: str, counts: torch.Tensor | None = None,
    ratio: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """The option's statistic, ``[B, T]`` (token options) or ``[B, 1]`` (sequence options)."""
    level, kind = option.rsplit("_", 1)
    values = divergence(log_ratio, kind, ratio)
    if level == "token":
        return values
    if level == "seq_sum":
        return row_sum(values, response_mask).unsqueeze(-1)
    if level == "seq_mean":
        return masked_mean(values, response_mask, dim=-1, counts=counts).to(values.dtype).unsqueeze(-1)
    filled = values.masked_fill(~is_set(response_mask), -math.inf).amax(dim=-1, keepdim=True)
    return torch.where(torch.isneginf(filled), torch.zeros_like(filled), filled)  # an empty row: 0


def option_keep(stat: torch.Tensor, bounds: RSBounds) -> torch.Tensor:
    """``[B, T]`` or ``[B, 1]`` bool: what this option keeps of its statistic (NaN rejected)."""
    if bounds.lower is not None:  # k1: log(lower) <= stat <= log(upper)
        keep = (stat >= math.log(bounds.lower)) & (stat <= math.log(bounds.upper))
    else:
        keep = stat <= bounds.upper
    return keep


def rejection_mask(
    log_ratio: torch.Tensor, response_mask: torch.Tensor, rollout_rs: object, rollout_rs_threshold: object
) -> torch.Tensor:
    """verl's ``compute_rollout_rejection_mask`` without its metrics: ``response_mask`` (same dtype) with every token
    some option rejects set to 0; never adds a token."""
    options = parse_rs(rollout_rs, rollout_rs_threshold)
    if log_ratio.shape[0] == 0:
        return response_mask
    keep = torch.ones_like(log_ratio, dtype=torch.bool)
    for bounds in options:
        keep &= option_keep(_statistic(log_ratio, response_mask, bounds.option), bounds)
    return (is_set(response_mask) & keep).to(response_mask.dtype)


# ---- off-policy metrics ----------------------------------------------------------------------------------------
def offpolicy_metrics(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor | None, response_mask: torch.Tensor
) -> dict[str, float]:
    """verl's ``compute_offpolicy_metrics`` (no prefix; verl logs them under ``rollout_corr/``): perplexities of the
    training (and rollout) policy per sequence averaged over all rows, ``kl`` (k1 of KL(rollout || train)),
    ``k3_kl``, log-perplexity differences, ``ppl_ratio``, ``chi2_token`` and ``chi2_seq``."""
    if not any_set(response_mask):
        raise ValueError("response_mask must contain at least one valid token.")
    return to_floats(offpolicy_tensors(old_log_prob, rollout_log_prob, response_mask))


def offpolicy_tensors(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor | None,
    response_mask: torch.Tensor,
    counts: torch.Tensor | None = None,
    ratio: torch.Tensor | None = None,
) -> Metrics:
    """:func:`offpolicy_metrics` as 0-dim tensors (no device sync); ``response_mask`` must hold a real token,
    ``counts`` are its rows' token counts (:func:`row_counts`) and ``ratio`` is ``exp(old - rollout)``, when the
    caller has them. ``kl`` is minus the mean log ratio: ``rollout - old`` is exactly ``-(old - rollout)`` in
    floating point, so it shares the rows' sums of the log ratio with ``chi2_seq``; ``chi2_token``'s
    ``exp(clamp(l, +-20))`` is :func:`clamped_exp` of ``k3_kl``'s ``exp(l)`` (one ``exp`` per token)."""
    counts = row_counts(response_mask) if counts is None else counts
    train_mean = masked_mean(old_log_prob, response_mask, dim=-1, counts=counts)
    out = {"training_ppl": torch.exp(-train_mean).mean(), "training_log_ppl": (-train_mean).mean()}
    if rollout_log_prob is not None:
        log_ratio = old_log_prob - rollout_log_prob
        rollout_mean = masked_mean(rollout_log_prob, response_mask, dim=-1, counts=counts)
        diff = rollout_mean - train_mean
        ratio = _exp_of(log_ratio, ratio)
        ratio_sums = row_sums(log_ratio, response_mask)
        seq_sum = ratio_sums.clamp(-SAFETY_BOUND, SAFETY_BOUND)
        out.update(
            kl=-ratio_sums.sum() / (counts.sum() + EPS),
            k3_kl=masked_mean(ratio - log_ratio - 1.0, response_mask, counts=counts),
            rollout_ppl=torch.exp(-rollout_mean).mean(),
            rollout_log_ppl=(-rollout_mean).mean(),
            log_ppl_diff=diff.mean(),
            log_ppl_abs_diff=diff.abs().mean(),
            log_ppl_diff_max=diff.max(),
            log_ppl_diff_min=diff.min(),
            ppl_ratio=torch.exp(diff).mean(),
            chi2_token=masked_mean(clamped_exp(ratio) ** 2, response_mask, counts=counts) - 1.0,
            chi2_seq=torch.exp(2.0 * seq_sum).mean() - 1.0,
        )
    return out


# ---- the whole correction -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CorrectionSpec:
    """The parsed options of one rollout correction (hashable: a compiled correction is reused for equal specs)."""

    level: str | None  # None: no IS weights
    is_bounds: ISBounds | None
    batch_normalize: bool
    rs: tuple[RSBounds, ...]


_SPECS: dict[CorrectionSpec, CorrectionSpec] = {}


def correction_spec(
    rollout_is: str | None, rollout_is_threshold: object, rollout_is_batch_normalize: bool, rollout_rs: str | None,
    rollout_rs_threshold: object,
) -> CorrectionSpec:  # fmt: skip
    """Validate and parse the options (errors name the key); equal options give the same object."""
    level, bounds = None, None
    if rollout_is is not None and rollout_is_threshold is not None:
        bounds = parse_is_threshold(rollout_is_threshold)
        if rollout_is not in IS_LEVELS:
            raise ValueError(f"Invalid rollout_is: {rollout_is!r}. Must be one of {list(IS_LEVELS)} (or null).")
        level = rollout_is
    rs = () if rollout_rs is None else tuple(parse_rs(rollout_rs, rollout_rs_threshold))
    spec = CorrectionSpec(level, bounds, bool(rollout_is_batch_normalize), rs)
    return _SPECS.setdefault(spec, spec)


def _without_batch_normalize(spec: CorrectionSpec) -> CorrectionSpec:
    local = replace(spec, batch_normalize=False)
    return _SPECS.setdefault(local, local)


def correction_tensors(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor, spec: CorrectionSpec,
    ratio: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, Metrics]:  # fmt: skip
    """The correction as pure tensor code, metrics as 0-dim tensors (one graph: :mod:`rl_core.fused` compiles it).
    ``response_mask`` must hold a real token; ``ratio``: ``exp(old_log_prob - rollout_log_prob)`` when the caller
    has it."""
    log_ratio = old_log_prob - rollout_log_prob
    ratio = _exp_of(log_ratio, ratio)  # the one exp per token that every part below reads
    counts = row_counts(response_mask)  # one sum of the mask serves every mean below
    # first: in the compiled graph its row sums then lie next to the others (rl_core.fused.CPU_INDUCTOR_OPTIONS)
    offpolicy = offpolicy_tensors(old_log_prob, rollout_log_prob, response_mask, counts, ratio)
    metrics: Metrics = {}
    weights = None
    if spec.level is not None and spec.is_bounds is not None:
        raw = raw_weights(log_ratio, response_mask, spec.level, ratio)
        bounded = bound_weights(raw, spec.is_bounds)
        metrics.update(is_metrics(bounded, raw, log_ratio, response_mask, spec.level, spec.is_bounds, counts))
        weights = bounded.detach()
        if spec.batch_normalize:
            weights, metrics["rollout_is_batch_norm_factor"] = normalize_weights(weights, response_mask, spec.level)
    new_mask = response_mask.clone()
    if spec.rs:
        kept = []  # per option: [B, T] for token options, [B, 1] for sequence ones
        for option in spec.rs:
            stat = _statistic(log_ratio, response_mask, option.option, counts, ratio)
            kept.append(option_keep(stat, option))
            metrics.update(rs_option_metrics(stat, kept[-1], response_mask, option, counts))
        keep = functools.reduce(operator.and_, kept)  # [B, 1] when every option is a sequence one
        metrics.update(rs_overall_metrics(keep, response_mask, counts))
        new_mask = mask_as(is_set(response_mask) & keep, response_mask.dtype)
    metrics.update(offpolicy)
    return weights, new_mask, metrics


def correction_stacked(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor, spec: CorrectionSpec
) -> tuple[torch.Tensor | None, torch.Tensor, tuple[str, ...], torch.Tensor, torch.Tensor]:
    """:func:`correction_tensors` with its metrics stacked into one float64 vector in the same graph (the unit
    :mod:`rl_core.fused` compiles): the weights, the new mask, the metric names, their values, and the ratio
    ``exp(old_log_prob - rollout_log_prob)``, which the caller drops. The graph returns the ratio so that Inductor
    stores it from an element-wise pass of its own, where ``torch.exp`` is a vector call with no accumulators around
    it to spill (inlined into the row loop, a call would spill them; see :mod:`rl_core.fused`): measured at 128 x
    4096, one thread, in one process, in turn, 80 samples: 1.48 -> 1.34 ms against a polynomial ``exp`` inlined."""
    ratio = torch.exp(old_log_prob - rollout_log_prob)
    weights, new_mask, metrics = correction_tensors(old_log_prob, rollout_log_prob, response_mask, spec, ratio)
    return (weights, new_mask, *stacked(metrics), ratio)


def rollout_correction(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    rollout_is: str | None = None,
    rollout_is_threshold: object = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold: object = None,
    fused: bool | None = None,
    all_reduce: AllReduce | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """verl's ``compute_rollout_correction_and_rejection_mask``: the detached IS weights (None when ``rollout_is`` or
    ``rollout_is_threshold`` is None), the response mask with rejected tokens removed, and every metric verl logs
    (IS, rejection per option and overall, off-policy) prefixed ``rollout_corr/``. IS and rejection both read the
    original mask. A batch without a real token, or inputs of different shapes, raise ``ValueError``. ``fused``:
    the compiled one-graph path (:mod:`rl_core.fused`; None chooses by size). ``all_reduce``: batch normalisation
    divides by the mean over every data-parallel rank's batch (:func:`normalize_weights_across`; verl does so
    whenever ``torch.distributed`` is initialised)."""
    if old_log_prob.shape != rollout_log_prob.shape or old_log_prob.shape != response_mask.shape:
        raise ValueError(
            f"old_log_prob {tuple(old_log_prob.shape)}, rollout_log_prob {tuple(rollout_log_prob.shape)} and "
            f"response_mask {tuple(response_mask.shape)} must have one shape."
        )
    spec = correction_spec(
        rollout_is, rollout_is_threshold, rollout_is_batch_normalize, rollout_rs, rollout_rs_threshold
    )
    if not any_set(response_mask):
        raise ValueError("response_mask must contain at least one valid token (1).")
    across = all_reduce is not None and spec.batch_normalize and spec.level is not None
    with torch.no_grad():
        inputs = (old_log_prob, rollout_log_prob, response_mask, _without_batch_normalize(spec) if across else spec)
        weights, new_mask, names, values, _ = fused_call(correction_stacked, response_mask.numel(), fused, *inputs)
        metrics = named_floats(names, values, METRIC_PREFIX)
        if across and weights is not None and all_reduce is not None and spec.level is not None:
            # after the graph: a collective inside it would break it
            weights, factor = normalize_weights_across(weights, response_mask, spec.level, all_reduce)
            metrics[f"{METRIC_PREFIX}rollout_is_batch_norm_factor"] = float(factor)
    # the fused path on CPU reads a bool mask as bytes (rl_core.fused): the caller gets its own dtype back
    return weights, restore_mask(new_mask, response_mask.dtype), metrics
