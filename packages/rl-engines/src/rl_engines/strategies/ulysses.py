"""Ulysses sequence parallelism (``model_args.ulysses_size``) for the HF models of fsdp2: the ranks of a Ulysses
group share their samples and split every packed row into contiguous slices of the sequence, one per rank.

Everything but attention is per token and runs on the slice. Attention is an all-to-all before and after
(DeepSpeed-Ulysses): each rank trades its slice of all heads for all of the sequence of its share of the heads, runs
the attention of the whole packed row (a sample attends only within itself: a block-diagonal causal mask on
CPU, flash-attention's varlen kernel on GPU), and trades back. The all-to-alls are autograd functions, so the
backward pass reaches every slice. The outputs that predict response tokens are gathered over the group, each rank's
gradient flowing back into its own slice only: every rank of a group computes the same loss, and the gradients
summed over the group are that loss's gradient once.

Over gloo (CPU) the all-to-alls use ``all_to_all_single``; nccl on GPU. The attention function is registered with
transformers as ``ulysses`` and gets the packed row's layout through the forward's keyword arguments.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rl_core.batch import RolloutBatch
from rl_engines.config import WorkerConfig
from rl_engines.strategies.model_io import response_log_probs
from rl_engines.strategies.packing import block_causal_mask, pack
from rl_engines.vision import is_visual

ATTENTION = "ulysses"


@dataclass(frozen=True)
class UlyssesGroups:
    """This rank's Ulysses group (``size`` consecutive ranks sharing samples) and its data-parallel group (the ranks
    of the same position in every Ulysses group: together they hold each sample once)."""

    size: int
    rank: int
    group: dist.ProcessGroup
    data_group: dist.ProcessGroup


def check_ulysses(size: int, world: int, heads: int | None, kv_heads: int | None, prefix: str) -> None:
    """ROLL's conditions on ``ulysses_size``, each an error naming ``<prefix>.ulysses_size`` (the head counts are
    checked when known)."""
    key = f"{prefix}.ulysses_size"
    if size < 1:
        raise ValueError(f"{key} must be >= 1, got {size}.")
    if world % size:
        raise ValueError(f"{key}={size} must divide the role's {world} ranks (len(device_mapping)).")
    if heads is not None and heads % size:
        raise ValueError(f"{key}={size} must divide the model's num_attention_heads ({heads}).")
    if kv_heads is not None and kv_heads % size and size % kv_heads:
        raise ValueError(f"{key}={size} and the model's num_key_value_heads ({kv_heads}) must divide one another.")


def model_heads(config: WorkerConfig) -> tuple[int | None, int | None]:
    """``(num_attention_heads, num_key_value_heads)`` from the role's model folder's config.json, or None each
    when it cannot be read yet (checked again when the model loads)."""
    path = Path(str(config.model_args.model_name_or_path or "")) / "config.json"
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError):
        return None, None
    text = values.get("text_config", values)
    heads = text.get("num_attention_heads")
    return heads, text.get("num_key_value_heads", heads)


def new_groups(size: int) -> UlyssesGroups:
    """Create the Ulysses and data-parallel groups of the default group (every rank calls this, in the same order)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = None
    for start in range(0, world, size):
        group = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            mine = group
    data: dist.ProcessGroup | None = None
    for offset in range(size):
        group = dist.new_group(list(range(offset, world, size)))
        if rank % size == offset:
            data = group
    assert mine is not None
    assert data is not None
    return UlyssesGroups(size, rank % size, mine, data)


# ---- collectives with autograd -------------------------------------------------------------------------------------
def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``x [u, ...]``: part i goes to rank i; returns ``[u, ...]`` with part i from rank i."""
    x = x.contiguous()
    out = torch.empty_like(x)  # contiguous too (empty_like keeps a view's strides)
    dist.all_to_all_single(out, x, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_to_all(grad, ctx.group), None


class _GatherSlices(torch.autograd.Function):
    """All-gather of equal slices along dim 0; the backward keeps this rank's slice of the gradient (every rank
    computes the same loss from the gathered tensor)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.rank, ctx.rows = dist.get_rank(group), x.shape[0]
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad[ctx.rank * ctx.rows : (ctx.rank + 1) * ctx.rows].contiguous(), None


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Autograd all-to-all of ``x [u, ...]`` over ``group`` (the backward sends the gradients back)."""
    return _AllToAll.apply(x, group)  # type: ignore[no-untyped-call, no-any-return]


def gather_slices(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Autograd all-gather of equal slices along dim 0; each rank's gradient flows into its own slice only."""
    return _GatherSlices.apply(x, group)  # type: ignore[no-untyped-call, no-any-return]


