"""Policy-gradient losses, one registry (``policy_loss`` / verl ``loss_mode`` / ROLL ``pg_variant``).

Every loss has the same signature, so callers look one up by name and never branch on it::

    loss, metrics = get_policy_loss("vanilla")(old_log_prob, log_prob, advantages, response_mask,
                                               loss_agg_mode="token-mean", config=None,
                                               rollout_is_weights=None)

Tensors are ``[batch, response_length]``; ``response_mask`` is 0/1 or bool (True = the token counts). Values at
masked-out positions never reach the loss or its gradient, even when they are NaN / Inf. ``rollout_is_weights``
(from :mod:`rl_core.rollout_is`) multiply the per-token loss, detached. ``metrics`` maps names to detached 0-dim
tensors (no device sync; call ``float()`` when logging).

This module holds the PPO family (vanilla, sequence_ppo, segment_ppo, gspo, gpg, clip_cov, kl_cov, geo_mean); the
REINFORCE-style off-policy variants of ROLL (tis, topr, cispo, kimi15) are in :mod:`rl_core.losses.policy_offpolicy`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch

from rl_core.fused import call as fused_call
from rl_core.losses.aggregation import GlobalBatchInfo, aggregate_masked, total
from rl_core.losses.config import PolicyLossConfig
from rl_core.masked import is_set, masked_mean, segment_mean
from rl_core.registry import Registry

Metrics = dict[str, torch.Tensor]

# exp(20) ~ 5e8: ratios beyond that carry no information but overflow fp16 / produce Inf gradients.
LOG_RATIO_CLAMP = 20.0


class PolicyLoss(Protocol):
    """The signature shared by every registered policy loss."""

    def __call__(
        self,
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        *,
        loss_agg_mode: str = "token-mean",
        config: PolicyLossConfig | None = None,
        rollout_is_weights: torch.Tensor | None = None,
        global_batch: GlobalBatchInfo | None = None,
        sample_scores: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Metrics]: ...


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss", "policy_loss (loss_mode / pg_variant)")


def get_policy_loss(name: str) -> PolicyLoss:
    """The policy loss registered as ``name`` (see ``POLICY_LOSSES.names()``)."""
    return POLICY_LOSSES.get(name)


class LossInputs:
    """Sanitised inputs: padding zeroed so it cannot reach values or gradients; shared ratio pieces.

    ``torch.where`` keeps NaN / Inf at valid positions visible (a bug upstream should show) while zeroing
    padding; everything after that uses a float mask, which is several times faster than bool ops on CPU.
    """

    def __init__(
        self,
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
    ) -> None:
        self.check_shapes(old_log_prob, log_prob, advantages, response_mask)
        self.mask = is_set(response_mask)
        self.maskf = self.mask.to(log_prob.dtype)
        self.num_valid = total(self.maskf).clamp(min=1.0)
        self._zero = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
        self._raw_log_prob = log_prob
        self._raw_old_log_prob = old_log_prob
        self.advantages = torch.where(self.mask, advantages.detach().to(log_prob.dtype), self._zero)
        self._log_prob: torch.Tensor | None = None

    @staticmethod
    def check_shapes(*tensors: torch.Tensor) -> None:
        """old_log_prob, log_prob, advantages and response_mask share one ``[B, T]`` shape. Compared with ``!=``, not
        hashed: in a compiled graph that keeps the sizes symbolic (a set of shapes would fix them to the first call's
        sizes, and every new batch or response length would compile the graph again)."""
        if any(t.shape != tensors[0].shape for t in tensors[1:]):
            raise ValueError(
                "old_log_prob, log_prob, advantages and response_mask must share one [batch, response_length] "
                f"shape, got {', '.join(str(tuple(t.shape)) for t in tensors)}"
            )

    @property
    def log_prob(self) -> torch.Tensor:
        """Current log-probs with padding zeroed (computed on first use)."""
        if self._log_prob is None:
            self._log_prob = torch.where(self.mask, self._raw_log_prob, self._zero)
        return self._log_prob

    @property
    def old_log_prob(self) -> torch.Tensor:
        """Old log-probs with padding zeroed, detached."""
        return torch.where(self.mask, self._raw_old_log_prob.detach(), self._zero)

    def log_ratio(self) -> torch.Tensor:
        """log(pi / pi_old) per token (0 at padding), clamped to +-20 before any exp."""
        diff = torch.where(self.mask, self._raw_log_prob - self._raw_old_log_prob.detach(), self._zero)
        return diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)

    def ppo_kl(self, log_ratio: torch.Tensor) -> torch.Tensor:
        """k1 estimate of KL(pi_old || pi) over valid tokens, as verl logs it (``ppo_kl``)."""
        return -self.mean(log_ratio)

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """Token mean over valid tokens of a detached quantity that is finite at padding (for metrics)."""
        return total(values.detach().to(self.maskf.dtype) * self.maskf) / self.num_valid

    def aggregate(
        self, pg_losses: torch.Tensor, loss_agg_mode: str, global_batch: GlobalBatchInfo | None
    ) -> torch.Tensor:
        """Aggregate a per-token loss that is 0 at padding."""
        return aggregate_masked(pg_losses, self.maskf, loss_agg_mode, global_batch)


def apply_is_weights(pg_losses: torch.Tensor, rollout_is_weights: torch.Tensor | None) -> torch.Tensor:
    """Multiply per-token losses by detached rollout IS weights ``[B, T]`` (verl PR: ``pg_losses *= w``)."""
    if rollout_is_weights is None:
        return pg_losses
    if rollout_is_weights.shape != pg_losses.shape:
        raise ValueError(
            f"rollout_is_weights shape {tuple(rollout_is_weights.shape)} must equal the loss shape "
            f"{tuple(pg_losses.shape)} ([batch, response_length])"
        )
    return pg_losses * rollout_is_weights.detach().to(pg_losses.dtype)


def _config(config: PolicyLossConfig | None) -> PolicyLossConfig:
    return PolicyLossConfig() if config is None else config


def _clipped_surrogate(
    advantages: torch.Tensor, ratio: torch.Tensor, low: float, high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's pessimistic clipped surrogate (Schulman et al. 2017, eq. 7) and where clipping bit."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - low, 1.0 + high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


@POLICY_LOSSES.register("vanilla", "ppo")
def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    config: PolicyLossConfig | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch: GlobalBatchInfo | None = None,
    sample_scores: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Clipped PPO with asymmetric clip (DAPO clip-higher) and dual clip (Ye et al. 2020, eq. 5).

    For A < 0 the clipped loss is additionally capped at ``-clip_ratio_c * A`` so a huge ratio on a bad token
    cannot blow up the update. Metrics: pg_clipfrac, pg_clipfrac_lower (dual clip active), ppo_kl. Large inputs
    take the compiled one-graph path (:mod:`rl_core.fused`), forward and backward.
    """
    LossInputs.check_shapes(old_log_prob, log_prob, advantages, response_mask)
    cfg = _config(config)
    clip = Clip(cfg.low, cfg.high, cfg.clip_ratio_c)
    args = (old_log_prob, log_prob, advantages, response_mask, rollout_is_weights, clip, loss_agg_mode)
    loss: torch.Tensor
    metrics: Metrics
    loss, metrics = fused_call(_vanilla, log_prob.numel(), None, *args, *_batch_counts(global_batch, log_prob))
    return loss, metrics


