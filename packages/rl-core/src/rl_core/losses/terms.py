"""The other loss terms: clipped value loss (critic), entropy, SFT, KL loss, and their weighted total."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl_core.kl import kl_penalty
from rl_core.losses.aggregation import GlobalBatchInfo, agg_loss
from rl_core.masked import is_set, masked_mean


def compute_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    value_clip: float | None = 0.5,
    loss_agg_mode: str = "token-mean",
    global_batch: GlobalBatchInfo | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO critic loss ``0.5 * max((V - R)^2, (clip(V, V_old +- value_clip) - R)^2)`` (Schulman et al. 2017).

    Shapes ``[B, T]``. ``value_clip=None`` (ROLL ``value_clip: ~``) gives the plain squared error.
    Metrics: vf_clipfrac (share of tokens where the clipped branch was larger).
    """
    mask = is_set(response_mask)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    values = torch.where(mask, values, zero)
    old_values = torch.where(mask, old_values.detach(), zero)
    returns = torch.where(mask, returns.detach().to(values.dtype), zero)
    unclipped = (values - returns).square()
    if value_clip is None:
        losses, clipped = unclipped, torch.zeros_like(mask)
    else:
        values_clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
        clipped_sq = (values_clipped - returns).square()
        losses, clipped = torch.maximum(unclipped, clipped_sq), clipped_sq > unclipped
    loss = 0.5 * agg_loss(losses, mask, loss_agg_mode, global_batch=global_batch)
    return loss, {"vf_clipfrac": masked_mean(clipped.to(values.dtype), mask)}


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax at each position: ``logsumexp(z) - sum softmax(z) * z``. ``[B, T, V] -> [B, T]``.

    Computed in float32 at least, without materialising log-softmax separately.
    """
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    probs = torch.softmax(z, dim=-1)
    return torch.logsumexp(z, dim=-1) - (probs * z).sum(dim=-1)


def compute_sft_loss(
    log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    global_batch: GlobalBatchInfo | None = None,
) -> torch.Tensor:
    """Negative log-likelihood of the given tokens ``[B, T]`` (ROLL ``sft_loss_coef`` term)."""
    return agg_loss(-log_prob, response_mask, loss_agg_mode, global_batch=global_batch)


def compute_kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kl_loss_type: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
    global_batch: GlobalBatchInfo | None = None,
) -> torch.Tensor:
    """KL-to-reference as a loss term (GRPO's ``use_kl_loss``), with any estimator of :mod:`rl_core.kl`."""
    mask = is_set(response_mask)
    zero = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
    kl = kl_penalty(torch.where(mask, log_prob, zero), torch.where(mask, ref_log_prob.detach(), zero), kl_loss_type)
    return agg_loss(kl, mask, loss_agg_mode, global_batch=global_batch)


@dataclass(frozen=True)
class LossCoefficients:
    """Weights of the total actor loss (ROLL keys)."""

    rl_loss_coef: float = 1.0
    """Weight of the policy-gradient loss and its KL term (ROLL's: ``(pg + kl_loss_coef * kl) * rl_loss_coef``)."""
    kl_loss_coef: float = 0.0
    """Weight of the KL-to-reference loss (used when use_kl_loss is on)."""
    entropy_loss_coef: float = 0.0
    """Weight of the entropy bonus (subtracted: higher entropy lowers the loss)."""
    sft_loss_coef: float = 0.0
    """Weight of the SFT (negative log-likelihood) loss."""


def compose_total_loss(
    coefs: LossCoefficients,
    *,
    pg_loss: torch.Tensor,
    kl_loss: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    sft_loss: torch.Tensor | None = None,
) -> torch.Tensor:
    """``rl * (pg + kl * kl_loss) - entropy_coef * entropy + sft * sft_loss``: ROLL's order, where
    ``rl_loss_coef`` scales the policy-gradient loss together with its KL term (``roll/pipeline/rlvr/
    actor_worker.py``); a term with a non-zero coefficient must be given (a silently missing term would change the
    objective)."""

    def term(key: str, coef: float, value: torch.Tensor | None) -> torch.Tensor | float:
        if coef == 0.0:
            return 0.0
        if value is None:
            raise ValueError(f"{key} is {coef} but its loss term was not computed; pass it or set {key}: 0")
        return coef * value

    policy = pg_loss + term("kl_loss_coef", coefs.kl_loss_coef, kl_loss)
    total = coefs.rl_loss_coef * policy - term("entropy_loss_coef", coefs.entropy_loss_coef, entropy)
    return total + term("sft_loss_coef", coefs.sft_loss_coef, sft_loss)
