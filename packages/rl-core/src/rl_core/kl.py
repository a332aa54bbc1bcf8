"""KL-divergence estimators between the policy and a reference (or old) policy, one registry.

Estimators follow J. Schulman, "Approximating KL Divergence" (2020): with ``log_ratio = log_prob - ref_log_prob``
sampled from the policy, k1 = log_ratio, k2 = log_ratio**2 / 2, k3 = exp(-log_ratio) - 1 + log_ratio.
All per-token estimators take and return ``[batch, response_length]`` tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rl_core.registry import Registry

KLEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator", "kl_penalty / kl_loss_type")

# Bound on |log_ratio| before exponentiation: exp(20) ~ 5e8 keeps k3 finite in fp32 and bf16.
_LOG_RATIO_CLAMP = 20.0
# Bound on the k3 value itself, as verl and ROLL do, so one outlier token cannot dominate a batch.
_K3_CLAMP = 10.0


@KL_ESTIMATORS.register("kl", "k1")
def kl_k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """k1 = log p - log q. Unbiased, high variance, can be negative per token."""
    return log_prob - ref_log_prob


@KL_ESTIMATORS.register("abs")
def kl_abs(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """|log p - log q|."""
    return (log_prob - ref_log_prob).abs()


@KL_ESTIMATORS.register("mse", "k2")
def kl_k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """k2 = (log p - log q)**2 / 2. Biased, low variance, non-negative."""
    return 0.5 * (log_prob - ref_log_prob).square()


@KL_ESTIMATORS.register("low_var_kl", "k3")
def kl_k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """k3 = q/p - 1 - log(q/p). Unbiased and non-negative; clamped to [-10, 10] like verl / ROLL."""
    log_ratio_ref = (ref_log_prob - log_prob).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    k3 = torch.exp(log_ratio_ref) - 1.0 - log_ratio_ref
    return k3.clamp(-_K3_CLAMP, _K3_CLAMP)


@KL_ESTIMATORS.register("full")
def kl_full(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """Exact KL(p || q) over the vocabulary from full log-distributions ``[B, T, V]`` -> ``[B, T]``."""
    if log_prob.dim() < 3 or log_prob.shape != ref_log_prob.shape:
        raise ValueError(
            "kl_penalty 'full' needs full-vocabulary log-probabilities of shape [batch, response_length, vocab] "
            f"for both policies, got {tuple(log_prob.shape)} and {tuple(ref_log_prob.shape)}; pass "
            "log_softmax(logits) (see full_kl_from_logits) or pick a sampled-token estimator such as 'low_var_kl'"
        )
    return (log_prob.exp() * (log_prob - ref_log_prob)).sum(dim=-1)


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate of ``kind``: "kl"/"k1", "abs", "mse"/"k2", "low_var_kl"/"k3" or "full".

    Shapes: ``[batch, response_length]`` in and out for the sampled-token estimators; "full" takes full
    log-distributions ``[batch, response_length, vocab]``.
    """
    return KL_ESTIMATORS.get(kind)(log_prob, ref_log_prob)


def full_kl_from_logits(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """Exact KL(p || q) over the vocabulary at each position from logits. ``[B, T, V]`` -> ``[B, T]``."""
    return kl_full(torch.log_softmax(logits.float(), dim=-1), torch.log_softmax(ref_logits.float(), dim=-1))
