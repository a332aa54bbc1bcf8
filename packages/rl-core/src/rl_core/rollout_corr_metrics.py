"""The diagnostics verl 0.9.1 logs with its rollout correction (``compute_is_metrics``, ``compute_rs_metrics``), under
the same names without the ``rollout_corr/`` prefix :func:`rl_core.rollout_corr.rollout_correction` adds.

Averages follow verl: token-weighted means over real tokens (``masked_mean``: ``sum / (count + 1e-8)``); the
``seq_*`` statistics of the IS weights and the sequence-level max / min / fractions run over every row of the batch,
rows without a real token included (their per-row mean is 0), while the rejection statistics of sequences run over
rows with a real token only. Standard deviations over tokens are population ones of the values clamped to the
bounds; over rows, Bessel-corrected. One difference: verl's effective sample size divides by zero when every weight
is 0 (IcePop rejecting all); here it is 0.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from rl_core.masked import masked_sum

if TYPE_CHECKING:
    from rl_core.rollout_corr import ISBounds, RSBounds

Metrics = dict[str, float]
EPS = 1e-8
"""verl's ``masked_mean`` denominator guard and batch-normalisation floor."""


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """verl's ``masked_mean``, denominator included: ``masked_sum / (count + 1e-8)`` (an empty row gives 0), where
    :func:`rl_core.masked.masked_mean` divides by ``max(count, 1)``."""
    count = mask.to(values.dtype).sum() if dim is None else mask.to(values.dtype).sum(dim)
    return masked_sum(values, mask, dim) / (count + EPS)


def _valid_extreme(values: torch.Tensor, valid: torch.Tensor, largest: bool) -> float:
    picked = values[valid]
    return float(picked.max() if largest else picked.min())


