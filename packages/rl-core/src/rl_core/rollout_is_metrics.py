"""Diagnostics for rollout importance sampling: training / rollout mismatch and IS-ratio statistics.

Follows verl's rollout-IS PR (``verl/trainer/ppo/mismatch_helper.py``) and the blog post "When Speed Kills
Stability: Demystifying RL Collapse from the Inference-Training Mismatch" (Liu, Li et al., 2025,
https://yingru.notion.site/When-Speed-Kills-Stability-271211a558b7808d8b12d403fd15edda).

Everything works on ``[batch, response_length]`` tensors with vectorised reductions. Masks and indicators are
float 0/1 tensors (bool kernels, ``torch.where`` and boolean indexing are several times slower on CPU), per-row
partial sums are stacked so each family of metrics finishes in a handful of tiny ops, and all values are gathered
into Python floats with one ``tolist()`` (:func:`to_floats`). Masked-out positions never matter, even when they
hold NaN / Inf. A sequence with a non-finite log-prob gap at a valid token is left out of every statistic (the
caller vetoes it and counts it as catastrophic). Empty populations give 0, never NaN.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# |log ratio| is clamped to this before exp: exp(20) ~ 4.85e8 cannot overflow fp32 / bf16 (verl's SAFETY_BOUND).
SAFETY_BOUND = 20.0
# Per-sequence log-perplexities are clamped to this before exp, so one garbage row cannot overflow a batch mean.
MAX_LOG_PPL = 50.0
# Percentiles come from at most this many tokens (an evenly strided sample beyond it): sorting every token would
# cost more than the whole IS step, and torch.quantile refuses inputs above 16M elements.
QUANTILE_MAX_SAMPLES = 4096
PERCENTILES = (25, 50, 75, 95, 99)
# A NaN / +-Inf log ratio at a valid token is stored as this huge negative, yet finite (so sums stay finite) gap:
# the veto reads it as a ratio ~0, and its sequence drops out of every statistic. Finite gaps are clamped to
# +-1e30 first, so a gap below NON_FINITE_CUTOFF is treated as non-finite too.
NON_FINITE_GAP = -1e30
NON_FINITE_CUTOFF = NON_FINITE_GAP / 2

Metrics = dict[str, torch.Tensor]


def as_float(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool tensor as 0/1 ``dtype``; through a uint8 view, several times faster than from bool on CPU."""
    return mask.view(torch.uint8).to(dtype)


def float_mask(response_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``response_mask != 0`` as a 0/1 tensor of ``dtype``."""
    return as_float(response_mask if response_mask.dtype == torch.bool else response_mask != 0, dtype)


def indicator(values: torch.Tensor, cutoff: float, above: bool) -> torch.Tensor:
    """Float 0/1: ``values > cutoff`` (``above``) or ``values < cutoff``; sign arithmetic beats bool compares."""
    diff = values - cutoff if above else cutoff - values
    return diff.sign_().clamp_(min=0.0)


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """Float dtype for the math: the inputs' promoted dtype, at least float32 (bf16 log-probs lose too much)."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


class LogGaps(NamedTuple):
    """Per-token log ratios of one batch, cleaned once and shared by IS levels, bounding modes and metrics."""

    log_ratio: torch.Tensor  # [B, T] old - rollout; 0 at padding, NON_FINITE_GAP where not finite at a valid token
    valid: torch.Tensor  # [B, T] float 0/1, response_mask != 0
    valid_count: torch.Tensor  # [B, 1] valid tokens per sequence (float)
    row_min: torch.Tensor  # [B, 1] smallest log ratio of the sequence (at most 0 when it has padding)
    row_sum: torch.Tensor  # [B, 1] sum of log_ratio over the sequence

    @property
    def row_ok(self) -> torch.Tensor:
        """[B, 1] bool: no valid token of the sequence has a non-finite log ratio."""
        return self.row_min > NON_FINITE_CUTOFF

    @property
    def row_in(self) -> torch.Tensor:
        """[B, 1] float 0/1: the sequence enters the statistics (has a valid token, no non-finite gap)."""
        return as_float(self.row_ok & (self.valid_count > 0), self.log_ratio.dtype)


def log_gaps(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor) -> LogGaps:
    """Clean log ratios ``old - rollout`` (``[B, T]``): 0 at padding, ``NON_FINITE_GAP`` where not finite."""
    dtype = compute_dtype(old_log_prob, rollout_log_prob)
    valid = float_mask(response_mask, dtype)
    raw = old_log_prob.to(dtype) - rollout_log_prob.to(dtype)  # a fresh tensor: cleaned in place
    big = NON_FINITE_GAP
    log_ratio = raw.nan_to_num_(nan=big, posinf=big, neginf=big).clamp_(big, -big).mul_(valid)
    return LogGaps(
        log_ratio=log_ratio,
        valid=valid,
        valid_count=valid.sum(-1, keepdim=True),
        row_min=log_ratio.amin(-1, keepdim=True),
        row_sum=log_ratio.sum(-1, keepdim=True),
    )


def ratio_minus_one(log_ratio: torch.Tensor) -> torch.Tensor:
    """``ratio - 1`` from a log ratio clamped to +-SAFETY_BOUND. ``expm1``, not ``exp - 1``: with |log r| ~ 1e-3,
    exp's rounding (~6e-8 per token) would be a tenth of the k3 term ``r - 1 - log r`` it feeds."""
    return log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND).expm1_()