def heads_to_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[B, H, S/u, D]`` (all heads, this rank's slice) -> ``[B, H/u, S, D]`` (this rank's heads, all slices)."""
    size = dist.get_world_size(group)
    b, h, s, d = x.shape
    parts = x.reshape(b, size, h // size, s, d).permute(1, 0, 2, 3, 4)  # [u: destination, B, H/u, S/u, D]
    got = all_to_all(parts, group)  # [u: source slice, B, H/u, S/u, D]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * s, d)


def sequence_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[B, S, H/u, D]`` (this rank's heads, all slices) -> ``[B, S/u, H, D]`` (all heads, this rank's slice)."""
    size = dist.get_world_size(group)
    b, s, h, d = x.shape
    parts = x.reshape(b, size, s // size, h, d).permute(1, 0, 2, 3, 4)  # [u: destination slice, B, S/u, H/u, D]
    got = all_to_all(parts, group)  # [u: source head share, B, S/u, H/u, D]
    return got.permute(1, 2, 0, 3, 4).reshape(b, s // size, size * h, d)


# ---- the attention function ----------------------------------------------------------------------------------------
@dataclass
class _Row:
    group: dist.ProcessGroup
    positions: torch.Tensor
    """``[1, S]``: the position ids of the whole packed row (restarting per sample)."""
    kernel: str
    """``sdpa`` (with :meth:`mask`) or a flash-attention kernel (varlen by the position ids)."""
    config: Any
    """The model's config as the inner kernel must see it (``_attn_implementation`` = ``kernel``, not ``ulysses``)."""
    segments: torch.Tensor
    """``[1, S]``: the sample of each token (-1: fill)."""
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def local_tokens(self) -> torch.Tensor:
        """``[S/u]``: True for the real tokens (not fill) of this rank's slice of the row."""
        size = dist.get_world_size(self.group)
        length = self.segments.shape[1] // size
        start = dist.get_rank(self.group) * length
        return self.segments[0, start : start + length] != -1

    def mask(self, window: int | None) -> torch.Tensor:
        """sdpa: ``[1, 1, S, S]``, True where a token may attend: causal, within its own sample, and within
        ``window`` positions for a sliding-window layer; built once per row and window."""
        if window not in self.masks:
            self.masks[window] = block_causal_mask(self.segments.to(self.positions.device), window).unsqueeze(1)
        return self.masks[window]


class _Heads:
    """The attention module as the inner kernel should see it: this rank's share of query and key/value heads."""

    def __init__(self, module: nn.Module, groups: int, config: Any) -> None:
        self._module, self.num_key_value_groups, self.config = module, groups, config

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def ulysses_attention(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, **kwargs: Any,
) -> tuple[torch.Tensor, None]:  # fmt: skip
    """transformers' attention interface: ``query [B, H, S/u, D]``, ``key`` / ``value [B, Hkv, S/u, D]`` of this
    rank's slice -> ``[B, S/u, H, D]``."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    row = kwargs.pop("ulysses_row", None)
    if row is None:
        raise RuntimeError("the ulysses attention runs only in rl_engines' Ulysses forward (ulysses_outputs)")
    size = dist.get_world_size(row.group)
    if key.shape[1] < size:  # fewer key/value heads than ranks: every rank needs whole ones
        repeat = size // key.shape[1]
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    query, key, value = (heads_to_sequence(t, row.group) for t in (query, key, value))
    heads = _Heads(module, query.shape[1] // key.shape[1], row.config)
    kwargs.pop("position_ids", None)
    if row.kernel == "sdpa":  # sdpa reads the sliding window of a layer from its mask only
        mask = row.mask(kwargs.pop("sliding_window", None))
        out, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](heads, query, key, value, mask, **kwargs)
    else:
        out, _ = ALL_ATTENTION_FUNCTIONS[row.kernel](heads, query, key, value, None,
                                                     position_ids=row.positions, **kwargs)  # fmt: skip
    return sequence_to_heads(out, row.group), None


def register_attention() -> None:
    """Register :func:`ulysses_attention` with transformers as ``ulysses`` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, ulysses_attention)


# ---- a micro-batch through the group ---------------------------------------------------------------------------------
def ulysses_outputs(
    model: nn.Module, batch: RolloutBatch, device: torch.device, groups: UlyssesGroups, *, kernel: str,
    value_head: bool, temperature: float, with_entropy: bool,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """``batch`` (the same on every rank of the group) packed, this rank's slice through ``model`` (whose attention
    is ``ulysses``), the outputs gathered over the group: ``[B, R]`` each, as :func:`packing.packed_outputs`.
    The row's layout travels with the forward's keyword arguments to every attention call (activation
    recomputation in the backward gets it the same way)."""
    if is_visual(batch):
        raise ValueError(
            "model_args.ulysses_size > 1 on a vision-language batch: Ulysses splits packed rows, which do not carry "
            "the pictures' inputs yet; set ulysses_size: 1 for a vision-language model."
        )
    packed = pack(batch, groups.size)
    config: Any = copy.copy(getattr(model, "config"))  # noqa: B009  (a module attribute, not a tensor)
    config._attn_implementation = kernel
    row = _Row(groups.group, packed.position_ids.to(device), kernel, config, packed.segments)
    length = packed.tokens // groups.size
    part = slice(groups.rank * length, (groups.rank + 1) * length)
    ids, positions = packed.input_ids[:, part].to(device), packed.position_ids[:, part].to(device)
    out = model(input_ids=ids, position_ids=positions, use_cache=False, ulysses_row=row).logits[0]  # [S/u, V]
    if value_head:
        values = gather_slices(out[:, 0].float(), groups.group)
        return {"values": packed.scatter(values[packed.rows.to(device)])}
    targets = torch.cat([packed.input_ids[0, 1:], packed.input_ids.new_zeros(1)])[part].to(device)
    log_probs, entropy = response_log_probs(out.unsqueeze(0), targets.unsqueeze(0), temperature=temperature,
                                            with_entropy=with_entropy)  # fmt: skip
    rows = packed.rows.to(device)
    outputs = {"log_probs": packed.scatter(gather_slices(log_probs[0], groups.group)[rows])}
    if entropy is not None:
        outputs["entropy"] = packed.scatter(gather_slices(entropy[0], groups.group)[rows])
    return outputs
