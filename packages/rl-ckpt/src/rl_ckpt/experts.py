"""Fused expert tensors: HF files that stack a MoE layer's experts into two tensors (Qwen3-VL-MoE).

Such a layer stores ``<prefix>.experts.gate_up_proj`` ``[E, 2I, H]`` (expert e's gate rows on its up rows, as
transformers 5 holds them and saves them) and ``<prefix>.experts.down_proj`` ``[E, H, I]``. The files Qwen released
with transformers 4.57 store both transposed (``[E, H, 2I]``, ``[E, I, H]``); transformers transposes on load when
the shape asks for it, and so does :func:`split_fused` (a square matrix is taken as stored, as transformers does).

The rest of rl-ckpt and the Megatron strategies work with per-expert names (``<prefix>.experts.<e>.gate_proj
.weight`` / ``up_proj`` / ``down_proj``, the Qwen3-MoE files' names): :func:`split_fused` gives those as views of a
fused tensor (lazy on-disk tensors stay lazy), :func:`stack_experts` builds the fused pair from Megatron's
per-expert ``linear_fc1`` / ``linear_fc2``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from rl_ckpt.errors import CheckpointError
from rl_ckpt.sources import Source, cat

FUSED = re.compile(r"(?P<prefix>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)")
"""A fused expert tensor's name."""


def split_fused(name: str, tensor: torch.Tensor, hidden: int, inter: int) -> list[tuple[str, torch.Tensor]] | None:
    """The per-expert tensors (name, view) of fused tensor ``name`` (``hidden``: H, ``inter``: an expert's I), in
    expert order; None when ``name`` is not a fused expert tensor. A shape that fits neither layout raises naming
    the tensor."""
    match = FUSED.fullmatch(name)
    if match is None:
        return None
    prefix, proj = match["prefix"], match["proj"]
    rows = 2 * inter if proj == "gate_up_proj" else hidden
    cols = hidden if proj == "gate_up_proj" else inter
    shape = tuple(tensor.shape)
    if len(shape) != 3 or shape[1:] not in ((rows, cols), (cols, rows)):
        raise CheckpointError(
            f"tensor {name} has shape {shape}; a fused expert tensor of this model is [experts, {rows}, {cols}] "
            f"(or [experts, {cols}, {rows}] as transformers 4 saved it)"
        )
    stored = tensor if shape[1:] == (rows, cols) else tensor.transpose(1, 2)
    out = []
    for expert in range(shape[0]):
        if proj == "down_proj":
            out.append((f"{prefix}.{expert}.down_proj.weight", stored[expert]))
        else:
            out += [(f"{prefix}.{expert}.gate_proj.weight", stored[expert, :inter]),
                    (f"{prefix}.{expert}.up_proj.weight", stored[expert, inter:])]  # fmt: skip
    return out


def router_name(name: str) -> str:
    """For fused tensor ``name``, its layer's router (``<...>.mlp.gate.weight``), which sits where the layer does on
    every expert-parallel rank: where only the location matters (which pipeline stage holds the layer); other names
    unchanged."""
    match = FUSED.fullmatch(name)
    return name if match is None else f"{match['prefix'].removesuffix('.experts')}.gate.weight"


def stack_experts(fc1: Sequence[Source], fc2: Sequence[Source]) -> tuple[Source, Source]:
    """``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` from each expert's Megatron ``linear_fc1`` ``[2I, H]``
    (gate rows on up rows, as one TP rank holds them) and ``linear_fc2`` ``[H, I]``; views stay unread."""

    def stacked(parts: Sequence[Source]) -> Source:
        if not all(isinstance(part, torch.Tensor) for part in parts):
            raise CheckpointError("fused expert tensors are stacked from one tensor per expert (views or in memory)")
        return cat([part.unsqueeze(0) for part in parts], 0)  # type: ignore[union-attr]

    return stacked(fc1), stacked(fc2)
