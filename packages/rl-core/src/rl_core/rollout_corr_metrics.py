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

Metrics = dict[str, torch.Tensor]
"""Metric name -> 0-dim tensor; :func:`rl_core.rollout_corr.rollout_correction` turns them into floats at once."""
EPS = 1e-8
"""verl's ``masked_mean`` denominator guard and batch-normalisation floor."""


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """verl's ``masked_mean``, denominator included: ``masked_sum / (count + 1e-8)`` (an empty row gives 0), where
    :func:`rl_core.masked.masked_mean` divides by ``max(count, 1)``. Accumulated and returned in float64: float32
    sums of a batch's tokens lose digits (gaps of +-1e4 next to 1e-2) in a way that depends on the order of the
    additions, so the eager and the fused path would disagree; float64 makes both the correctly rounded value."""
    values = values.double()
    if dim is None:  # rows first: the compiled path then reads the batch once for all of a row's sums
        return masked_sum(values, mask, -1).sum() / (mask.to(values.dtype).sum(-1).sum() + EPS)
    return masked_sum(values, mask, dim) / (mask.to(values.dtype).sum(dim) + EPS)


def _valid_extreme(values: torch.Tensor, valid: torch.Tensor, largest: bool) -> torch.Tensor:
    """Max (``largest``) or min of ``values`` where the bool ``valid`` holds (NaN there propagates)."""
    if largest:  # rows first, as in masked_mean
        return values.masked_fill(~valid, -math.inf).amax(-1).amax()
    return values.masked_fill(~valid, math.inf).amin(-1).amin()


def _clamped_std(values: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Population std over real tokens of ``values`` clamped to ``[low, high]`` (0 with one token or none), as
    ``sqrt(E[x^2] - E[x]^2)`` like verl but in float64: verl's float32 leaves noise of order 1e-6 where the spread is
    0 (every value clamped to one bound), which would depend on the order of the sums."""
    clamped = values.clamp(low, high).double()
    variance = masked_mean(clamped * clamped, mask) - masked_mean(clamped, mask) ** 2
    count = mask.to(clamped.dtype).sum(-1).sum()
    return torch.where(count > 1, variance.clamp_min(0.0).sqrt(), torch.zeros_like(variance))


class _Rows:
    """Statistics over the rows a float 0/1 ``rows`` ``[B]`` selects (at least one): mean, Bessel std, max, min and
    the fraction of a condition; values of rows left out never reach them."""

    def __init__(self, values: torch.Tensor, rows: torch.Tensor) -> None:
        self.picked = rows > 0
        self.values = torch.where(self.picked, values, torch.zeros_like(values))
        self.rows = rows
        self.count = rows.sum()

    def mean(self) -> torch.Tensor:
        return self.values.sum() / self.count

    def std(self) -> torch.Tensor:
        centered = torch.where(self.picked, self.values - self.mean(), torch.zeros_like(self.values))
        variance = (centered * centered).sum() / (self.count - 1.0).clamp_min(1.0)
        return torch.where(self.count > 1, variance.sqrt(), torch.zeros_like(variance))

    def extreme(self, largest: bool) -> torch.Tensor:
        return _valid_extreme(self.values, self.picked, largest)

    def fraction(self, condition: torch.Tensor) -> torch.Tensor:
        return (condition & self.picked).to(self.rows.dtype).sum() / self.count


def is_metrics(
    weights: torch.Tensor, raw: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor, level: str,
    bounds: ISBounds,
) -> Metrics:  # fmt: skip
    """``rollout_is_*`` of the bounded weights (before batch normalisation) and the raw ones (``raw``, 0 at padding);
    ``log_ratio`` feeds the sequence level's max / min / fractions (the rows' unclamped sums). ``mask`` must hold a
    real token (the caller checks)."""
    valid = mask.bool()
    upper = bounds.upper
    lower = bounds.lower if bounds.lower is not None else 1.0 / upper
    out: Metrics = {"rollout_is_mean": masked_mean(weights, mask)}
    if level == "sequence":
        sums = masked_sum(log_ratio.double(), mask, dim=-1)  # exp in double, as verl's math.exp of a float
        out["rollout_is_max"] = torch.exp(sums.max().clamp(max=20.0))
        out["rollout_is_min"] = torch.exp(sums.min())
        out["rollout_is_ratio_fraction_high"] = (sums > math.log(upper)).double().mean()
        out["rollout_is_ratio_fraction_low"] = (sums < math.log(lower)).double().mean()
    else:
        out["rollout_is_max"] = _valid_extreme(weights, valid, largest=True)
        out["rollout_is_min"] = _valid_extreme(weights, valid, largest=False)
        out["rollout_is_ratio_fraction_high"] = masked_mean((raw > upper).to(weights.dtype), mask)
        out["rollout_is_ratio_fraction_low"] = masked_mean((raw < lower).to(weights.dtype), mask)
    out["rollout_is_std"] = _clamped_std(weights, mask, 0.0, upper)
    out["rollout_is_eff_sample_size"] = _effective_sample_size(weights.clamp(0.0, upper), mask)
    row_means = _Rows(masked_mean(weights, mask, dim=-1), torch.ones_like(weights[:, 0]))  # every row
    out.update(
        rollout_is_seq_mean=row_means.mean(),
        rollout_is_seq_std=row_means.std(),
        rollout_is_seq_max=row_means.extreme(largest=True),
        rollout_is_seq_min=row_means.extreme(largest=False),
        rollout_is_seq_max_deviation=(row_means.values - 1.0).abs().amax(),
    )
    raw_means = masked_mean(raw, mask, dim=-1)
    out["rollout_is_seq_fraction_high"] = (raw_means > upper).to(weights.dtype).mean()
    out["rollout_is_seq_fraction_low"] = (raw_means < lower).to(weights.dtype).mean()
    if bounds.lower is not None:
        outside = (raw < bounds.lower) | (raw > upper)
        out["rollout_is_oob_ratio"] = masked_mean(outside.to(weights.dtype), mask)
    return out


def _effective_sample_size(weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``1 / mean((w / mean w)^2)`` over real tokens (0 when every weight is 0), as ``mean(w^2) / (mean w)^2``: one
    pass over the batch instead of two (verl's order; the same value in float64)."""
    mean = masked_mean(weights, mask)
    second = masked_mean(weights * weights, mask) / (mean + EPS) ** 2
    return torch.where(second > 0, 1.0 / second, torch.zeros_like(second))


