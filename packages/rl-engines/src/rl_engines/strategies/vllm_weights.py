"""Weight sync into a live vLLM engine: whole decoder layers at a time, through the worker's ``reload_weights``.

vLLM keeps fused weights (``qkv_proj`` = q, k, v; ``gate_up_proj`` = gate, up) and, on CPU, repacks linear
weights for its kernels, so ``model.load_weights`` cannot update a running engine in place. The worker's
``reload_weights(weights_iterator=...)`` reloads layer by layer and repacks; measured on vLLM 0.32 (CPU): a
layer that receives only some of its weights (q without k and v) is rebuilt from those alone and computes
garbage, and a tied ``lm_head`` keeps its old packed copy unless ``lm_head.weight`` is loaded explicitly.

The sync sends buckets that may split a layer, so :class:`LayerBuffer` holds weights until every HF weight of
their decoder layer (or of their tied group) has arrived; the adapter then reloads the complete groups.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch

from rl_engines.strategies.weight_table import WeightTable

LAYER_PREFIX = re.compile(r"^(.*\.layers\.\d+)\.")
RELOAD_LOGGERS = (
    "vllm.model_executor.model_loader.reload.layerwise",
    "vllm.model_executor.model_loader.reload.inplace",
)
"""vLLM warns about every layer a partial reload leaves alone; partial reloads are how buckets arrive here."""


def group_of(name: str, table: WeightTable) -> str:
    """The reload unit of ``name``: its decoder layer (``model.layers.3``), else the name with its tied names."""
    match = LAYER_PREFIX.match(name)
    if match:
        return match.group(1)
    return min((name, *table.tied.get(name, ())))


class LayerBuffer:
    """Synced weights waiting for the rest of their reload group."""

    def __init__(self, table: WeightTable) -> None:
        members: dict[str, set[str]] = {}
        for name in table.shapes:
            members.setdefault(group_of(name, table), set()).add(name)
        self.members = {group: frozenset(names) for group, names in members.items()}
        self.table = table
        self.pending: dict[str, dict[str, torch.Tensor]] = {}
        self._fresh: set[tuple[str, str]] = set()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Hold ``tensor`` (checked against the table already) until its group is complete."""
        group = group_of(name, self.table)
        self.pending.setdefault(group, {})[name] = tensor
        self._fresh.add((group, name))

    def take_complete(self) -> list[tuple[str, torch.Tensor]]:
        """Every weight of every complete group, removed from the buffer, in arrival order of the groups."""
        ready = [group for group, held in self.pending.items() if len(held) == len(self.members[group])]
        weights = [item for group in ready for item in self.pending.pop(group).items()]
        self._fresh = {(group, name) for group, name in self._fresh if group in self.pending}
        return weights

    def keep_pending(self) -> None:
        """Copy the weights that stay pending: senders reuse their buffers (shared-memory slots) after a call."""
        for group, name in self._fresh:
            self.pending[group][name] = self.pending[group][name].clone()
        self._fresh.clear()

    def missing(self) -> dict[str, list[str]]:
        """Group -> the names it still waits for (empty when nothing is pending)."""
        return {group: sorted(self.members[group] - set(held)) for group, held in self.pending.items()}


def quiet_partial_reload_warnings() -> None:
    """Raise vLLM's reload loggers to ERROR (see :data:`RELOAD_LOGGERS`)."""
    for name in RELOAD_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def reload_on_worker(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Run on the engine's worker (``LLM.collective_rpc``): reload checkpoint-format weights in place, then repack
    the mixture-of-experts layers the reload touched for their expert kernels (:func:`repack_reloaded_experts`)."""
    worker.reload_weights(weights_iterator=iter(weights))
    repack_reloaded_experts(worker.model_runner.get_model(), [name for name, _ in weights])


EXPERT_WEIGHT = re.compile(r"^(.*\.experts)\.(?:\d+\.|gate_up_proj|down_proj)")
"""An expert weight, per expert (``...experts.3.up_proj.weight``) or stacked (``...experts.gate_up_proj``); group 1
is its MoE layer's module name."""


def repack_reloaded_experts(model: Any, names: list[str]) -> int:
    """vLLM 0.32 prepacks CPU expert weights for its grouped-GEMM kernel when the engine loads, but a reload leaves
    the reloaded ones in checkpoint layout (a weight update skips the experts' ``process_weights_after_loading``;
    measured: reloading the engine's own checkpoint moved its log-probs by 0.033). Redo that step for each MoE
    layer whose experts ``names`` reloaded; returns how many. Expert weights of a layer vLLM does not hold under
    their module name are refused rather than served unpacked."""
    layers = prepacking_expert_layers(model)
    if not layers:
        return 0
    touched = {match.group(1) for name in names if (match := EXPERT_WEIGHT.match(name))}
    held = {prefix: [layer for name, layer in layers if name == prefix or name.startswith(f"{prefix}.")]
            for prefix in touched}  # fmt: skip
    unknown = sorted(prefix for prefix, found in held.items() if len(found) != 1)
    if unknown:
        raise RuntimeError(f"expert weights of {unknown} reloaded, but vLLM's CPU MoE layers are "
                           f"{sorted(name for name, _ in layers)}: they could not be repacked for its expert kernel; "
                           "use hf_infer for this model on CPU.")  # fmt: skip
    for (layer,) in held.values():
        layer.quant_method.moe_kernel.fused_experts.process_weights_after_loading(layer)
    return len(held)


def prepacking_expert_layers(model: Any) -> list[tuple[str, Any]]:
    """(name, module) of the model's MoE layers whose expert kernel lays the weights out for itself after loading
    (vLLM's CPU grouped-GEMM experts, which prepack ``w13_weight`` / ``w2_weight``)."""
    found = []
    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if type(experts).__name__.endswith("CPUUnquantizedExperts") and hasattr(module, "w13_weight"):
            found.append((name, module))
    return found


def set_logit_temperature_on_worker(worker: Any, temperature: float) -> int:
    """Run on the engine's worker: divide the model's logits by ``temperature`` (1.0 restores them).

    vLLM reports log-probs of the raw logits, before the sampler's temperature, and prompt log-probs never see a
    temperature. Scaling the logits in the model's ``LogitsProcessor`` (its ``scale``, applied after any soft
    cap, as HF applies the temperature) and sampling at temperature 1 draws from the same distribution as
    sampling at ``temperature`` (top-k / top-p / repetition penalty commute with a positive scale) and makes every
    reported log-prob ``log_softmax(logits / temperature)``, the rollout layout's definition. Returns how many
    logits processors were rescaled.
    """
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    count = 0
    for module in worker.model_runner.get_model().modules():
        if isinstance(module, LogitsProcessor):
            base = module.__dict__.setdefault("_rl_base_scale", module.scale)
            module.scale = base / temperature
            count += 1
    return count
