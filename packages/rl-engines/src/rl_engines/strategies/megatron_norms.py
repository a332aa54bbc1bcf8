"""RMSNorm for Megatron's local layer spec that also runs under sequence parallelism.

megatron-core's local spec builds its norms with ``WrappedTorchNorm`` (torch's RMSNorm), which refuses
``sequence_parallel``; only Apex's FusedLayerNorm and Transformer Engine's norms take it, and neither exists on CPU.
Under sequence parallelism a norm sees this TP rank's slice of the sequence, so its weight - replicated over the TP
ranks - gets a gradient from that slice only. Apex and TE mark such weights ``sequence_parallel`` and Megatron sums
their gradients over the TP group (finalize_model_grads; here the train strategy's ``_tp_partial``). The norm below
is torch's RMSNorm marked the same way, so sequence parallelism runs with the same arithmetic on every machine.
megatron is imported inside functions only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


class TorchRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm with Megatron's norm signature; its weight is tagged ``sequence_parallel`` when the config
    splits the sequence over TP ranks (as Apex's and TE's norms tag theirs)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **unused: Any) -> None:
        if config.normalization != "RMSNorm":
            raise ValueError(f"TorchRMSNorm builds RMSNorm only, not {config.normalization}")
        super().__init__(normalized_shape=hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]


def with_torch_norms(spec: Any) -> Any:
    """``spec`` (a megatron-core ModuleSpec tree) with every ``WrappedTorchNorm`` replaced by :class:`TorchRMSNorm`
    (Apex's or TE's norms, where the local spec chose them, are kept)."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if spec is WrappedTorchNorm:
        return TorchRMSNorm
    if isinstance(spec, ModuleSpec):
        return dataclasses.replace(spec, submodules=with_torch_norms(spec.submodules))
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {f.name: with_torch_norms(getattr(spec, f.name)) for f in dataclasses.fields(spec)}
        return dataclasses.replace(spec, **changes)
    return spec


def local_block_spec(config: Any, layer_spec: Any, vp_stage: int | None) -> Any:
    """The transformer block of this pipeline stage (``vp_stage``: its virtual chunk) built from ``layer_spec``, its
    final norm a :class:`TorchRMSNorm` (GPTModel would take the module-wide ``WrappedTorchNorm`` otherwise)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    layer = with_torch_norms(layer_spec)
    layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer] * layers, layer_norm=with_torch_norms(_block_norm()))


def _block_norm() -> Any:
    """The final norm class megatron-core's transformer block picks for a layer spec (Apex / TE / torch)."""
    from megatron.core.transformer import transformer_block

    return transformer_block.LayerNormImpl