class Clip(NamedTuple):
    """PPO's clip range ``[1 - low, 1 + high]`` and the dual-clip constant (None: no dual clip)."""

    low: float
    high: float
    dual: float | None


def _batch_counts(
    info: GlobalBatchInfo | None, like: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None, float | None]:
    """``info``'s counts as 0-dim tensors (inputs of a compiled graph, not constants compiled into it)."""
    if info is None:
        return None, None, None
    as_tensor = functools.partial(torch.tensor, dtype=torch.float64, device=like.device)
    return as_tensor(info.num_tokens), as_tensor(info.num_seqs), info.norm_length


def _vanilla(
    old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    rollout_is_weights: torch.Tensor | None, clip: Clip, loss_agg_mode: str, num_tokens: torch.Tensor | None,
    num_seqs: torch.Tensor | None, norm_length: float | None,
) -> tuple[torch.Tensor, Metrics]:  # fmt: skip
    x = LossInputs(old_log_prob, log_prob, advantages, response_mask)
    log_ratio = x.log_ratio()
    info = None if num_tokens is None else GlobalBatchInfo(num_tokens, num_seqs, norm_length)  # type: ignore[arg-type]
    return _ppo(x, clip, torch.exp(log_ratio), log_ratio, loss_agg_mode, rollout_is_weights, info)


@POLICY_LOSSES.register("sequence_ppo", "seq_ppo")
def compute_policy_loss_sequence_ppo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    config: PolicyLossConfig | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch: GlobalBatchInfo | None = None,
    sample_scores: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """``vanilla`` PPO on one ratio per sequence: ``exp`` of the mean token log-ratio, the gradient flowing through
    that mean (ROLL's ``importance_sampling: seq``). With advantages constant over a sequence (GRPO) its gradient is
    GSPO's; ``gspo`` is the GSPO-token form (Zheng et al. 2025), which differs when advantages vary by token."""
    x = LossInputs(old_log_prob, log_prob, advantages, response_mask)
    return _ppo_on_shared_ratios(x, _per_sequence_mean, config, loss_agg_mode, rollout_is_weights, global_batch)


