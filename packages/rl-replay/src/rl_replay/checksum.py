"""CRC-32 (zlib's, of the whole file) computed on several cores.

zlib.crc32 runs at a few GB/s on one core and releases the GIL, so pieces of a file are checksummed
in a thread pool and the pieces' CRCs are merged with zlib's crc32_combine algorithm (the CRC register
advanced over len2 zero bytes is a linear map over GF(2); the maps for 2**k bytes are precomputed once).
The result equals `zlib.crc32(whole_file)`, so any CRC-32 tool can check a file against the manifest.
"""

from __future__ import annotations

import os
import threading
import zlib
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

READ_CHUNK = 1 << 20  # per task: small enough to checksum while the bytes are still in cache
_POLY = 0xEDB88320
_MAX_BITS = 48  # files up to 256 TiB

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_pid = -1
_pow2_ops: list[list[int]] = []


def _apply(mat: Sequence[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _square(mat: Sequence[int]) -> list[int]:
    return [_apply(mat, mat[n]) for n in range(32)]


def _operators(bits: int) -> list[list[int]]:
    """`ops[k]` advances a CRC register over 2**k zero bytes, for k < bits (computed once, on demand)."""
    with _lock:
        if not _pow2_ops:
            one_bit = [_POLY] + [1 << n for n in range(31)]  # one zero bit
            _pow2_ops.append(_square(_square(_square(one_bit))))  # one zero byte
        while len(_pow2_ops) < bits:
            _pow2_ops.append(_square(_pow2_ops[-1]))
    return _pow2_ops


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of A + B from crc1 = crc32(A), crc2 = crc32(B) and len2 = len(B)."""
    if len2 >= 1 << _MAX_BITS:
        raise ValueError(f"length {len2} too large")
    ops = _operators(len2.bit_length())
    k = 0
    while len2:
        if len2 & 1:
            crc1 = _apply(ops[k], crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


def _executor() -> ThreadPoolExecutor | None:
    """A shared pool (re-created after fork); None on a single core."""
    global _pool, _pool_pid
    workers = min(8, os.cpu_count() or 1)
    if workers < 2:
        return None
    with _lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rl_replay_crc")
            _pool_pid = os.getpid()
        return _pool


def start_crc32(pieces: Sequence[memoryview]) -> list[Future[int]] | int:
    """Start checksumming `pieces` in the background; pass the result to `finish_crc32`."""
    pool = _executor()
    if pool is None:
        crc = 0
        for piece in pieces:
            crc = zlib.crc32(piece, crc)
        return crc
    return [pool.submit(zlib.crc32, piece) for piece in pieces]


def finish_crc32(started: list[Future[int]] | int, pieces: Sequence[memoryview]) -> int:
    """CRC-32 of the concatenated `pieces`, from `start_crc32`."""
    if isinstance(started, int):
        return started
    crc = 0
    for future, piece in zip(started, pieces):
        crc = crc32_combine(crc, future.result(), len(piece))
    return crc


def read_with_crc32(fd: int, size: int) -> tuple[np.ndarray, int]:
    """Read `size` bytes of `fd` from offset 0 into a new uint8 array, checksumming on the way.

    Pieces are read (os.preadv) and checksummed by the same pool task, while they are in cache.
    Returns the buffer and the CRC-32; raises EOFError if the file is shorter than `size`.
    """
    buf = np.empty(size, dtype=np.uint8)
    view = buf.data
    pool = _executor()
    offsets = range(0, size, READ_CHUNK)

    def task(offset: int) -> int:
        piece = view[offset : offset + READ_CHUNK]
        done = 0
        while done < len(piece):
            n = (
                os.preadv(fd, [piece[done:]], offset + done)
                if hasattr(os, "preadv")
                else _pread_into(fd, piece[done:], offset + done)
            )
            if n == 0:
                raise EOFError(f"file ended at byte {offset + done} of {size}")
            done += n
        return zlib.crc32(piece)

    crcs = list(pool.map(task, offsets)) if pool is not None and len(offsets) > 1 else [task(o) for o in offsets]
    crc = 0
    for offset, piece_crc in zip(offsets, crcs):
        crc = crc32_combine(crc, piece_crc, min(READ_CHUNK, size - offset))
    return buf, crc


def _pread_into(fd: int, target: memoryview, offset: int) -> int:
    data = os.pread(fd, len(target), offset)
    target[: len(data)] = data
    return len(data)