def _clamped_std(values: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> float:
    """Population std over real tokens of ``values`` clamped to ``[low, high]`` (0 with one token or none)."""
    if float(mask.float().sum()) <= 1:
        return 0.0
    clamped = values.clamp(low, high)
    variance = masked_mean(clamped * clamped, mask) - masked_mean(clamped, mask) ** 2
    return float(variance.clamp_min(0.0).sqrt())


def _row_std(values: torch.Tensor) -> float:
    return float(values.std()) if values.numel() > 1 else 0.0


def _require_tokens(mask: torch.Tensor) -> None:
    if not bool(mask.bool().any()):
        raise ValueError("response_mask must contain at least one valid token.")


def is_metrics(
    weights: torch.Tensor, raw: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor, level: str,
    bounds: ISBounds,
) -> Metrics:  # fmt: skip
    """``rollout_is_*`` of the bounded weights (before batch normalisation) and the raw ones (``raw``, 0 at padding);
    ``log_ratio`` feeds the sequence level's max / min / fractions (the rows' unclamped sums)."""
    _require_tokens(mask)
    valid = mask.bool()
    upper = bounds.upper
    lower = bounds.lower if bounds.lower is not None else 1.0 / upper
    out: Metrics = {"rollout_is_mean": float(masked_mean(weights, mask))}
    if level == "sequence":
        sums = masked_sum(log_ratio, mask, dim=-1)
        out["rollout_is_max"] = math.exp(min(float(sums.max()), 20.0))
        out["rollout_is_min"] = math.exp(float(sums.min()))
        out["rollout_is_ratio_fraction_high"] = float((sums > math.log(upper)).float().mean())
        out["rollout_is_ratio_fraction_low"] = float((sums < math.log(lower)).float().mean())
    else:
        out["rollout_is_max"] = _valid_extreme(weights, valid, largest=True)
        out["rollout_is_min"] = _valid_extreme(weights, valid, largest=False)
        out["rollout_is_ratio_fraction_high"] = float(masked_mean((raw > upper).to(weights.dtype), mask))
        out["rollout_is_ratio_fraction_low"] = float(masked_mean((raw < lower).to(weights.dtype), mask))
    out["rollout_is_std"] = _clamped_std(weights, mask, 0.0, upper)
    out["rollout_is_eff_sample_size"] = _effective_sample_size(weights.clamp(0.0, upper), mask)
    row_means = masked_mean(weights, mask, dim=-1)
    out.update(
        rollout_is_seq_mean=float(row_means.mean()),
        rollout_is_seq_std=_row_std(row_means),
        rollout_is_seq_max=float(row_means.max()),
        rollout_is_seq_min=float(row_means.min()),
        rollout_is_seq_max_deviation=float((row_means - 1.0).abs().max()),
    )
    raw_means = masked_mean(raw, mask, dim=-1)
    out["rollout_is_seq_fraction_high"] = float((raw_means > upper).float().mean())
    out["rollout_is_seq_fraction_low"] = float((raw_means < lower).float().mean())
    if bounds.lower is not None:
        outside = (raw < bounds.lower) | (raw > upper)
        out["rollout_is_oob_ratio"] = float(masked_mean(outside.to(weights.dtype), mask))
    return out


def _effective_sample_size(weights: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 / mean((w / mean w)^2)`` over real tokens, i.e. ``(mean w)^2 / mean(w^2)`` (0 when every weight is 0)."""
    mean = masked_mean(weights, mask)
    second = float(masked_mean((weights / (mean + EPS)) ** 2, mask))
    return 1.0 / second if second > 0 else 0.0


def rs_option_metrics(stat: torch.Tensor, keep: torch.Tensor, mask: torch.Tensor, bounds: RSBounds) -> Metrics:
    """``rollout_rs_<option>_*`` of one option: its statistic ``stat`` (``[B, T]`` for token options, ``[B, 1]`` for
    sequence ones) and the tokens it keeps."""
    _require_tokens(mask)
    k1 = bounds.lower is not None
    high = math.log(bounds.upper) if k1 else bounds.upper
    low = math.log(bounds.lower) if bounds.lower is not None else 0.0
    sequence = bounds.option.startswith("seq_")
    per_token = stat.expand_as(mask).float()
    valid = mask.bool()
    rows_with_tokens = valid.any(dim=-1)
    row_values = (stat[:, 0].float() if sequence else masked_mean(per_token, mask, dim=-1))[rows_with_tokens]
    name = f"rollout_rs_{bounds.option}_"
    out: Metrics = {f"{name}mean": float(masked_mean(per_token, mask))}
    if sequence:
        out[f"{name}max"], out[f"{name}min"] = float(row_values.max()), float(row_values.min())
        out[f"{name}fraction_high"] = float((row_values > high).float().mean())
        out[f"{name}fraction_low"] = float((row_values < low).float().mean()) if k1 else 0.0
    else:
        out[f"{name}max"] = _valid_extreme(per_token, valid, largest=True)
        out[f"{name}min"] = _valid_extreme(per_token, valid, largest=False)
        out[f"{name}fraction_high"] = float(masked_mean((per_token > high).float(), mask))
        out[f"{name}fraction_low"] = float(masked_mean((per_token < low).float(), mask)) if k1 else 0.0
    out[f"{name}std"] = _clamped_std(per_token, mask, low if k1 else 0.0, high)
    out.update({
        f"{name}seq_mean": float(row_values.mean()), f"{name}seq_std": _row_std(row_values),
        f"{name}seq_max": float(row_values.max()), f"{name}seq_min": float(row_values.min()),
        f"{name}seq_max_deviation": float(row_values.abs().max()),
        f"{name}seq_fraction_high": float((row_values > high).float().mean()),
    })  # fmt: skip
    if k1:
        out[f"{name}seq_fraction_low"] = float((row_values < low).float().mean())
    rejected = valid & ~keep
    out[f"{name}masked_fraction"] = float(masked_mean(rejected.float(), mask))
    out[f"{name}seq_masked_fraction"] = float(rejected.any(dim=-1)[rows_with_tokens].float().mean())
    return out


def rs_overall_metrics(keep: torch.Tensor, mask: torch.Tensor) -> Metrics:
    """``rollout_rs_masked_fraction`` (token-weighted) and ``rollout_rs_seq_masked_fraction`` (over every row)."""
    rejected = mask.bool() & ~keep
    return {
        "rollout_rs_masked_fraction": float(masked_mean(rejected.float(), mask)),
        "rollout_rs_seq_masked_fraction": float(rejected.any(dim=-1).float().mean()),
    }
