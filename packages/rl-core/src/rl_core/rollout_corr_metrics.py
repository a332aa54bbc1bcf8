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

from rl_core.masked import is_set

if TYPE_CHECKING:
    from rl_core.rollout_corr import ISBounds, RSBounds

Metrics = dict[str, torch.Tensor]
"""Metric name -> 0-dim tensor; :func:`rl_core.rollout_corr.rollout_correction` turns them into floats at once."""
EPS = 1e-8
"""verl's ``masked_mean`` denominator guard and batch-normalisation floor."""


def masked_mean(
    values: torch.Tensor, mask: torch.Tensor, dim: int | None = None, counts: torch.Tensor | None = None
) -> torch.Tensor:
    """verl's ``masked_mean``, denominator included: ``masked_sum / (count + 1e-8)`` (an empty row gives 0), where
    :func:`rl_core.masked.masked_mean` divides by ``max(count, 1)``. Accumulated and returned in float64: float32
    sums of a batch's tokens lose digits (gaps of +-1e4 next to 1e-2) in a way that depends on the order of the
    additions, so the eager and the fused path would disagree; float64 makes both the correctly rounded value.
    ``counts``: the rows' real-token counts (:func:`row_counts`) when the caller has them: one sum of the mask
    for every mean of a correction instead of one each."""
    if counts is None:
        counts = row_counts(mask)
    if dim is None:  # rows first: the compiled path then reads the batch once for all of a row's sums
        return row_sums(values, mask).sum() / (counts.sum() + EPS)
    if dim not in (-1, mask.dim() - 1):
        raise ValueError(f"masked_mean over dim={dim}: only the last dimension (a row's tokens) is supported.")
    return row_sums(values, mask) / (counts + EPS)


