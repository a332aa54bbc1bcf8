"""Flash-attention's variable-length kernel without the flash_attn package: PyTorch's own
``torch.nn.attention.varlen.varlen_attn`` (CUDA builds of torch 2.10 and later ship the flash-attention-2 kernels),
registered with transformers as the attention implementation ``torch_varlen`` (a name without "flash": transformers
treats those as flash_attn or hub kernels to import).

A worker asked for ``fa2`` (``attn_implementation`` / ``flash_attn``) on a CUDA device without flash_attn runs this
instead of falling back to sdpa: padding and packing are removed the same way flash-attention-2 does in transformers.
The tokens of every sequence are gathered into one ``[T, H, D]`` run with cumulative sequence bounds
(:func:`sequence_bounds`): from the 2-D padding mask when there is one, else from the position ids restarting at 0
(a packed row), else one sequence per row; the kernel attends within each sequence only (causally, aligned to the
sequence's last key as flash-attention is, so one query against a longer cache decodes), and the outputs go back to
their padded places (0 at padding).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

TORCH_FLASH = "torch_varlen"
"""The transformers attention implementation name this module registers."""


def available() -> bool:
    """True when torch ships the varlen kernel and the CUDA device can run it (flash-attention-2: Ampere or newer)."""
    if not torch.cuda.is_available() or importlib.util.find_spec("torch.nn.attention.varlen") is None:
        return False
    return torch.cuda.get_device_capability() >= (8, 0)


def sequence_bounds(
    batch: int, queries: int, keys: int, mask: torch.Tensor | None, positions: torch.Tensor | None,
    device: torch.device | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Where the sequences are: ``(query_index, key_index, cu_q, cu_k)``. The indices pick the real tokens out of the
    flattened ``[batch * queries]`` / ``[batch * keys]`` tokens in sequence order; ``cu_q`` / ``cu_k`` (int32,
    ``[N + 1]``) are the sequences' cumulative lengths. ``mask [batch, >= keys]`` (True = a real token; its last
    ``keys`` columns are the keys', its last ``queries`` the queries'), else ``positions [batch, queries]`` restarting
    at 0 for every packed sequence (keys = queries), else one sequence per row. Everything is built on ``device``
    (the queries'; default: the mask's or the positions')."""
    given = mask if mask is not None else positions
    device = device or (given.device if given is not None else torch.device("cpu"))
    if mask is not None:
        q_lengths, k_lengths, q_index, k_index = _by_mask(mask, queries, keys, device)
    elif positions is not None and queries == keys:
        starts = positions.flatten().to(device) == 0
        starts[:: positions.shape[1]] = True  # every row starts a sequence
        first = starts.nonzero().flatten()
        q_lengths = k_lengths = torch.diff(first, append=first.new_tensor([positions.numel()]))
        q_index = k_index = torch.arange(positions.numel(), device=device)
    else:
        q_lengths = torch.full((batch,), queries, device=device)
        k_lengths = torch.full((batch,), keys, device=device)
        q_index = torch.arange(batch * queries, device=device)
        k_index = torch.arange(batch * keys, device=device)
    return q_index, k_index, _cumulative(q_lengths), _cumulative(k_lengths)