def _per_sequence_mean(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked_mean(log_ratio, mask, dim=-1).unsqueeze(-1).expand_as(log_ratio)


@POLICY_LOSSES.register("segment_ppo")
def compute_policy_loss_segment_ppo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    config: PolicyLossConfig | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch: GlobalBatchInfo | None = None,
    sample_scores: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """``vanilla`` PPO on one ratio per segment, a run of consecutive response tokens (one assistant turn of a
    multi-turn sample, the environment's text between turns being masked out): ``exp`` of the segment's mean token
    log-ratio, the gradient flowing through that mean (ROLL's agentic ``ratio_type: segment``). With one segment per
    row it is ``sequence_ppo``."""
    x = LossInputs(old_log_prob, log_prob, advantages, response_mask)
    return _ppo_on_shared_ratios(x, segment_mean, config, loss_agg_mode, rollout_is_weights, global_batch)


def _ppo_on_shared_ratios(
    x: LossInputs, mean_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], config: PolicyLossConfig | None,
    loss_agg_mode: str, rollout_is_weights: torch.Tensor | None, global_batch: GlobalBatchInfo | None,
) -> tuple[torch.Tensor, Metrics]:  # fmt: skip
    """PPO whose tokens share ``exp`` of a mean of their log-ratios (``mean_of(log_ratio, mask)``, broadcast to
    ``[B, T]``: per sequence or per segment), the gradient flowing through the mean."""
    log_ratio = x.log_ratio()
    cfg = _config(config)
    clip = Clip(cfg.low, cfg.high, cfg.clip_ratio_c)
    return _ppo(x, clip, torch.exp(mean_of(log_ratio, x.mask)), log_ratio, loss_agg_mode, rollout_is_weights,
                global_batch)  # fmt: skip


def _ppo(
    x: LossInputs, clip: Clip, ratio: torch.Tensor, log_ratio: torch.Tensor, loss_agg_mode: str,
    rollout_is_weights: torch.Tensor | None, global_batch: GlobalBatchInfo | None,
) -> tuple[torch.Tensor, Metrics]:  # fmt: skip
    pg_losses, clipped = _clipped_surrogate(x.advantages, ratio, clip.low, clip.high)
    dual_active = torch.zeros_like(clipped)
    if clip.dual is not None:
        # cap = c * |A| for A < 0 and 0 for A >= 0, where the clipped surrogate is already <= 0 (r > 0),
        # so one minimum applies dual clipping to exactly the negative-advantage tokens.
        cap = (-x.advantages).clamp(min=0.0) * clip.dual
        dual_active = pg_losses > cap
        pg_losses = torch.minimum(pg_losses, cap)
    pg_losses = apply_is_weights(pg_losses, rollout_is_weights)
    loss = x.aggregate(pg_losses, loss_agg_mode, global_batch)
    metrics = {
        "pg_clipfrac": x.mean(clipped),
        "pg_clipfrac_lower": x.mean(dual_active),
        "ppo_kl": x.ppo_kl(log_ratio),
    }
    return loss, metrics


@POLICY_LOSSES.register("gspo")
def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: PolicyLossConfig | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch: GlobalBatchInfo | None = None,
    sample_scores: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """GSPO (Zheng et al. 2025, eqs. 5-7, GSPO-token form): clip the length-normalised sequence ratio.

    ``s_i = exp(mean_t log r_i,t)``; per token ``s_i,t = sg(s_i) * pi / sg(pi)`` so each token's gradient is
    ``s_i * grad log pi``. The paper aggregates with seq-mean-token-mean (our default here) and uses clip ranges
    around 3e-4 / 4e-4, far smaller than token-level PPO's.
    """
    cfg = _config(config)
    x = LossInputs(old_log_prob, log_prob, advantages, response_mask)
    log_ratio = x.log_ratio()
    seq_log_ratio = masked_mean(log_ratio.detach(), x.mask, dim=-1).unsqueeze(-1)  # [B, 1]
    token_log_ratio = x.log_prob - x.log_prob.detach() + seq_log_ratio
    seq_ratio = torch.exp(token_log_ratio.clamp(max=10.0))
    pg_losses, clipped = _clipped_surrogate(x.advantages, seq_ratio, cfg.low, cfg.high)
    pg_losses = apply_is_weights(pg_losses, rollout_is_weights)
    loss = x.aggregate(pg_losses, loss_agg_mode, global_batch)
    metrics = {
        "pg_clipfrac": x.mean(clipped),
        "pg_clipfrac_lower": torch.zeros((), dtype=loss.dtype, device=loss.device),
        "ppo_kl": x.ppo_kl(log_ratio),
    }
    return loss, metrics


@POLICY_LOSSES.register("gpg", "pg")
def compute_policy_loss_gpg(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    config: PolicyLossConfig | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch: GlobalBatchInfo | None = None,
    sample_scores: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """GPG (Chu et al. 2025, eq. 6) = plain policy gradient ``-A * log pi``; also ROLL's pg_variant 'vanilla'."""
    x = LossInputs(old_log_prob, log_prob, advantages, response_mask)
    pg_losses = apply_is_weights(-x.advantages * x.log_prob, rollout_is_weights)
    loss = x.aggregate(pg_losses, loss_agg_mode, global_batch)
    return loss, {"ppo_kl": x.ppo_kl(x.log_ratio())}