def masked_row_sum(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[B, 1]`` sums of ``values`` over the 0/1 float mask ``valid``; non-finite values outside it are ignored."""
    cleaned = values.to(valid.dtype).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    return cleaned.mul_(valid).sum(-1, keepdim=True)


def non_finite_count(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[B, 1]`` number of NaN / +-Inf entries of ``values`` where the 0/1 float mask ``valid`` is 1."""
    values = values.to(valid.dtype)
    # values - values is 0 when finite and NaN otherwise; made 0/1 before the mask, since NaN * 0 is NaN.
    return (values - values).nan_to_num_(nan=1.0).mul_(valid).sum(-1, keepdim=True)


def _named(names: tuple[str, ...] | list[str], values: torch.Tensor) -> Metrics:
    return dict(zip(names, values.unbind(), strict=True))


def _masked_min_max(values: torch.Tensor, pop: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """``[min, max]`` of ``values`` over the 0/1 float population ``pop``; ``fill`` must lie inside that range.

    ``lerp(fill, values, pop)`` is exactly ``values`` where pop = 1 and ``fill`` elsewhere, so one fused pass and
    one ``aminmax`` replace two masked ``where`` + reduction pairs.
    """
    return torch.stack(torch.aminmax(torch.lerp(fill.expand_as(values), values, pop)))


def training_ppl_tensors(old_row_sum: torch.Tensor, count: torch.Tensor, row_in: torch.Tensor) -> Metrics:
    """Training-side perplexity from per-sequence sums of ``old_log_prob`` and token counts (``[B, 1]`` each).

    ppl of a sequence = exp(-mean token log-prob); the batch value is the mean over sequences in ``row_in``.
    """
    log_ppl = (-old_row_sum / count.clamp(min=1)).squeeze(-1)
    rows = torch.stack([log_ppl.clamp(-MAX_LOG_PPL, MAX_LOG_PPL).exp(), log_ppl], -1)  # [B, 2]
    row_in = row_in.squeeze(-1)
    means = torch.where(row_in[:, None] > 0, rows, 0.0).sum(0) / row_in.sum().clamp(min=1)
    return _named(("mismatch_training_ppl", "mismatch_training_log_ppl"), means)


MISMATCH_ROW_METRICS = (
    "mismatch_training_ppl",
    "mismatch_rollout_ppl",
    "mismatch_ppl_ratio",
    "mismatch_training_log_ppl",
    "mismatch_rollout_log_ppl",
    "mismatch_log_ppl_diff",
    "mismatch_log_ppl_abs_diff",
)


def mismatch_tensors(old_log_prob: torch.Tensor, gaps: LogGaps, expm1_row_sum: torch.Tensor) -> Metrics:
    """The eleven ``mismatch_*`` metrics of the verl PR as 0-dim tensors (unprefixed names).

    ``expm1_row_sum`` is ``ratio_minus_one(gaps.log_ratio).sum(-1)`` ``[B]``, shared with the IS statistics.
    KL(rollout || training) is estimated on rollout samples: k1 = mean(-log r), k3 = mean(r - 1 - log r),
    r = pi_train / pi_rollout per token (J. Schulman, "Approximating KL Divergence", 2020). Per sequence,
    log-ppl diff = mean rollout log-prob - mean training log-prob = log(training ppl / rollout ppl); ppl metrics
    are means over sequences of per-sequence values.
    """
    row_in = gaps.row_in.squeeze(-1)  # [B]
    count = gaps.valid_count.squeeze(-1).clamp(min=1)
    train = masked_row_sum(old_log_prob, gaps.valid).squeeze(-1) / count  # mean training log-prob
    diff = -gaps.row_sum.squeeze(-1) / count  # mean rollout log-prob - mean training log-prob
    rollout = train + diff
    log_ppl = torch.stack([-train, -rollout, diff], -1)  # [B, 3]: training, rollout, log(training / rollout ppl)
    rows = torch.cat([log_ppl.clamp(-MAX_LOG_PPL, MAX_LOG_PPL).exp(), log_ppl, diff.abs()[:, None]], -1)  # [B, 7]
    rows = torch.where(row_in[:, None] > 0, rows, 0.0)  # rows left out may hold huge values: select, not multiply
    n_seq = row_in.sum()
    k1_k3 = torch.stack([-gaps.row_sum.squeeze(-1), expm1_row_sum - gaps.row_sum.squeeze(-1)], -1)  # [B, 2]
    token_sums = (k1_k3 * row_in[:, None]).sum(0) / (gaps.valid_count.squeeze(-1) * row_in).sum().clamp(min=1)
    seq_mean_diff = rows[:, MISMATCH_ROW_METRICS.index("mismatch_log_ppl_diff")].sum() / n_seq.clamp(min=1)
    lo_hi = torch.where(n_seq > 0, _masked_min_max(diff, row_in, seq_mean_diff), 0.0)
    out = _named(MISMATCH_ROW_METRICS, rows.sum(0) / n_seq.clamp(min=1))
    out.update(_named(("mismatch_kl", "mismatch_k3_kl"), token_sums))
    out.update(_named(("mismatch_log_ppl_diff_min", "mismatch_log_ppl_diff_max"), lo_hi))
    return out


class Units(NamedTuple):
    """IS units (tokens ``[B, T]`` or sequences ``[B, 1]``) and the statistics population over them."""

    expm1: torch.Tensor  # ratio - 1 per unit, from the log ratio clamped to +-SAFETY_BOUND; 0 at padding
    expm1_row_sum: torch.Tensor  # [B] expm1 summed over each row of units
    pop: torch.Tensor  # float 0/1: the unit has a valid token (padding tokens / empty sequences are out)
    stat: torch.Tensor  # float 0/1: pop, and the unit's sequence has no non-finite gap (enters the statistics)
    row_weight: torch.Tensor  # [B] tokens each unit of a row stands for (1, or a sequence's valid count) * row_in


def _quantile_stride(numel: int) -> int:
    """Stride of the percentile sample; odd, so with power-of-two lengths the sample still visits every column."""
    stride = -(-numel // QUANTILE_MAX_SAMPLES)
    return stride if stride == 1 else stride | 1


def _token_sample(unit: torch.Tensor, length: int, stride: int) -> torch.Tensor:
    """Every ``stride``-th token of ``unit`` broadcast to ``[B, length]``, flattened, without materialising it."""
    flat = unit.reshape(-1)
    if unit.shape[-1] == length:
        return flat[::stride]
    idx = torch.arange(0, unit.shape[0] * length, stride, device=unit.device)
    return flat[idx // length]


def _percentiles(units: Units, valid: torch.Tensor) -> torch.Tensor:
    """``[len(PERCENTILES)]`` token-weighted percentiles of ``ratio - 1`` over the statistics population."""
    length = valid.shape[-1]
    stride = _quantile_stride(valid.numel())
    keep = valid.reshape(-1)[::stride] * _token_sample(units.stat, length, stride)
    if keep.numel() == 0:
        return keep.new_zeros(len(PERCENTILES))
    sample = _token_sample(units.expm1, length, stride).masked_fill(keep == 0, float("nan"))
    qs = torch.tensor([p / 100 for p in PERCENTILES], dtype=sample.dtype, device=sample.device)
    return torch.nanquantile(sample, qs).nan_to_num_(nan=0.0)  # all-NaN (empty population) -> 0


RATIO_METRICS = (
    "rollout_is_mean",
    "rollout_is_min",
    "rollout_is_max",
    "rollout_is_seq_mean",
    "rollout_is_seq_min",
    "rollout_is_seq_max",
    *(f"rollout_is_p{p}" for p in PERCENTILES),
    "rollout_is_std",
    "rollout_is_seq_std",
)


def ratio_tensors(units: Units, gaps: LogGaps) -> Metrics:
    """Statistics of the IS ratio before bounding, over valid tokens (a sequence ratio counts once per token).

    Mean / std / min / max / percentiles are token-weighted; ``rollout_is_seq_*`` use each sequence's mean
    ratio over its tokens (its ratio, at the sequence levels). Stds are Bessel-corrected. Sequences with a
    non-finite gap are left out.
    """
    em1 = units.expm1
    row_in = gaps.row_in.squeeze(-1)
    row_n = gaps.valid_count.squeeze(-1) * row_in  # [B] population tokens per sequence
    row_s1 = units.expm1_row_sum * units.row_weight  # padding units carry expm1 = 0
    seq_em1 = row_s1 / row_n.clamp(min=1)  # each sequence's mean ratio - 1
    row_s2 = torch.linalg.vector_norm(em1, dim=-1).square() * units.row_weight
    # Moments of (ratio - 1): shifting by the ideal ratio 1 avoids cancellation in fp32.
    n, s1, s2, n_seq, q1, q2 = torch.stack(
        [row_n, row_s1, row_s2, row_in, seq_em1 * row_in, seq_em1.square() * row_in]
    ).sum(-1)
    mean, seq_mean = s1 / n.clamp(min=1), q1 / n_seq.clamp(min=1)
    var = (s2 - s1 * mean) / (n - 1).clamp(min=1)
    seq_var = (q2 - q1 * seq_mean) / (n_seq - 1).clamp(min=1)
    shifted = torch.cat(
        [
            torch.stack([mean]),
            _masked_min_max(em1, units.stat, mean),
            torch.stack([seq_mean]),
            _masked_min_max(seq_em1, row_in, seq_mean),
            _percentiles(units, gaps.valid),
        ]
    )
    values = torch.cat([shifted + 1.0, torch.stack([var, seq_var]).clamp(min=0).sqrt()])
    return _named(RATIO_METRICS, torch.where(n > 0, values, 0.0))


def bound_fractions(
    above: torch.Tensor, below: torch.Tensor, units: Units, gaps: LogGaps, affected: str, bounds_lower: bool
) -> Metrics:
    """Fractions of valid tokens whose ratio lies above / below the bounds, and of those the mode changed.

    ``above`` / ``below`` are float 0/1 per unit (never set at padding, whose log ratio 0 lies inside the bounds).
    ``affected`` names the mode's effect: ``rollout_is_<affected>_fraction`` counts tokens,
    ``rollout_is_seq_<affected>_fraction`` sequences with at least one affected token.
    """
    high = above.sum(-1) * units.row_weight  # [B] population tokens above the upper bound
    low = below.sum(-1) * units.row_weight
    changed = high + low if bounds_lower else high
    has_tokens = as_float(gaps.valid_count.squeeze(-1) > 0, high.dtype)
    rows = torch.stack([high, low, changed, changed.clamp(max=1), has_tokens])  # [5, B]
    n_high, n_low, n_changed, n_seq_changed, n_seqs = rows.sum(-1)
    n_tokens = gaps.valid_count.sum().clamp(min=1)
    fractions = torch.stack([n_high, n_low, n_changed]) / n_tokens
    names = ("rollout_is_ratio_fraction_high", "rollout_is_ratio_fraction_low", f"rollout_is_{affected}_fraction")
    out = _named(names, fractions)
    out[f"rollout_is_seq_{affected}_fraction"] = n_seq_changed / n_seqs.clamp(min=1)
    return out


def effective_sample_size(weights_unit: torch.Tensor, n_units: torch.Tensor) -> torch.Tensor:
    """Normalised ESS = (sum w)^2 / (n * sum w^2) = (mean w)^2 / mean(w^2), in [0, 1] (Kong, 1992).

    ``weights_unit`` holds the applied weights of the ``n_units`` units (the returned weights times the returned
    mask): 0 for rejected / vetoed units and outside the population, so every dropped sample lowers the ESS. 0 when
    all weights are 0.
    """
    flat = weights_unit.reshape(-1)
    s1 = flat.sum()
    s2 = torch.dot(flat, flat)
    return torch.where(s2 > 0, s1 * s1 / (n_units * s2).clamp(min=torch.finfo(s2.dtype).tiny), 0.0)


def stacked(named: Metrics) -> tuple[tuple[str, ...], torch.Tensor]:
    """The names and one float64 vector of the 0-dim metric tensors. Inside a compiled graph the stack is part of
    the graph's own kernels; eagerly on a GPU it costs one copy per metric (measured: 30-odd copies, ~1.2 ms of a
    1.7 ms correction on an H200)."""
    return tuple(named), torch.stack([value.to(torch.float64) for value in named.values()])


def named_floats(names: tuple[str, ...], values: torch.Tensor, prefix: str = "") -> dict[str, float]:
    """``(names, vector)`` from :func:`stacked` -> Python floats with one device sync (``tolist``)."""
    return {f"{prefix}{k}": float(v) for k, v in zip(names, values.tolist(), strict=True)}


def to_floats(named: Metrics, prefix: str = "") -> dict[str, float]:
    """0-dim tensors -> Python floats with one device sync (a single stack + ``tolist``)."""
    if not named:
        return {}
    return named_floats(*stacked(named), prefix=prefix)