def row_counts(mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` float64: each row's number of real tokens (counted as :func:`row_sums` counts a bool)."""
    return is_set(mask).to(torch.float32).sum(-1).double()


def row_sums(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` float64 sums of each row's real tokens. The padding is zeroed in the values' own dtype and only then
    widened: the same sums, but the compiled CPU loop selects one float32 vector instead of two float64 ones. Bool
    ``values`` (a condition to count) are summed as float32 ones, exactly (a row holds far fewer than 2^24 tokens),
    and widened after the sum."""
    picked = is_set(mask)
    if values.dtype == torch.bool:
        return (picked & values).to(torch.float32).sum(-1).double()
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    return torch.where(picked, values, zero).double().sum(-1)


def zero_padded_row_sums(values: torch.Tensor) -> torch.Tensor:
    """:func:`row_sums` of values that are already 0 at padding (the IS weights, raw and bounded): the same sums
    without selecting the real tokens first, one select per token less in the compiled row loop (three of them make
    the fused correction 5-7 % faster at 128 x 4096 on CPU)."""
    return values.double().sum(-1)


def _valid_extreme(values: torch.Tensor, valid: torch.Tensor, largest: bool) -> torch.Tensor:
    """Max (``largest``) or min of ``values`` where the bool ``valid`` holds (NaN there propagates)."""
    if largest:  # rows first, as in masked_mean
        return values.masked_fill(~valid, -math.inf).amax(-1).amax()
    return values.masked_fill(~valid, math.inf).amin(-1).amin()


def _token_std(values: torch.Tensor, mask: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Population std over real tokens (0 with one token or none), as ``sqrt(E[x^2] - E[x]^2)`` like verl, from
    float64 sums (:func:`_moment_std`)."""
    values = values.double()
    return _moment_std(row_sums(values, mask).sum(), row_sums(values * values, mask).sum(), counts.sum())


def _moment_std(total: torch.Tensor, total_sq: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Population std from the sum, the sum of squares and the count of the values (float64), the means divided by
    the count itself: verl's float32 ``count + 1e-8`` is the count, so values without spread have std 0 there, where
    float64's ``count + 1e-8`` would leave ``|x| sqrt(1e-8 / count)`` (1e-6 at 10^4 tokens). 0 with one value or
    none."""
    safe = count.clamp_min(1.0)
    return _population_std(total_sq / safe - (total / safe) ** 2, count)


def _population_std(variance: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
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
    bounds: ISBounds, counts: torch.Tensor,
) -> Metrics:  # fmt: skip
    """``rollout_is_*`` of the bounded weights (before batch normalisation) and the raw ones (``raw``), both 0 at
    padding (their rows are summed without a select: :func:`zero_padded_row_sums`); ``log_ratio`` feeds the
    sequence level's max / min / fractions (the rows' unclamped sums). ``mask`` must hold a real token (the caller
    checks); ``counts``: its rows' token counts (:func:`row_counts`).

    verl clamps the weights to ``[0, upper]`` for their std and effective sample size; bounded weights already lie
    there (TIS truncates at ``upper``, IcePop keeps ``[lower, upper]`` or 0; NaN stays NaN either way), so their
    first and second moments serve the mean, the std and the effective sample size alike."""
    valid = is_set(mask)
    upper = bounds.upper
    lower = bounds.lower if bounds.lower is not None else 1.0 / upper
    weight_rows = zero_padded_row_sums(weights)
    mean = weight_rows.sum() / (counts.sum() + EPS)
    second_sum = zero_padded_row_sums(weights.double() ** 2).sum()
    second = second_sum / (counts.sum() + EPS)  # verl's masked_mean
    out: Metrics = {"rollout_is_mean": mean}
    if level == "sequence":
        sums = row_sums(log_ratio, mask)  # exp in double, as verl's math.exp of a float
        out["rollout_is_max"] = torch.exp(sums.max().clamp(max=20.0))
        out["rollout_is_min"] = torch.exp(sums.min())
        out["rollout_is_ratio_fraction_high"] = (sums > math.log(upper)).double().mean()
        out["rollout_is_ratio_fraction_low"] = (sums < math.log(lower)).double().mean()
    else:
        out["rollout_is_max"] = _valid_extreme(weights, valid, largest=True)
        out["rollout_is_min"] = _valid_extreme(weights, valid, largest=False)
        out["rollout_is_ratio_fraction_high"] = masked_mean(raw > upper, mask, counts=counts)
        out["rollout_is_ratio_fraction_low"] = masked_mean(raw < lower, mask, counts=counts)
    out["rollout_is_std"] = _moment_std(weight_rows.sum(), second_sum, counts.sum())
    relative = second / (mean + EPS) ** 2  # 1 / ESS: mean((w / mean w)^2), verl's order; 0 when every weight is 0
    out["rollout_is_eff_sample_size"] = torch.where(relative > 0, 1.0 / relative, torch.zeros_like(relative))
    row_means = _Rows(weight_rows / (counts + EPS), torch.ones_like(counts))  # every row
    out.update(
        rollout_is_seq_mean=row_means.mean(),
        rollout_is_seq_std=row_means.std(),
        rollout_is_seq_max=row_means.extreme(largest=True),
        rollout_is_seq_min=row_means.extreme(largest=False),
        rollout_is_seq_max_deviation=(row_means.values - 1.0).abs().amax(),
    )
    raw_means = zero_padded_row_sums(raw) / (counts + EPS)  # masked_mean's row means
    out["rollout_is_seq_fraction_high"] = (raw_means > upper).to(weights.dtype).mean()
    out["rollout_is_seq_fraction_low"] = (raw_means < lower).to(weights.dtype).mean()
    if bounds.lower is not None:
        outside = (raw < bounds.lower) | (raw > upper)
        out["rollout_is_oob_ratio"] = masked_mean(outside, mask, counts=counts)
    return out


def rs_option_metrics(
    stat: torch.Tensor, keep: torch.Tensor, mask: torch.Tensor, bounds: RSBounds, counts: torch.Tensor
) -> Metrics:
    """``rollout_rs_<option>_*`` of one option: its statistic ``stat`` and what it keeps, ``keep`` (both ``[B, T]``
    for token options, ``[B, 1]`` for sequence ones). ``mask`` must hold a real token (the caller checks);
    ``counts``: its rows' token counts. A sequence option's token-weighted statistics weigh each row's value by its
    count (the same sums as over its tokens, without a pass over them)."""
    k1 = bounds.lower is not None
    high = math.log(bounds.upper) if k1 else bounds.upper
    low = math.log(bounds.lower) if bounds.lower is not None else 0.0
    name = f"rollout_rs_{bounds.option}_"
    rows = (counts > 0).to(torch.float32)  # the per-row statistics run over rows with a real token
    per_token = stat.float()  # the token-level statistics compare and clamp in float32, whatever the log-probs' dtype
    if bounds.option.startswith("seq_"):
        row_values = _Rows(stat[:, 0].double(), rows)
        out = _rs_sequence_token_metrics(per_token[:, 0], keep[:, 0], counts, row_values, name, (low, high), k1)
        rejected_rows = ~keep[:, 0]
    else:
        row_values = _Rows(masked_mean(per_token, mask, dim=-1, counts=counts), rows)
        out = _rs_token_metrics(per_token, keep, mask, counts, name, (low, high), k1)
        rejected_rows = row_sums(~keep, mask) > 0
    out.update({
        f"{name}seq_mean": row_values.mean(), f"{name}seq_std": row_values.std(),
        f"{name}seq_max": row_values.extreme(largest=True), f"{name}seq_min": row_values.extreme(largest=False),
        f"{name}seq_max_deviation": _valid_extreme(row_values.values.abs(), row_values.picked, largest=True),
        f"{name}seq_fraction_high": row_values.fraction(row_values.values > high),
    })  # fmt: skip
    if k1:
        out[f"{name}seq_fraction_low"] = row_values.fraction(row_values.values < low)
    out[f"{name}seq_masked_fraction"] = row_values.fraction(rejected_rows)
    return out


def _rs_token_metrics(
    stat: torch.Tensor, keep: torch.Tensor, mask: torch.Tensor, counts: torch.Tensor, name: str,
    bounds: tuple[float, float], k1: bool,
) -> Metrics:  # fmt: skip
    """A token option's token-level statistics: over its real tokens."""
    low, high = bounds
    valid = is_set(mask)
    zero = stat.new_zeros(())
    return {
        f"{name}mean": masked_mean(stat, mask, counts=counts),
        f"{name}max": _valid_extreme(stat, valid, largest=True),
        f"{name}min": _valid_extreme(stat, valid, largest=False),
        f"{name}fraction_high": masked_mean(stat > high, mask, counts=counts),
        f"{name}fraction_low": masked_mean(stat < low, mask, counts=counts) if k1 else zero,
        f"{name}std": _token_std(stat.clamp(low if k1 else 0.0, high), mask, counts),
        f"{name}masked_fraction": masked_mean(~keep, mask, counts=counts),
    }


def _rs_sequence_token_metrics(
    stat: torch.Tensor, keep: torch.Tensor, counts: torch.Tensor, row_values: _Rows, name: str,
    bounds: tuple[float, float], k1: bool,
) -> Metrics:  # fmt: skip
    """A sequence option's token-level statistics from its ``[B]`` row values ``stat`` and ``keep``, each row counted
    once per real token."""
    low, high = bounds
    zero = stat.new_zeros(())
    clamped = stat.clamp(low if k1 else 0.0, high).double()
    total, total_sq = _count_weighted_sum(clamped, counts), _count_weighted_sum(clamped * clamped, counts)
    return {
        f"{name}mean": _count_weighted_mean(stat.double(), counts),
        f"{name}max": row_values.extreme(largest=True),
        f"{name}min": row_values.extreme(largest=False),
        f"{name}fraction_high": row_values.fraction(row_values.values > high),
        f"{name}fraction_low": row_values.fraction(row_values.values < low) if k1 else zero,
        f"{name}std": _moment_std(total, total_sq, counts.sum()),
        f"{name}masked_fraction": _count_weighted_mean((~keep).double(), counts),
    }


def _count_weighted_mean(row_values: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The mean over real tokens of ``[B]`` row values, each on every real token of its row (empty rows left out,
    whatever their value)."""
    return _count_weighted_sum(row_values, counts) / (counts.sum() + EPS)


def _count_weighted_sum(row_values: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The sum over real tokens of ``[B]`` row values, each on every real token of its row (empty rows left out)."""
    return torch.where(counts > 0, row_values * counts, torch.zeros_like(row_values)).sum()


def rs_overall_metrics(keep: torch.Tensor, mask: torch.Tensor, counts: torch.Tensor) -> Metrics:
    """``rollout_rs_masked_fraction`` (token-weighted) and ``rollout_rs_seq_masked_fraction`` (over every row);
    ``keep`` is ``[B, T]``, or ``[B, 1]`` when every option is a sequence one."""
    if keep.shape[-1] == 1 and keep.shape != mask.shape:
        rejected_rows = ~keep[:, 0] & (counts > 0)
        return {
            "rollout_rs_masked_fraction": _count_weighted_mean((~keep[:, 0]).double(), counts),
            "rollout_rs_seq_masked_fraction": rejected_rows.double().mean(),
        }
    rejected = row_sums(~keep, mask)  # each row's rejected real tokens
    return {
        "rollout_rs_masked_fraction": rejected.sum() / (counts.sum() + EPS),
        "rollout_rs_seq_masked_fraction": (rejected > 0).double().mean(),
    }
