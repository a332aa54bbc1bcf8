"""Masked reductions shared by every module. Masks are 0/1 or bool, True = the token counts.

Empty masks give 0 (never NaN), so an all-padding micro-batch contributes nothing instead of poisoning a step.
"""

from __future__ import annotations

import torch


def is_set(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` as bool (non-zero: set; NaN counts as set, as in ``.bool()``). Written as a comparison rather than
    ``.bool()``: in a compiled graph Inductor's CPU code turns the comparison into vector instructions, but a
    float -> bool conversion into a scalar loop per vector (measured on a masked row sum at 128 x 4096, one
    thread: 0.08 against 1.7 ms)."""
    if _bytes_in_compiled_cpu_graph(mask.dtype, mask.device):
        return mask.to(torch.float32) != 0  # see mask_as
    return mask != 0


def mask_as(flags: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bool ``flags`` as a mask of ``dtype`` (0 / 1). In a compiled CPU graph Inductor's loops compare and write
    bytes one at a time, but convert between float32 and bytes in vector instructions: the fused path
    (:mod:`rl_core.fused`) hands a function its CPU bool masks as bytes, which :func:`is_set` reads and this writes
    through float32 (measured at 128 x 4096, one thread: a byte mask written 0.75 -> 0.05 ms, a masked row sum
    reading one 1.6 -> 0.06 ms)."""
    if _bytes_in_compiled_cpu_graph(dtype, flags.device):
        return torch.where(flags, 1.0, 0.0).to(torch.uint8)
    return flags.to(dtype)


def _bytes_in_compiled_cpu_graph(dtype: torch.dtype, device: torch.device) -> bool:
    """A byte mask (the fused path's form of a CPU bool mask, :mod:`rl_core.fused`) inside a compiled CPU graph."""
    return dtype == torch.uint8 and device.type == "cpu" and torch.compiler.is_compiling()


def any_set(mask: torch.Tensor) -> bool:
    """Whether ``mask`` sets any entry (one device sync), read as the largest of its bytes: ``Tensor.any`` of a
    128 x 4096 bool mask measured 0.37 ms on CPU (torch 2.13, one thread), the byte maximum 0.01 ms."""
    if mask.numel() == 0:
        return False
    flags = mask if mask.dtype == torch.bool else is_set(mask)
    return bool(flags.view(torch.uint8).max())


def as_float_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``mask`` as a 0/1 tensor of ``like``'s dtype and device."""
    return mask.to(device=like.device, dtype=like.dtype)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is set; masked-out NaN / Inf values do not leak in."""
    m = is_set(mask)
    zeros = torch.zeros((), dtype=values.dtype, device=values.device)
    picked = torch.where(m, values, zeros)
    return picked.sum() if dim is None else picked.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over entries where ``mask`` is set; 0 where nothing is set."""
    total = masked_sum(values, mask, dim)
    count = mask.to(values.dtype).sum() if dim is None else mask.to(values.dtype).sum(dim=dim)
    return total / count.clamp(min=1)


def segment_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per row of ``[B, T]`` ``values``: each run of consecutive set ``mask`` entries (a segment: one assistant turn
    of a multi-turn sample) replaced by its mean, broadcast over the run; 0 where the mask is not set. Gradients flow
    to every entry of a segment through its mean (ROLL's ``compute_segment_masked_mean``, vectorised)."""
    m = is_set(mask)
    starts = m & ~torch.nn.functional.pad(m[:, :-1], (1, 0), value=False)
    # segment ids 1.. within a row, 0 outside the mask; rows offset so that one index_add serves the batch
    ids = torch.cumsum(starts.to(torch.long), dim=-1) * m
    width = values.shape[-1] + 1
    flat = (ids + torch.arange(values.shape[0], device=values.device).unsqueeze(-1) * width).flatten()
    picked = torch.where(m, values, torch.zeros((), dtype=values.dtype, device=values.device)).flatten()
    sums = torch.zeros(values.shape[0] * width, dtype=values.dtype, device=values.device).index_add(0, flat, picked)
    counts = torch.zeros_like(sums).index_add(0, flat, m.flatten().to(values.dtype))
    means = (sums / counts.clamp(min=1))[flat].view_as(values)
    return torch.where(m, means, torch.zeros((), dtype=values.dtype, device=values.device))


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over masked entries (Bessel-corrected when ``unbiased`` and more than one entry)."""
    mean = masked_mean(values, mask)
    centered_sq = (values - mean) ** 2
    count = mask.to(values.dtype).sum()
    total = masked_sum(centered_sq, mask)
    if unbiased:
        return total / (count - 1).clamp(min=1)
    return total / count.clamp(min=1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Normalise masked entries to zero mean (if ``shift_mean``) and unit variance.

    Entries outside the mask are returned as 0 so they cannot leak into later sums.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(is_set(mask), whitened, torch.zeros_like(whitened))
