"""The load-balancing loss of a MoE model's routers in ``megatron_train``: Megatron's own (``moe_router_load_balancing_
type: aux_loss``, what ROLL's mcore_adapter sets for Qwen3-MoE / Qwen2-MoE), on the terms the torch-native strategies
use (:mod:`rl_engines.strategies.moe`), so the engines train one model alike.

- Coefficient, as ROLL picks it: ``strategy_config.moe_aux_loss_coeff`` (Megatron's key), else
  ``model_args.moe_aux_loss_coef`` (ROLL's), else the model config's ``router_aux_loss_coef`` (what ROLL's
  mcore_adapter maps to ``moe_aux_loss_coeff``); 0 switches the loss off.
- Per layer ``E / k * sum_e f_e P_e`` over the real tokens of the micro-batch (the forward passes Megatron's
  ``padding_mask``), added through Megatron's ``MoEAuxLossAutoScaler`` on every pipeline stage, with the gradient
  scale ``1 / micro-batches of the mini-batch over the data-parallel ranks`` (gradients are summed over them): the
  mean over micro-batches, as fsdp2_train's.
- ``{role}/load_balancing_loss`` (ROLL's name, from Megatron's tracker): the per-layer loss without the coefficient,
  mean over layers and micro-batches; reported while the loss is on (Megatron computes it only then).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from rl_engines.config import WorkerConfig, WorkerConfigError
from rl_engines.strategies.moe import mean_weight
from rl_engines.strategies.train_utils import all_reduce_sum

logger = logging.getLogger(__name__)
TRACKED = "load_balancing_loss"


def router_loss_coef(config: WorkerConfig, role: str, spec: Any, megatron_key: float | None) -> float:
    """The coefficient for ``spec`` (rl_ckpt's ModelSpec; ``megatron_key``: strategy_config.moe_aux_loss_coeff);
    ``moe_aux_loss_coef`` on a dense model is refused (Megatron's key is, with the other moe_* keys, earlier)."""
    key = config.model_args.moe_aux_loss_coef
    if not spec.moe:
        if key is not None:
            raise WorkerConfigError(
                f"{role}.model_args.moe_aux_loss_coef={key} is set, but {config.model_args.model_name_or_path} is a "
                "dense model: there is no router to balance; remove the key."
            )
        return 0.0
    source = "model_args.moe_aux_loss_coef"
    if megatron_key is not None:
        key, source = megatron_key, "strategy_config.moe_aux_loss_coeff"
    elif key is None:
        hf_config = spec.hf_config or {}
        text = hf_config.get("text_config") or hf_config  # a VL model's language model has the router
        key = float(text.get("router_aux_loss_coef") or 0.0)
        source = "the model config's router_aux_loss_coef; model_args.moe_aux_loss_coef overrides it"
    if megatron_key is not None and config.model_args.moe_aux_loss_coef not in (None, megatron_key):
        source += f", which wins over model_args.moe_aux_loss_coef={config.model_args.moe_aux_loss_coef} as in ROLL"
    logger.info(
        "%s: mixture of experts (%d experts, top-%d): Megatron's router load-balancing loss (aux_loss) coefficient "
        "%g (%s; 0 switches the loss off); %s/load_balancing_loss reports its per-layer mean",
        role, spec.num_experts, spec.moe_topk, key, source, role,
    )  # fmt: skip
    return float(key)


def set_micro_weight(micros: int, group: dist.ProcessGroup | None) -> float:
    """Scale Megatron's router-loss gradients by 1 / the mini-batch's micro-batches over ``group`` (the data-parallel
    ranks, whose gradients are summed; a collective); returns that weight."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    weight = mean_weight(micros, group)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(weight))
    return weight


def tracked_layer_mean(num_layers: int, stage_group: dist.ProcessGroup | None) -> torch.Tensor | None:
    """Megatron's tracked per-layer losses of the step (summed over its micro-batches and, as Megatron's tracker
    asks, over the ranks that each computed a part: the TP ranks under sequence parallelism; each pipeline stage
    holds its layers', summed over ``stage_group``), their mean over layers; the tracker is cleared. None: none
    tracked."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    entry = get_moe_layer_wise_logging_tracker().get(TRACKED)
    if entry is None:
        return None
    values = entry["values"].detach().float().cpu().clone()
    clear_aux_losses_tracker()
    partial = entry.get("reduce_group")  # the TP ranks under sequence parallelism: each its sequence slice's part
    if partial is not None and dist.get_world_size(partial) > 1:
        values = all_reduce_sum(values, partial)
    if stage_group is not None:
        values = all_reduce_sum(values, stage_group)
    mean: torch.Tensor = values.sum() / num_layers
    return mean
