"""Mixture-of-experts HF models in the torch-native training strategies: the router's load-balancing loss.

A transformers MoE model of :data:`SOFTMAX_TOP_K_ROUTERS` (Qwen3-MoE, Qwen2-MoE, Qwen3-VL-MoE) routes every token to
``k = num_experts_per_tok`` of its ``E = num_experts`` experts. Training adds the Switch-Transformer load-balancing
loss of every MoE layer, as Megatron does (``moe_router_load_balancing_type: aux_loss``), so that the two engines
train one model alike:

    L_layer = E / k * sum_e f_e * P_e

with ``f_e`` the fraction of the layer's routed (token, slot) pairs sent to expert e (``count_e / tokens``) and ``P_e``
the mean router probability of expert e over the layer's tokens, both over real tokens only (padding excluded). A
perfectly even router gives 1.0 per layer. The loss added to a micro-batch is ``coef * sum over layers`` times the
micro-batch's weight (1 / the number of micro-batches in the mini-batch, over all ranks), i.e. the mean over
micro-batches, as Megatron's; ``{role}/load_balancing_loss`` reports its unscaled per-layer mean (ROLL's metric).
Under Ulysses each rank routes a slice of the packed row: counts and tokens are summed over the group and each rank
adds its slice's share, so the group's loss equals the one-rank loss.

``coef`` is ``model_args.moe_aux_loss_coef`` (ROLL's key) or, unset, the model config's ``router_aux_loss_coef``
(what ROLL's Megatron path uses; ROLL's fsdp2 / DeepSpeed strategies set it on the config but never add the loss).
HF MoE blocks are dropless: every token reaches its k experts, so no token is dropped and none is reported.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from rl_engines.config import WorkerConfig, WorkerConfigError
from rl_engines.strategies.train_utils import all_reduce_sum

logger = logging.getLogger(__name__)
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
"""HF config fields that hold the number of routed experts (the first one set counts)."""
SOFTMAX_TOP_K_ROUTERS = frozenset({"qwen2_moe", "qwen3_moe", "qwen3_vl_moe_text"})
"""Model types whose router is a softmax over the experts' logits followed by top-k (what the loss assumes; tested).
Others (DeepSeek-V3's sigmoid scores with a correction bias and group-limited routing, ...) are refused."""


def text_config(model: nn.Module) -> Any:
    """The language model's config (a vision-language model keeps it under ``text_config``)."""
    config = model.config
    return getattr(config, "text_config", None) or config


def expert_count(config: Any) -> int:
    """Routed experts of an HF config; 0 for a dense model."""
    for key in EXPERT_COUNT_KEYS:
        value = getattr(config, key, None)
        if value:
            return int(value)
    return 0


def load_balancing_loss(
    logits: torch.Tensor, top_k: int, keep: torch.Tensor | None = None, group: Any = None
) -> torch.Tensor:
    """One layer's Switch load-balancing loss ``E / k * sum_e f_e P_e`` from its router logits ``[N, E]``.

    ``keep [N]`` marks the real tokens (None: all). Differentiable through ``P_e`` only (the counts are not), in
    float32; an empty selection gives 0. ``group`` (Ulysses: the ranks holding slices of the same rows): counts and
    tokens are summed over it, and each rank returns its tokens' share of the group's loss (the shares sum to it).
    """
    probs = torch.softmax(logits.float(), dim=-1)
    if keep is not None:
        probs = probs[keep]
    experts = probs.shape[1]
    chosen = probs.detach().topk(top_k, dim=-1).indices
    counts = torch.zeros(experts + 1, dtype=torch.float64, device=probs.device)
    counts.scatter_add_(0, chosen.reshape(-1), torch.ones(chosen.numel(), dtype=torch.float64, device=probs.device))
    counts[-1] = probs.shape[0]
    if group is not None:
        counts = all_reduce_sum(counts.cpu(), group).to(probs.device)
    tokens = float(counts[-1])
    if tokens == 0:
        return probs.sum() * 0.0
    fractions = (counts[:-1] / tokens).to(probs.dtype)
    return experts / top_k * (fractions * probs.sum(dim=0) / tokens).sum()


@dataclass
class RouterLoss:
    """Records the router logits of a training forward and turns them into the load-balancing loss."""

    model: nn.Module
    top_k: int
    coef: float
    router_class: type
    index: int
    _logits: list[torch.Tensor] = field(default_factory=list)
    _mask: torch.Tensor | None = None
    _group: Any = None
    _active: bool = False

    def __post_init__(self) -> None:
        for module in self.model.modules():
            if isinstance(module, self.router_class):
                module.register_forward_hook(self._record)
        self.model.register_forward_pre_hook(self._inputs, with_kwargs=True)

    def _record(self, _module: nn.Module, _args: Any, output: Any) -> None:
        if self._active:
            self._logits.append(output[self.index] if isinstance(output, tuple) else output)

    def _inputs(self, _module: nn.Module, _args: Any, kwargs: dict[str, Any]) -> None:
        if not self._active or self._mask is not None:
            return
        row = kwargs.get("ulysses_row")  # a slice of a packed row (rl_engines.strategies.ulysses)
        if row is not None:
            self._mask, self._group = row.local_tokens(), row.group
            return
        mask = kwargs.get("attention_mask")  # [B, T] padded rows; packed rows have none (every token is real)
        self._mask = None if mask is None or mask.dim() != 2 else mask.reshape(-1).to(torch.bool)

    @contextlib.contextmanager
    def recording(self) -> Iterator[RouterLoss]:
        """Record the routers of the forward passes run inside (one micro-batch's)."""
        self._logits, self._mask, self._group, self._active = [], None, None, True
        try:
            yield self
        finally:
            self._active = False

    def layer_losses(self) -> torch.Tensor:
        """``[layers]``: each recorded MoE layer's loss over the real tokens of the recorded forward."""
        keep = self._mask
        losses = []
        for logits in self._logits:
            if keep is not None and keep.numel() != logits.shape[0]:
                raise RuntimeError(f"router logits of {logits.shape[0]} tokens for a forward of {keep.numel()}")
            rows = None if keep is None else keep.to(logits.device)
            losses.append(load_balancing_loss(logits, self.top_k, rows, self._group))
        self._logits = []
        return torch.stack(losses) if losses else torch.zeros(0)

    def add_to(self, loss: torch.Tensor, weight: float, metrics: dict[str, torch.Tensor]) -> torch.Tensor:
        """``loss + coef * weight * sum(layer losses)``; ``metrics['load_balancing_loss']`` = ``weight * mean``
        (additive: summed over the micro-batches of all ranks it is their mean)."""
        layers = self.layer_losses()
        if layers.numel() == 0:
            return loss
        metrics["load_balancing_loss"] = layers.detach().mean() * weight
        if self.coef == 0.0:
            return loss
        return loss + self.coef * weight * layers.sum().to(loss.device)


def router_recorder(model: nn.Module) -> tuple[type, int] | None:
    """The router module class of a transformers MoE model and which output holds its logits
    (transformers' ``_can_record_outputs['router_logits']``); None when the model declares none."""
    for module in model.modules():
        recorder = (getattr(type(module), "_can_record_outputs", None) or {}).get("router_logits")
        if recorder is not None and getattr(recorder, "target_class", None) is not None:
            return recorder.target_class, int(getattr(recorder, "index", 0))
    return None


def router_loss(model: nn.Module, config: WorkerConfig, role: str) -> RouterLoss | None:
    """The load-balancing loss of a training role's MoE model (None for a dense model).

    Refuses ``moe_aux_loss_coef`` on a dense model and a MoE model whose router transformers does not expose.
    """
    prefix = f"{role}.model_args.moe_aux_loss_coef"
    coef = config.model_args.moe_aux_loss_coef
    hf = text_config(model)
    experts = expert_count(hf)
    if not experts:
        if coef is not None:
            raise WorkerConfigError(
                f"{prefix}={coef} is set, but {config.model_args.model_name_or_path} is a dense model (its config "
                f"has none of {list(EXPERT_COUNT_KEYS)}): there is no router to balance; remove the key."
            )
        return None
    model_type = str(getattr(hf, "model_type", ""))
    if model_type not in SOFTMAX_TOP_K_ROUTERS:
        raise WorkerConfigError(
            f"{role}: {config.model_args.model_name_or_path} is a {model_type!r} mixture-of-experts model; the router "
            f"loss here is built for softmax top-k routers ({sorted(SOFTMAX_TOP_K_ROUTERS)}), not this family's "
            "router, so fsdp2_train / deepspeed_train refuse to train it rather than train it with a wrong loss."
        )
    found = router_recorder(model)
    if found is None:
        raise WorkerConfigError(
            f"{role}: {type(model).__name__} has {experts} experts but transformers exposes no router_logits for it "
            "(its _can_record_outputs), so fsdp2_train / deepspeed_train cannot compute its load-balancing loss; "
            "this model family is not supported for training here."
        )
    top_k = int(getattr(hf, "num_experts_per_tok", 0) or getattr(hf, "moe_topk", 0) or 1)
    source = "model_args.moe_aux_loss_coef"
    if coef is None:
        coef = float(getattr(hf, "router_aux_loss_coef", 0.0) or 0.0)
        source = "the model config's router_aux_loss_coef; model_args.moe_aux_loss_coef overrides it"
    logger.info(
        "%s: mixture of experts (%d experts, top-%d): router load-balancing loss coefficient %g (%s; 0 switches the "
        "loss off); %s/load_balancing_loss reports its per-layer mean",
        role, experts, top_k, coef, source, role,
    )  # fmt: skip
    return RouterLoss(model, top_k, float(coef), *found)


def micro_weight(router: RouterLoss | None, micros: int, group: Any = None) -> float:
    """Each micro-batch's weight in the router loss: 1 / the mini-batch's micro-batches over all ranks of ``group``
    (a collective: every rank calls it; 0 and no collective for a dense model)."""
    return 0.0 if router is None else mean_weight(micros, group)


def mean_weight(micros: int, group: Any = None) -> float:
    """1 / the micro-batches of the mini-batch over all ranks of ``group`` (a collective): the weight that makes a
    sum over micro-batches and ranks their mean."""
    return 1.0 / max(float(all_reduce_sum(torch.tensor([float(micros)]), group)[0]), 1.0)


def recording(router: RouterLoss | None) -> contextlib.AbstractContextManager[Any]:
    """:meth:`RouterLoss.recording`, or nothing for a dense model."""
    return router.recording() if router is not None else contextlib.nullcontext()


def with_router_loss(
    router: RouterLoss | None, loss: torch.Tensor, weight: float, metrics: dict[str, torch.Tensor]
) -> torch.Tensor:
    """``loss`` plus the recorded forward's router loss (:meth:`RouterLoss.add_to`); ``loss`` for a dense model."""
    return loss if router is None else router.add_to(loss, weight, metrics)
