"""ROLL's train-infer correction (its ``train_infer_correction`` config): importance weights and filters from the
gap between the training engine's log-probs of the sampled tokens (``old``) and the inference engine's (``infer``).

Both are measured at one of four granularities, each broadcast back over the tokens it covers:

- ``token``: ``ratio = exp(old - infer)``, ``diff = exp(old) - exp(infer)`` per token;
- ``geometric``: per sequence, ``exp(mean(old - infer))`` and the mean of the token diffs;
- ``sequence``: per sequence, ``exp(sum(old - infer))`` and the sum of the token diffs;
- ``segment``: per run of consecutive response tokens (one assistant turn of a multi-turn sample), the mean log
  ratio's ``exp`` and the mean diff.

The IS weight (``is_weight``) is the ratio at its granularity, clamped to ``[0, upper_bound]``, multiplied into each
token's policy loss; disabled, every weight is 1. Each enabled filter keeps the tokens whose ratio (and / or diff)
at its granularity lies within its bounds; the filters multiply into the loss mask in turn. The metrics are ROLL's
names (``actor/train_infer_*``), always reported for all four granularities, whether or not anything is applied.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rl_core.masked import masked_mean, masked_sum, segment_mean

GRANULARITIES = ("token", "geometric", "sequence", "segment")
"""Where a ratio / diff is measured (ROLL's ``weight_type`` / ``agg_type``)."""


@dataclass
class TrainInferISWeightConfig:
    """ROLL's ``train_infer_correction.is_weight``."""

    enabled: bool = False
    """Multiply each token's policy loss by the weight (off: weight 1)."""
    weight_type: str = "token"
    """The granularity of the ratio the weight is: token, geometric, sequence or segment."""
    upper_bound: float | None = 1.2
    """Clamp the weight to at most this (null: no clamp)."""
    detach: bool = True
    """No gradient through the weight (the log-probs it is made of carry none here either)."""


@dataclass
class TrainInferFilterConfig:
    """One rule of ROLL's ``train_infer_correction.filters``: tokens outside the bounds leave the loss mask."""

    enabled: bool = False
    agg_type: str = "token"
    """The granularity of the ratio / diff the rule reads."""
    ratio_enabled: bool = True
    ratio_low: float = 0.8
    ratio_high: float = 1.2
    diff_enabled: bool = False
    diff_low: float = -0.2
    diff_high: float = 0.2


@dataclass
class TrainInferCorrectionConfig:
    """ROLL's ``train_infer_correction``: the IS weight and the filters, applied in order."""

    is_weight: TrainInferISWeightConfig = field(default_factory=TrainInferISWeightConfig)
    filters: list[TrainInferFilterConfig] = field(default_factory=list)

    @property
    def acts(self) -> bool:
        """Whether it changes training (an IS weight or an enabled filter); otherwise only metrics are reported."""
        return self.is_weight.enabled or any(rule.enabled for rule in self.filters)

    def validate(self, prefix: str = "train_infer_correction") -> None:
        """Raise ``ValueError`` naming ``<prefix>.<key>`` for the first bad value."""
        if self.is_weight.weight_type not in GRANULARITIES:
            raise ValueError(f"{prefix}.is_weight.weight_type={self.is_weight.weight_type!r}; use one of "
                             f"{list(GRANULARITIES)}.")  # fmt: skip
        bound = self.is_weight.upper_bound
        if bound is not None and not bound > 0:
            raise ValueError(f"{prefix}.is_weight.upper_bound={bound}: give a positive number or null.")
        for index, rule in enumerate(self.filters):
            where = f"{prefix}.filters[{index}]"
            if rule.agg_type not in GRANULARITIES:
                raise ValueError(f"{where}.agg_type={rule.agg_type!r}; use one of {list(GRANULARITIES)}.")
            for kind in ("ratio", "diff"):
                low, high = getattr(rule, f"{kind}_low"), getattr(rule, f"{kind}_high")
                if getattr(rule, f"{kind}_enabled") and low > high:
                    raise ValueError(f"{where}.{kind}_low={low} exceeds {where}.{kind}_high={high}: no token passes.")


def gaps(
    old_log_probs: torch.Tensor, infer_log_probs: torch.Tensor, mask: torch.Tensor
) -> dict[str, dict[str, torch.Tensor]]:
    """``{"ratio": {granularity: [B, T]}, "diff": {...}}`` (see the module docstring); masked-out positions never
    reach a value (ratio 1 and diff 0 there at token level)."""
    m = mask.to(torch.bool)
    zero = torch.zeros((), dtype=old_log_probs.dtype, device=old_log_probs.device)
    log_ratio = torch.where(m, old_log_probs - infer_log_probs, zero)
    diff = torch.where(m, old_log_probs.exp() - infer_log_probs.exp(), zero)

    def per_row(values: torch.Tensor) -> torch.Tensor:
        return values.unsqueeze(-1).expand_as(log_ratio)

    ratios = {"token": log_ratio.exp(), "geometric": per_row(masked_mean(log_ratio, m, dim=-1).exp()),
              "sequence": per_row(masked_sum(log_ratio, m, dim=-1).exp()),
              "segment": segment_mean(log_ratio, m).exp()}  # fmt: skip
    diffs = {"token": diff, "geometric": per_row(masked_mean(diff, m, dim=-1)),
             "sequence": per_row(masked_sum(diff, m, dim=-1)), "segment": segment_mean(diff, m)}  # fmt: skip
    return {"ratio": ratios, "diff": diffs}


def _sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean over the sequences with a token of each one's token mean (ROLL's seq-mean-token-mean)."""
    rows = mask.to(torch.bool).any(dim=-1)
    return float(masked_mean(values, mask, dim=-1)[rows].sum() / rows.sum().clamp(min=1))


def compute_train_infer_correction(
    config: TrainInferCorrectionConfig, mask: torch.Tensor, old_log_probs: torch.Tensor,
    infer_log_probs: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:  # fmt: skip
    """``(is_weight [B, T], filter_mask [B, T] 0/1, metrics)`` of one batch (``mask``: the response tokens in the
    loss). The weight is 1 where the IS weight is disabled; ``filter_mask`` is 1 where no enabled rule rejects."""
    stats = gaps(old_log_probs, infer_log_probs, mask)
    ratio, diff = stats["ratio"], stats["diff"]
    metrics: dict[str, float] = {}
    for level in GRANULARITIES:
        metrics[f"actor/train_infer_ratio_{level}_mean@sum"] = _sequence_mean(ratio[level], mask)
        metrics[f"actor/train_infer_diff_{level}_mean@sum"] = _sequence_mean(diff[level], mask)
    weight = torch.ones_like(ratio["token"])
    settings = config.is_weight
    if settings.enabled:
        weight = ratio[settings.weight_type]
        if settings.upper_bound is not None:
            metrics["actor/is_weight_clipfrac@sum"] = float(masked_mean((weight > settings.upper_bound).float(), mask))
            weight = weight.clamp(min=0.0, max=settings.upper_bound)
        weight = weight.detach() if settings.detach else weight
    keep = torch.ones_like(ratio["token"])
    for rule in config.filters:
        if not rule.enabled:
            continue
        for kind, values in (("ratio", ratio[rule.agg_type]), ("diff", diff[rule.agg_type])):
            if getattr(rule, f"{kind}_enabled"):
                passed = ((values >= getattr(rule, f"{kind}_low")) & (values <= getattr(rule, f"{kind}_high"))).float()
                metrics[f"actor/train_infer_{rule.agg_type}_{kind}_mask_mean@sum"] = float(masked_mean(passed, mask))
                keep = keep * passed
    if config.filters:
        metrics["actor/train_infer_final_mask_mean"] = float(masked_mean(keep, mask))
    return weight, keep, metrics