def rs_option_metrics(stat: torch.Tensor, keep: torch.Tensor, mask: torch.Tensor, bounds: RSBounds) -> Metrics:
    """``rollout_rs_<option>_*`` of one option: its statistic ``stat`` (``[B, T]`` for token options, ``[B, 1]`` for
    sequence ones) and the tokens it keeps. ``mask`` must hold a real token (the caller checks)."""
    k1 = bounds.lower is not None
    high = math.log(bounds.upper) if k1 else bounds.upper
    low = math.log(bounds.lower) if bounds.lower is not None else 0.0
    sequence = bounds.option.startswith("seq_")
    per_token = stat.expand_as(mask).float()
    valid = mask.bool()
    rows = valid.any(dim=-1).float()  # the per-row statistics run over rows with a real token
    row_values = _Rows(stat[:, 0].double() if sequence else masked_mean(per_token, mask, dim=-1), rows)
    name = f"rollout_rs_{bounds.option}_"
    zero = per_token.new_zeros(())
    out: Metrics = {f"{name}mean": masked_mean(per_token, mask)}
    if sequence:
        out[f"{name}max"], out[f"{name}min"] = row_values.extreme(largest=True), row_values.extreme(largest=False)
        out[f"{name}fraction_high"] = row_values.fraction(row_values.values > high)
        out[f"{name}fraction_low"] = row_values.fraction(row_values.values < low) if k1 else zero
    else:
        out[f"{name}max"] = _valid_extreme(per_token, valid, largest=True)
        out[f"{name}min"] = _valid_extreme(per_token, valid, largest=False)
        out[f"{name}fraction_high"] = masked_mean((per_token > high).float(), mask)
        out[f"{name}fraction_low"] = masked_mean((per_token < low).float(), mask) if k1 else zero
    out[f"{name}std"] = _clamped_std(per_token, mask, low if k1 else 0.0, high)
    out.update({
        f"{name}seq_mean": row_values.mean(), f"{name}seq_std": row_values.std(),
        f"{name}seq_max": row_values.extreme(largest=True), f"{name}seq_min": row_values.extreme(largest=False),
        f"{name}seq_max_deviation": _valid_extreme(row_values.values.abs(), row_values.picked, largest=True),
        f"{name}seq_fraction_high": row_values.fraction(row_values.values > high),
    })  # fmt: skip
    if k1:
        out[f"{name}seq_fraction_low"] = row_values.fraction(row_values.values < low)
    rejected = valid & ~keep
    out[f"{name}masked_fraction"] = masked_mean(rejected.float(), mask)
    out[f"{name}seq_masked_fraction"] = row_values.fraction(rejected.any(dim=-1))
    return out


def rs_overall_metrics(keep: torch.Tensor, mask: torch.Tensor) -> Metrics:
    """``rollout_rs_masked_fraction`` (token-weighted) and ``rollout_rs_seq_masked_fraction`` (over every row)."""
    rejected = mask.bool() & ~keep
    return {
        "rollout_rs_masked_fraction": masked_mean(rejected.float(), mask),
        "rollout_rs_seq_masked_fraction": rejected.any(dim=-1).float().mean(),
    }