def _by_mask(mask: torch.Tensor, queries: int, keys: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Lengths and token indices of the sequences a 2-D padding mask marks (see :func:`sequence_bounds`)."""
    if mask.shape[1] < keys:
        raise ValueError(
            f"a padding mask of {mask.shape[1]} columns for {keys} keys (a static KV cache): torch_varlen runs with "
            "transformers' dynamic cache only; use attn_implementation: sdpa."
        )
    mask = mask[:, -keys:].to(device=device, dtype=torch.bool)
    q_mask = mask[:, -queries:]
    return q_mask.sum(1), mask.sum(1), q_mask.flatten().nonzero().flatten(), mask.flatten().nonzero().flatten()


def _cumulative(lengths: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)


@dataclass(frozen=True)
class Bounds:
    """:func:`sequence_bounds` and the longest query / key sequence, as one attention call uses them."""

    q_index: torch.Tensor
    k_index: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int


class _LastBounds:
    """The bounds of the last (mask, positions) seen: every layer of a forward passes the same two tensors, so the
    sequences are found (and their longest lengths read back to the host, a device synchronisation) once per forward
    instead of once per layer. A hit needs the very tensor objects (held by weak reference: a new tensor is never
    mistaken for a dead one at the same address) unchanged since (their version counters), and the same shapes and
    device."""

    def __init__(self) -> None:
        self.key: tuple[Any, ...] | None = None
        self.refs: tuple[Callable[[], Any], ...] = ()
        self.bounds: Bounds | None = None

    def get(self, shape: tuple[int, int, int], mask: torch.Tensor | None, positions: torch.Tensor | None,
            device: torch.device) -> Bounds:  # fmt: skip
        tensors = (mask, positions)
        # inference-mode tensors keep no version counter: their bounds are found every time
        cacheable = not any(t is not None and t.is_inference() for t in tensors)
        key = (
            (shape, device, *((None, None) if t is None else (id(t), t._version) for t in tensors))
            if cacheable
            else None
        )
        if key is not None and key == self.key and all(ref() is t for ref, t in zip(self.refs, tensors, strict=True)):
            assert self.bounds is not None
            return self.bounds
        q_index, k_index, cu_q, cu_k = sequence_bounds(*shape, mask, positions, device)
        self.bounds = Bounds(q_index, k_index, cu_q, cu_k, int(torch.diff(cu_q).max()), int(torch.diff(cu_k).max()))
        self.key, self.refs = key, tuple(_weak(t) for t in tensors)
        return self.bounds


def _weak(tensor: torch.Tensor | None) -> Callable[[], Any]:
    return (lambda: None) if tensor is None else weakref.ref(tensor)


LAST_BOUNDS = _LastBounds()


@functools.cache
def _kernel_options() -> frozenset[str]:
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def torch_varlen_kernel(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
    max_q: int, max_k: int, *, scale: float | None, causal: bool, window: int | None,
) -> torch.Tensor:  # fmt: skip
    """PyTorch's varlen flash-attention on ``[T, H, D]`` runs; its keyword names differ between torch releases
    (``is_causal`` in 2.10 / 2.11, ``window_size`` later), so they are read from its signature."""
    from torch.nn.attention.varlen import varlen_attn

    if query.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"flash-attention kernels run in bf16 / fp16, and this model computes in {query.dtype}; "
                         "set model_args.dtype: bf16 (or attn_implementation: sdpa).")  # fmt: skip
    if query.shape[-1] > 256:
        raise ValueError(f"flash-attention kernels take heads of at most 256 dimensions; this model's have "
                         f"{query.shape[-1]}. Use attn_implementation: sdpa for it.")  # fmt: skip
    options = _kernel_options()
    kwargs: dict[str, Any] = {}
    if "scale" in options:
        kwargs["scale"] = scale
    elif scale is not None and abs(scale - query.shape[-1] ** -0.5) > 1e-12:
        raise ValueError(f"this model scales attention by {scale}, and torch {torch.__version__}'s varlen_attn takes "
                         "no scale (only 1/sqrt(head_dim)); use attn_implementation: sdpa.")  # fmt: skip
    if "window_size" in options:
        kwargs["window_size"] = (-1 if window is None else window - 1, 0) if causal else (-1, -1)
    elif window is not None:
        raise ValueError(f"a sliding window needs torch's varlen_attn with window_size; torch {torch.__version__} "
                         "has none. Use attn_implementation: sdpa for this model.")  # fmt: skip
    else:
        kwargs["is_causal"] = causal
    if key.shape[1] != query.shape[1]:  # grouped-query attention
        if "enable_gqa" in options:
            kwargs["enable_gqa"] = True
        else:
            repeat = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    out = varlen_attn(query, key, value, cu_q, cu_k, max_q, max_k, **kwargs)
    return out[0] if isinstance(out, tuple) else out


Kernel = Callable[..., torch.Tensor]


def varlen_attention(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
    sliding_window: int | None = None, softcap: float | None = None, kernel: Kernel = torch_varlen_kernel,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:  # fmt: skip
    """transformers' attention interface: ``query [B, H, Lq, D]``, ``key`` / ``value [B, Hkv, Lk, D]`` ->
    ``[B, Lq, H, D]``. ``attention_mask`` is the 2-D padding mask (or None) that transformers' flash-attention mask
    function gives; ``kernel`` is the varlen kernel (PyTorch's unless a test gives a reference one)."""
    if dropout:
        raise ValueError(f"{TORCH_FLASH} has no attention dropout ({dropout}); set the model's attention_dropout "
                         "to 0 or use attn_implementation: sdpa.")  # fmt: skip
    if softcap is not None:
        raise ValueError(f"{TORCH_FLASH} has no logit soft-capping; use attn_implementation: sdpa for this model.")
    batch, heads, queries, dim = query.shape
    keys = key.shape[2]
    positions = kwargs.get("position_ids")  # 2-D (a VL model passes its text row), or None
    bounds = LAST_BOUNDS.get((batch, queries, keys), attention_mask, positions, query.device)
    q = query.transpose(1, 2).reshape(batch * queries, heads, dim)[bounds.q_index]
    k, v = (t.transpose(1, 2).reshape(batch * keys, t.shape[1], -1)[bounds.k_index] for t in (key, value))
    flag = kwargs.get("is_causal")  # transformers may pass None: the module's own setting then
    causal = bool(getattr(module, "is_causal", True) if flag is None else flag)
    out = kernel(q, k, v, bounds.cu_q, bounds.cu_k, bounds.max_q, bounds.max_k, scale=scaling, causal=causal,
                 window=sliding_window)  # fmt: skip
    full = out.new_zeros(batch * queries, heads, out.shape[-1])
    full[bounds.q_index] = out
    return full.reshape(batch, queries, heads, -1), None


def register(kernel: Kernel = torch_varlen_kernel, name: str = TORCH_FLASH) -> str:
    """Register :func:`varlen_attention` (with ``kernel``) with transformers as ``name``, with flash-attention's mask
    function (the 2-D padding mask, None when there is no padding); idempotent. Returns ``name``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(name, functools.partial(varlen_attention, kernel=kernel))
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name
