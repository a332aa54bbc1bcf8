"""Reading sources: the bytes of file-backed views and concatenations (``sources``) put where a writer wants them.

Why not memory-map the inputs and copy tensors out (what rl-ckpt did first)? Profiled on the project's 2-core VM
(README, Benchmark): touching a cold memory-mapped file ran at ~0.85 GB/s where large ``preadv`` calls read the same
file at ~2.4 GB/s, and every freshly allocated page (a merged tensor) cost ~0.3-1 GB/s to touch, where a reused
buffer takes ~16 GB/s. So :class:`FileReader` fills a destination (a row range of a write buffer, see
``staged_file``) with ``preadv`` calls of whole runs of rows, and :class:`Prefetcher` asks the kernel for the
ranges ahead (``POSIX_FADV_WILLNEED``) so that the disk has many requests in flight.
"""

from __future__ import annotations

import ctypes
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from rl_ckpt.errors import CheckpointError
from rl_ckpt.sources import Concat, Source, disk_location, dtype_of, file_spans, nbytes_of, shape_of

_IOV_MAX = 1024


def u8_view(t: torch.Tensor) -> tuple[torch.Tensor, memoryview]:
    """(1-D uint8 tensor, memoryview) over the memory of contiguous CPU tensor ``t``."""
    flat = t.view(-1).view(torch.uint8)
    array = (ctypes.c_char * flat.numel()).from_address(flat.data_ptr())
    return flat, memoryview(array).cast("B")


@dataclass(frozen=True)
class Dest:
    """``rows`` rows of ``row_bytes`` bytes, row i at byte ``offset + i * stride`` of a buffer (tensor + view)."""

    tensor: torch.Tensor
    """1-D uint8 over the whole buffer."""
    view: memoryview
    offset: int
    rows: int
    row_bytes: int
    stride: int

    def as_tensor(self) -> torch.Tensor:
        """The destination as a uint8 [rows, row_bytes] tensor."""
        return self.tensor.as_strided((self.rows, self.row_bytes), (self.stride, 1), self.offset)


_GRAIN = 32768
"""torch's ``parallel_for`` grain: a copy of fewer elements runs on the calling thread."""


