"""Pure tensor math between HF and Megatron-core layouts (no I/O).

Notation: H = hidden size, d = head dim, nq = query heads, g = query groups (key/value heads), r = nq // g,
F = ffn hidden size, V = vocabulary size, Vp = padded vocabulary size, tp = tensor-parallel size.
"""

from __future__ import annotations

import torch

from rl_ckpt.errors import CheckpointError
from rl_ckpt.sources import Source, cat, rows, shape_of


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's ``_vocab_size_with_padding``: V rounded up to a multiple of ``divisible_by * tp``."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """[V, H] -> [rows, H], new rows zero (Megatron never reads them: the tokenizer has no such ids)."""
    if t.shape[0] == rows:
        return t
    pad = torch.zeros((rows - t.shape[0], *t.shape[1:]), dtype=t.dtype)
    return torch.cat([t, pad])


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """HF q [nq*d, ...], k [g*d, ...], v [g*d, ...] -> Megatron linear_qkv [g*(r+2)*d, ...].

    Rows are grouped per query group: the group's r query heads, then its key head, then its value head. Works for
    weights ([., H]) and biases ([.]). Splitting the result into tp equal row blocks gives each rank its groups.
    """
    tail = q.shape[1:]
    qg = q.reshape(groups, -1, *tail)  # [g, r*d, ...]
    kg = k.reshape(groups, -1, *tail)  # [g, d, ...]
    vg = v.reshape(groups, -1, *tail)  # [g, d, ...]
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *tail)


def split_qkv(fused: torch.Tensor, groups: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`: [g*(r+2)*d, ...] -> q [nq*d, ...], k [g*d, ...], v [g*d, ...] (contiguous)."""
    tail = fused.shape[1:]
    per_group = fused.reshape(groups, -1, *tail)  # [g, (r+2)*d, ...]
    q_rows = per_group.shape[1] - 2 * head_dim
    q, k, v = torch.split(per_group, [q_rows, head_dim, head_dim], dim=1)
    return q.reshape(-1, *tail).contiguous(), k.reshape(-1, *tail).contiguous(), v.reshape(-1, *tail).contiguous()


def compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous and owning exactly its bytes: ``torch.save`` writes a view's whole storage, so a row block
    of a bigger tensor saved as is would carry every other rank's rows too."""
    if not t.is_contiguous():
        return t.contiguous()
    if t.untyped_storage().nbytes() > t.numel() * t.element_size():
        return t.clone()
    return t


def split(t: torch.Tensor, tp: int, dim: int, name: str) -> list[torch.Tensor]:
    """``t`` cut into tp equal blocks along ``dim``, each compact (see :func:`compact`); raises when it does not
    divide evenly."""
    if t.shape[dim] % tp:
        raise CheckpointError(f"{name}: dimension {dim} of shape {tuple(t.shape)} does not divide by TP={tp}")
    return [compact(c) for c in torch.chunk(t, tp, dim=dim)]


def fuse_fc1(gate: torch.Tensor, up: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """HF gate [F, H], up [F, H] -> per rank linear_fc1 [2*F/tp, H] = this rank's gate rows stacked on its up rows."""
    gates = split(gate, tp, 0, "gate_proj")
    ups = split(up, tp, 0, "up_proj")
    return [torch.cat([g, u]) for g, u in zip(gates, ups)]


def split_fc1(shards: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_fc1`: tp shards [2*F/tp, H] -> gate [F, H], up [F, H]."""
    halves = [torch.chunk(s, 2, dim=0) for s in shards]
    return torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])


def qkv_parts(fused: Source, groups: int, head_dim: int) -> tuple[Source, Source, Source]:
    """:func:`split_qkv` without copying: q, k, v as concatenations of ``fused``'s row blocks (one per group)."""
    per_group = shape_of(fused)[0] // groups
    q_rows = per_group - 2 * head_dim
    parts: tuple[list[Source], list[Source], list[Source]] = ([], [], [])
    for g in range(groups):
        start = g * per_group
        for out, lo, hi in zip(parts, (0, q_rows, q_rows + head_dim), (q_rows, q_rows + head_dim, per_group)):
            out.append(rows(fused, start + lo, start + hi))
    return cat(parts[0], 0), cat(parts[1], 0), cat(parts[2], 0)


def fc1_parts(shards: list[Source]) -> tuple[Source, Source]:
    """:func:`split_fc1` without copying: gate, up as concatenations of each shard's halves."""
    halves = [shape_of(s)[0] // 2 for s in shards]
    gate = cat([rows(s, 0, h) for s, h in zip(shards, halves)], 0)
    up = cat([rows(s, h, 2 * h) for s, h in zip(shards, halves)], 0)
    return gate, up


def fuse_qkv_parts(q: Source, k: Source, v: Source, groups: int) -> Source:
    """:func:`fuse_qkv` without copying: per group its q rows, k rows, v rows, concatenated."""
    rq, rk = shape_of(q)[0] // groups, shape_of(k)[0] // groups
    parts: list[Source] = []
    for g in range(groups):
        parts += [rows(q, g * rq, (g + 1) * rq), rows(k, g * rk, (g + 1) * rk), rows(v, g * rk, (g + 1) * rk)]
    return cat(parts, 0)
