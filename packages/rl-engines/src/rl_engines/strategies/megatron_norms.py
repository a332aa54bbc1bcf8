"""RMSNorm for Megatron's local layer spec that also runs under sequence parallelism.

megatron-core's local spec builds its norms with ``WrappedTorchNorm`` (torch's RMSNorm), which refuses
``sequence_parallel``; only Apex's FusedLayerNorm and Transformer Engine's norms take it, and neither exists on CPU.
Under sequence parallelism a norm sees this TP rank's slice of the sequence, so its weight - replicated over the TP
ranks - gets a gradient from that slice only. Apex and TE mark such weights ``sequence_parallel`` and Megatron sums
their gradients over the TP group (finalize_model_grads; here the train strategy's ``_tp_partial``). The norm below
is torch's RMSNorm marked the same way, so sequence parallelism runs with the same arithmetic on every machine
(megatron-core's local spec takes its torch norm for RMSNorm even where Apex is installed).
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
    (the local spec's RMSNorm is always megatron-core's torch one, whether Apex is installed or not)."""
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
    final norm a :class:`TorchRMSNorm` (Transformer Engine's, where installed, as GPTModel would pick)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    layer = with_torch_norms(layer_spec)
    layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer] * layers, layer_norm=_block_norm())


def _block_norm() -> Any:
    """Transformer Engine's norm where megatron-core's block would take it; else :class:`TorchRMSNorm` (the block's
    own choices without TE are megatron-core's torch norm, which refuses sequence parallelism, and Apex's
    FusedLayerNorm, which builds LayerNorm only)."""
    from megatron.core.transformer import transformer_block

    return transformer_block.LayerNormImpl if getattr(transformer_block, "HAVE_TE", False) else TorchRMSNorm