def copy_rows(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for uint8 [rows, n] tensors with contiguous rows, in pieces below torch's grain so that
    no thread pool is involved (its workers stall when other processes load the host), through the widest integer
    type the layout allows."""
    rows, n = dst.shape
    for size, dtype in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        offsets = (dst.storage_offset(), src.storage_offset(), dst.stride(0), src.stride(0), n)
        if all(int(x) % size == 0 for x in offsets):
            dst, src, n = dst.view(dtype), src.view(dtype), n // size
            break
    per_row = max(1, _GRAIN // n)
    per_col = min(n, _GRAIN)
    for lo in range(0, rows, per_row):
        for col in range(0, n, per_col):
            dst[lo : lo + per_row, col : col + per_col].copy_(src[lo : lo + per_row, col : col + per_col])


class FileReader:
    """Open files by path (kept open until :meth:`close`) and fills destinations from file-backed sources.

    Rows contiguous in the file and in the destination are one ``preadv`` straight into the destination; other
    runs of rows (column slices, rows going to columns of the output) are read span by span (up to
    ``scratch_bytes``) into a reused scratch buffer and copied out with :func:`copy_rows`.
    """

    def __init__(self, scratch_bytes: int = 8 << 20) -> None:
        self._fds: dict[str, int] = {}
        self.scratch_bytes = scratch_bytes
        self._scratch: tuple[torch.Tensor, memoryview] | None = None

    def __enter__(self) -> FileReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every file opened."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def _fd(self, path: str) -> int:
        if path not in self._fds:
            try:
                self._fds[path] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except OSError as err:
                raise CheckpointError(f"cannot read {path}: {err.strerror}") from None
        return self._fds[path]

    def prefetch(self, sources: Iterable[Source], merge_gap: int = 1 << 20) -> None:
        """Ask the kernel to start reading every file range ``sources`` will read (``POSIX_FADV_WILLNEED``): the
        disk then works on many requests at once instead of one ``preadv`` at a time, and the reads that follow
        find their pages in the page cache. Ranges closer than ``merge_gap`` are asked for as one. See
        :class:`Prefetcher` for a window over a long list."""
        spans = sorted(span for src in sources for span in file_spans(src))
        merged: list[list[Any]] = []
        for path, start, end in spans:
            if merged and merged[-1][0] == path and start <= merged[-1][2] + merge_gap:
                merged[-1][2] = max(merged[-1][2], end)
            else:
                merged.append([path, start, end])
        for path, start, end in merged:
            os.posix_fadvise(self._fd(path), start, end - start, os.POSIX_FADV_WILLNEED)

    def _scratch_of(self, size: int) -> tuple[torch.Tensor, memoryview]:
        if self._scratch is None or self._scratch[0].numel() < size:
            self._scratch = u8_view(torch.empty(-(-max(size, self.scratch_bytes) // 8) * 8, dtype=torch.uint8))
        return self._scratch

    def read_rows(self, t: torch.Tensor, dest: Dest) -> None:
        """Fill ``dest`` with file-backed tensor ``t`` ([rows, ...], its rows matching ``dest``'s)."""
        loc = disk_location(t)
        assert loc is not None
        flat = t.reshape(1, 1) if t.dim() == 0 else t.unsqueeze(1) if t.dim() == 1 else t.flatten(1)
        if disk_location(flat) is None or (flat.shape[1] > 1 and flat.stride(1) != 1):
            self._read_strided(t, loc, dest)  # not a view with contiguous rows (rare): read the span, gather
            return
        size = dest.row_bytes
        start = loc[1] + int(flat.storage_offset()) * t.element_size()
        step = int(flat.stride(0)) * t.element_size() if dest.rows > 1 else size
        if step < size:
            self._read_strided(t, loc, dest)
        elif step == size and dest.stride == size:
            self._preadv(loc[0], [dest.view[dest.offset : dest.offset + dest.rows * size]], start)
        else:
            per = max(1, self.scratch_bytes // step)
            for lo in range(0, dest.rows, per):
                k = min(per, dest.rows - lo)
                span = (k - 1) * step + size
                scratch, view = self._scratch_of(span)
                self._preadv(loc[0], [view[:span]], start + lo * step)
                part = replace(dest, offset=dest.offset + lo * dest.stride, rows=k)
                copy_rows(part.as_tensor(), scratch.as_strided((k, size), (step, 1)))

    def _read_strided(self, t: torch.Tensor, loc: tuple[str, int], dest: Dest) -> None:
        item = t.element_size()
        reach = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0) + 1
        span = torch.empty(reach * item, dtype=torch.uint8)
        flat, view = u8_view(span)
        self._preadv(loc[0], [view], loc[1] + int(t.storage_offset()) * item)
        typed = flat.view(t.dtype).as_strided(t.shape, t.stride(), 0)
        copy_rows(dest.as_tensor(), typed.contiguous().reshape(dest.rows, -1).view(torch.uint8))

    def _preadv(self, path: str, iovs: list[memoryview], offset: int) -> None:
        fd = self._fd(path)
        for lo in range(0, len(iovs), _IOV_MAX):
            batch = iovs[lo : lo + _IOV_MAX]
            want = sum(map(len, batch))
            while want:
                got = os.preadv(fd, batch, offset)
                if got == 0:
                    raise CheckpointError(f"{path} ends before byte {offset + want}: the file is truncated")
                offset, want = offset + got, want - got
                while batch and got >= len(batch[0]):
                    got -= len(batch[0])
                    batch = batch[1:]
                if got:
                    batch[0] = batch[0][got:]


class Prefetcher:
    """Prefetches ``sources`` in order, keeping the ranges asked for ``window`` bytes ahead of the one being read
    (not a whole 5 GB shard at once: pages read too early could be evicted before they are used)."""

    def __init__(self, reader: FileReader, sources: Sequence[Source], window: int = 256 << 20) -> None:
        self.reader, self.sources, self.window = reader, sources, window
        self._asked = 0  # sources[: self._asked] were prefetched
        self._ahead = 0  # their bytes from the current one on

    def before(self, i: int) -> None:
        """Call before reading ``sources[i]`` (in increasing order)."""
        if i > 0:
            self._ahead -= nbytes_of(self.sources[i - 1])
        start = self._asked
        while self._asked < len(self.sources) and (self._asked <= i or self._ahead < self.window):
            self._ahead += nbytes_of(self.sources[self._asked])
            self._asked += 1
        if self._asked > start:
            self.reader.prefetch(self.sources[start : self._asked])


def fill(src: Source, dest: Dest, reader: FileReader) -> None:
    """Write the bytes of ``src`` ([dest.rows, ...]) into ``dest`` (row i of ``src`` -> row i of ``dest``)."""
    if dest.rows == 0 or dest.row_bytes == 0:
        return
    if isinstance(src, Concat):
        _fill_concat(src, dest, reader)
    elif disk_location(src) is not None:
        reader.read_rows(src, dest)
    else:
        t = src.reshape(dest.rows, -1) if src.device.type == "cpu" else src.reshape(dest.rows, -1).cpu()
        if t.stride(1) != 1:
            t = t.contiguous()
        copy_rows(dest.as_tensor(), t.view(torch.uint8))


def _fill_concat(src: Concat, dest: Dest, reader: FileReader) -> None:
    if src.dim == 0:
        at = 0
        for part in src.parts:
            n = shape_of(part)[0]
            fill(part, replace(dest, offset=dest.offset + at * dest.stride, rows=n), reader)
            at += n
        return
    if math.prod(src.shape[1 : src.dim]) != 1:  # not [rows, parts side by side, ...]: concatenate in memory
        whole = torch.cat([read_source(part, reader) for part in src.parts], src.dim)
        copy_rows(dest.as_tensor(), whole.reshape(dest.rows, -1).view(torch.uint8))
        return
    inner = math.prod(src.shape[src.dim + 1 :]) * torch.empty((), dtype=src.dtype, device="meta").element_size()
    at = 0
    for part in src.parts:
        width = shape_of(part)[src.dim] * inner
        fill(part, replace(dest, offset=dest.offset + at, row_bytes=width), reader)
        at += width


def read_source(src: Source, reader: FileReader) -> torch.Tensor:
    """``src`` read into a fresh contiguous CPU tensor."""
    shape, dtype = shape_of(src), dtype_of(src)
    out = torch.empty(shape, dtype=dtype)
    if out.numel():
        n = 1 if out.dim() == 0 else shape[0]
        flat, view = u8_view(out)
        fill(src, Dest(flat, view, 0, n, flat.numel() // n, flat.numel() // n), reader)
    return out
