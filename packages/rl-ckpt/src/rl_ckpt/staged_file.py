"""Writing files front to back from a few reused, page-aligned buffers, on background threads.

A freshly allocated page is slow to touch on the project's VM (~0.3-1 GB/s, see ``stream_io``), and a new file's
page cache is fresh pages: a 1.2 GB rank file took ~2.4 s in ``torch.save``. :class:`StagedFile` gathers the bytes
in :class:`StagingBuffers` allocated once per conversion, and writes them with ``O_DIRECT`` where the file system
takes it (no page cache: ~2 GB/s here), else buffered. A filled buffer goes to a checksum thread (CRC-32 of
registered ranges, then the bytes that depend on them: a zip's data descriptors, directory, ...) and then to a
writer thread, while the next one fills: reading, checksumming and writing overlap.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import queue
import threading
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import torch

from rl_ckpt.errors import CheckpointError
from rl_ckpt.sources import Source, nbytes_of, rows, shape_of
from rl_ckpt.stream_io import Dest, FileReader, fill, read_source, u8_view

BLOCK = 4096
"""O_DIRECT granularity: buffer address, file offset and length multiples of it (the largest logical block size)."""


class StagingBuffers:
    """Page-aligned write buffers, allocated once and lent to one :class:`StagedFile` at a time."""

    def __init__(self, count: int = 4, size: int = 16 << 20) -> None:
        if size % BLOCK or count < 2:
            raise ValueError("StagingBuffers: size must be a multiple of 4096 and count >= 2")
        self.size = size
        self._maps = [mmap.mmap(-1, size) for _ in range(count)]
        self.items = [(torch.frombuffer(m, dtype=torch.uint8), memoryview(m)) for m in self._maps]
        self._lock = threading.Lock()

    def lend(self) -> list[tuple[torch.Tensor, memoryview]]:
        """The buffers, for one file; raises when another file holds them."""
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("StagingBuffers are lent to another StagedFile")
        return self.items

    def give_back(self) -> None:
        """Called by the file when closed."""
        self._lock.release()


def _open_for_write(path: Path, direct: bool) -> tuple[int, bool]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, 0o666), True
        except OSError as err:  # tmpfs and some FUSE file systems refuse O_DIRECT: write through the page cache
            if err.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
    return os.open(path, flags, 0o666), False


Patch = Callable[[Mapping[int, int]], bytes]
"""Bytes computed from the CRC-32s of the slots written before them (a zip data descriptor, a directory entry)."""


@dataclass
class _Job:
    """One buffer for the writer thread: ``n`` bytes at stream offset ``base``, and what to do to them first."""

    index: int
    n: int
    base: int
    regions: list[tuple[int, int, int]]
    patches: list[tuple[int, int, Patch]]


class StagedFile:
    """A file written front to back through :class:`StagingBuffers` (see the module doc).

    The checksum thread computes the CRC-32 of the byte ranges registered to a slot (``write_source(...,
    slot=)``) and fills in the bytes registered as patches (``write(..., patches=)``, which depend only on the
    CRC-32s of earlier bytes). ``direct``: try ``O_DIRECT`` (falls back to buffered writes where refused).
    :meth:`close` writes the tail and sets the exact size; :meth:`abort` stops without it (the caller removes the
    file).
    """

    def __init__(self, path: Path, buffers: StagingBuffers, *, direct: bool = True) -> None:
        self.path = path
        self._buffers = buffers
        self._items = buffers.lend()
        try:
            self._fd, self.direct = _open_for_write(path, direct)
        except OSError:
            buffers.give_back()
            raise
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._todo: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._ready: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        for i in range(1, len(self._items)):
            self._free.put(i)
        self._cur, self._pos, self._base = 0, 0, 0
        self._regions: list[tuple[int, int, int]] = []
        self._patches: list[tuple[int, int, Patch]] = []
        self.crcs: dict[int, int] = {}
        """CRC-32 of each slot's bytes (complete after :meth:`close`)."""
        self.size = 0
        """Bytes written so far."""
        self._threads = [
            threading.Thread(target=self._checksum_loop, name=f"rl-ckpt crc {path.name}", daemon=True),
            threading.Thread(target=self._write_loop, name=f"rl-ckpt write {path.name}", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _checksum_loop(self) -> None:
        while (job := self._todo.get()) is not None:
            if self._error is None:
                try:
                    self._prepare(job, self._items[job.index][1])
                except BaseException as err:  # reported by the next write / close of the main thread
                    self._error = err
            self._ready.put(job)
        self._ready.put(None)

    def _write_loop(self) -> None:
        while (job := self._ready.get()) is not None:
            if self._error is None:
                try:
                    self._write_all(self._items[job.index][1][: job.n])
                except BaseException as err:
                    if isinstance(err, OSError) and err.filename is None:
                        err.filename = str(self.path)  # os.write names no file: the report of a full disk should
                    self._error = err
            self._free.put(job.index)

    def _prepare(self, job: _Job, view: memoryview) -> None:
        end = job.base + job.n
        for start, stop, slot in job.regions:
            lo, hi = max(start, job.base), min(stop, end)
            if lo < hi:
                self.crcs[slot] = zlib.crc32(view[lo - job.base : hi - job.base], self.crcs.get(slot, 0))
        for at, length, patch in job.patches:
            lo, hi = max(at, job.base), min(at + length, end)
            if lo < hi:
                value = patch(self.crcs)
                view[lo - job.base : hi - job.base] = value[lo - at : hi - at]

    def _write_all(self, data: memoryview) -> None:
        while data:
            try:
                done = os.write(self._fd, data)
            except OSError as err:
                if not (self.direct and err.errno == errno.EINVAL):
                    raise
                fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                self.direct = False  # accepted at open, refused on write: go on buffered
                continue
            data = data[done:]

    def _check(self) -> None:
        if self._error is not None:
            raise CheckpointError(f"cannot write {self.path}: {self._error}") from self._error

    def _submit(self, n: int) -> None:
        """Give the first ``n`` bytes of the current buffer to the writer thread, with their regions / patches."""
        end = self._base + n
        job = _Job(self._cur, n, self._base, [], [])
        job.regions = [r for r in self._regions if r[0] < end]
        job.patches = [p for p in self._patches if p[0] < end]
        self._regions = [r for r in self._regions if r[1] > end]
        self._patches = [p for p in self._patches if p[0] + p[1] > end]
        self._todo.put(job)
        self._base = end

    def _rotate(self) -> None:
        """Hand the filled buffer to the writer thread (whole blocks under O_DIRECT) and take a free one."""
        n = self._pos - self._pos % BLOCK if self.direct else self._pos
        tail = bytes(self._items[self._cur][1][n : self._pos])
        self._submit(n)
        self._cur = self._free.get()
        self._check()
        self._items[self._cur][1][: len(tail)] = tail
        self._pos = len(tail)

    def _room(self) -> int:
        return self._buffers.size - self._pos

    def write(self, data: bytes | memoryview, patches: Sequence[tuple[int, int, Patch]] = ()) -> None:
        """Append ``data``; ``patches``: (offset in ``data``, length, patch) to fill in before it is written."""
        view = memoryview(data).cast("B")
        self._patches += [(self.size + at, length, patch) for at, length, patch in patches]
        while view:
            if self._room() < BLOCK:
                self._rotate()
            n = min(len(view), self._room())
            self._items[self._cur][1][self._pos : self._pos + n] = view[:n]
            self._pos += n
            self.size += n
            view = view[n:]

    def write_source(self, src: Source, reader: FileReader, slot: int | None = None) -> None:
        """Append the bytes of ``src``, row block by row block; ``slot``: count them in ``crcs[slot]``."""
        total = nbytes_of(src)
        n_rows = 1 if len(shape_of(src)) == 0 else shape_of(src)[0]
        if total == 0:
            return
        if slot is not None:
            self._regions.append((self.size, self.size + total, slot))
        row_bytes = total // n_rows
        done = 0
        while done < n_rows:
            if self._room() < max(row_bytes, BLOCK):
                self._rotate()
            k = min(n_rows - done, self._room() // row_bytes)
            if k == 0:  # one row larger than a buffer: read it alone, then copy it in
                self.write(u8_view(read_source(rows(src, done, done + 1), reader))[1])
                done += 1
                continue
            tensor, view = self._items[self._cur]
            fill(rows(src, done, done + k), Dest(tensor, view, self._pos, k, row_bytes, row_bytes), reader)
            self._pos += k * row_bytes
            self.size += k * row_bytes
            done += k

    def close(self) -> None:
        """Write what is buffered, wait for the threads, set the exact size, close (no fsync, as ``torch.save``)."""
        try:
            padded = self._pos
            if self.direct:
                padded = -(-self._pos // BLOCK) * BLOCK
                self._items[self._cur][1][self._pos : padded] = bytes(padded - self._pos)
            self._submit(padded)
            self._stop()
            self._check()
            if padded != self._pos:
                os.ftruncate(self._fd, self.size)
        finally:
            self._release()

    def abort(self) -> None:
        """Stop writing (the file is left incomplete: the caller removes it)."""
        self._stop()
        self._release()

    def _stop(self) -> None:
        if self._threads[0].is_alive():
            self._todo.put(None)
        for thread in self._threads:
            thread.join()

    def _release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self._buffers.give_back()

    def __enter__(self) -> StagedFile:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
