"""ROLL's tiled MLP for fsdp2 (strategy_config ``apply_tiled_mlp``, ``tiled_num_shards``, ``model_type``).

A decoder layer's MLP works token by token, so it can run on ``tiled_num_shards`` slices of the sequence one after
another: each slice's ``gate`` / ``up`` activations (``[tokens, intermediate_size]``, the largest of the layer) exist
for one slice at a time, in the forward and, recomputed, in the backward (activation checkpointing per slice). The
outputs are the MLP's; the weight gradients are sums over the slices (the same up to float rounding). As in ROLL, the
dense SwiGLU MLPs of Llama, Qwen2 / Qwen2.5, Qwen3 and Qwen3-MoE (its dense layers; the experts are not tiled) are
tiled; ``model_type`` restricts it to one of them.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

TILED_MLP_KEYS: dict[str, tuple[type, ...]] = {
    "apply_tiled_mlp": (bool,),
    "tiled_num_shards": (int,),
    "model_type": (str, type(None)),
}
MLP_CLASSES = {"llama": "LlamaMLP", "qwen2": "Qwen2MLP", "qwen2_5": "Qwen2MLP", "qwen3": "Qwen3MLP",
               "qwen3_moe": "Qwen3MoeMLP"}  # fmt: skip
"""ROLL's model types and the MLP class each tiles."""
DEFAULT_SHARDS = 4


def check_tiled_mlp(options: dict[str, Any], prefix: str) -> None:
    """``tiled_num_shards`` >= 1, a known ``model_type``, and neither without ``apply_tiled_mlp``."""
    given = [key for key in ("tiled_num_shards", "model_type") if options.get(key) is not None]
    if given and not options.get("apply_tiled_mlp"):
        raise ValueError(f"{[f'{prefix}.{key}' for key in given]} apply to the tiled MLP only; set "
                         f"{prefix}.apply_tiled_mlp: true or remove them.")  # fmt: skip
    shards = options.get("tiled_num_shards", DEFAULT_SHARDS)
    if shards < 1:
        raise ValueError(f"{prefix}.tiled_num_shards={shards} must be >= 1.")
    model_type = options.get("model_type")
    if model_type is not None and model_type not in MLP_CLASSES:
        raise ValueError(f"{prefix}.model_type={model_type!r}: the tiled MLP supports {sorted(MLP_CLASSES)} (as "
                         "ROLL); remove it to tile every supported MLP.")  # fmt: skip


def apply_tiled_mlp(model: nn.Module, options: dict[str, Any]) -> int:
    """Tile the supported MLP modules of ``model`` as ``options`` ask; returns how many were tiled."""
    if not options.get("apply_tiled_mlp"):
        return 0
    shards = int(options.get("tiled_num_shards", DEFAULT_SHARDS))
    model_type = options.get("model_type")
    classes = {MLP_CLASSES[model_type]} if model_type else set(MLP_CLASSES.values())
    tiled = 0
    for found in model.modules():
        module: Any = found
        if type(module).__name__ in classes:
            module.tiled_shards = shards
            module.forward = types.MethodType(_tiled_forward, module)
            tiled += 1
    return tiled


def _tiled_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """The MLP on ``self.tiled_shards`` slices of the sequence (dim -2), each recomputed in the backward."""
    mlp = type(self).forward
    pieces = x.chunk(self.tiled_shards, dim=-2)
    if not torch.is_grad_enabled():
        return torch.cat([mlp(self, piece) for piece in pieces], dim=-2)
    return torch.cat([checkpoint(mlp, self, piece, use_reentrant=False) for piece in pieces], dim=-2)
