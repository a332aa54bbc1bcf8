"""Tensors not read yet: checkpoint tensors left on disk, and concatenations not computed.

A checkpoint tensor is opened as a meta-device tensor whose storage records the file and the byte offset of the
storage's first byte (:func:`on_disk`). Slicing, ``narrow``, ``select`` and reshaping views of it work as on any
tensor and read nothing. :class:`Concat` stands for ``torch.cat(parts, dim)`` (TP shards merged, a fused QKV split
into q, k, v) without copying. A :data:`Source` is either, or a tensor in memory.

The writers (``stream_io``) copy a source's bytes from the file straight into their output buffer, so a
conversion allocates no tensor of the model's size; :func:`materialize` reads a source into a fresh tensor for
callers that want real tensors (``iter_hf_tensors``, ``--verify``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TypeAlias

import torch

_FILE_ATTR = "_rl_ckpt_file"
"""Attribute set on a meta storage: ``(path, byte offset of the storage's first byte in the file)``."""


class Concat:
    """``torch.cat(parts, dim)``, not computed; ``parts`` are sources with equal sizes but along ``dim``."""

    def __init__(self, parts: Sequence[Source], dim: int) -> None:
        shapes = [shape_of(p) for p in parts]
        first = shapes[0]
        if not 0 <= dim < len(first):
            raise ValueError(f"Concat: dim {dim} out of range for shape {first}")
        for s in shapes[1:]:
            if len(s) != len(first) or any(a != b for i, (a, b) in enumerate(zip(s, first)) if i != dim):
                raise ValueError(f"Concat: shapes {shapes} do not concatenate along dim {dim}")
        dtypes = {dtype_of(p) for p in parts}
        if len(dtypes) != 1:
            raise ValueError(f"Concat: parts of different dtypes {dtypes}")
        self.parts = tuple(parts)
        self.dim = dim
        self.dtype: torch.dtype = dtypes.pop()
        self.shape = (*first[:dim], sum(s[dim] for s in shapes), *first[dim + 1 :])

    def __repr__(self) -> str:
        return f"Concat(dim={self.dim}, shape={self.shape}, parts={len(self.parts)})"


Source: TypeAlias = torch.Tensor | Concat
"""A tensor in memory, a meta-device view of a tensor on disk (:func:`on_disk`), or a :class:`Concat` of sources."""


def on_disk(meta: torch.Tensor, path: Path | str, offset: int) -> torch.Tensor:
    """Mark meta tensor ``meta`` as stored in ``path``, its storage starting at byte ``offset``; returns it.

    Views of ``meta`` share its storage and so its location.
    """
    if meta.device.type != "meta":
        raise ValueError("on_disk expects a meta-device tensor")
    setattr(meta.untyped_storage(), _FILE_ATTR, (str(path), int(offset)))
    return meta


def disk_location(t: torch.Tensor) -> tuple[str, int] | None:
    """``(path, byte offset of the storage)`` of a tensor marked by :func:`on_disk`, else None."""
    if t.device.type != "meta":
        return None
    loc: tuple[str, int] | None = getattr(t.untyped_storage(), _FILE_ATTR, None)
    return loc


def shape_of(src: Source) -> tuple[int, ...]:
    """Shape of a source."""
    return tuple(src.shape)


def dtype_of(src: Source) -> torch.dtype:
    """dtype of a source."""
    return src.dtype


def nbytes_of(src: Source) -> int:
    """Bytes the source's data take once contiguous."""
    return math.prod(shape_of(src)) * torch.empty((), dtype=dtype_of(src), device="meta").element_size()


def cat(parts: Sequence[Source], dim: int) -> Source:
    """The only part itself, else a :class:`Concat` (nested concatenations along the same dim are flattened)."""
    flat: list[Source] = []
    for p in parts:
        flat.extend(p.parts if isinstance(p, Concat) and p.dim == dim else (p,))
    return flat[0] if len(flat) == 1 else Concat(flat, dim)


def rows(src: Source, start: int, stop: int) -> Source:
    """``src[start:stop]`` (along dim 0); a 0-d source is its own single row."""
    if not isinstance(src, Concat):
        return src if src.dim() == 0 else src[start:stop]
    if src.dim != 0:
        return Concat([rows(p, start, stop) for p in src.parts], src.dim)
    out: list[Source] = []
    at = 0
    for p in src.parts:
        n = shape_of(p)[0]
        lo, hi = max(start, at), min(stop, at + n)
        if lo < hi:
            out.append(rows(p, lo - at, hi - at))
        at += n
    if not out:
        return rows(src.parts[0], 0, 0)
    return cat(out, 0)


def split_rows(src: Source, sizes: Sequence[int]) -> list[Source]:
    """``torch.split(src, sizes)`` along dim 0, as views / concatenations of views."""
    out, at = [], 0
    for n in sizes:
        out.append(rows(src, at, at + n))
        at += n
    return out


def file_spans(src: Source) -> list[tuple[str, int, int]]:
    """(path, first byte, end byte) of the file range each on-disk part of ``src`` reads (its rows and the gaps
    between them)."""
    if isinstance(src, Concat):
        return [span for p in src.parts for span in file_spans(p)]
    loc = disk_location(src)
    if loc is None or src.numel() == 0:
        return []
    item = src.element_size()
    start = loc[1] + int(src.storage_offset()) * item
    reach = sum((n - 1) * int(s) for n, s in zip(src.shape, src.stride())) + 1
    return [(loc[0], start, start + reach * item)]


def materialize(src: Source) -> torch.Tensor:
    """The source as a tensor in memory: itself when it is one, else read / concatenated into a fresh tensor."""
    if isinstance(src, torch.Tensor) and disk_location(src) is None:
        return src
    if isinstance(src, Concat) and not any(_reads(p) for p in src.parts):
        return torch.cat([materialize(p) for p in src.parts], src.dim)
    from rl_ckpt.stream_io import FileReader, read_source

    with FileReader() as reader:
        return read_source(src, reader)


def _reads(src: Source) -> bool:
    if isinstance(src, Concat):
        return any(_reads(p) for p in src.parts)
    return disk_location(src) is not None
