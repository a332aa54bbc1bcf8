"""Atomic file replacement: temp file in the same directory, fsync, os.replace, fsync of the directory.

A process killed at any point leaves either the old file or the new one under the final name, never a
partial one; at worst a hidden `.NAME.PID.RANDOM.tmp` file stays behind, which readers ignore and the
next dump into that directory removes.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
TMP_SUFFIX = ".tmp"


def fsync_dir(path: str) -> None:
    """Make a rename or unlink inside `path` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories
    finally:
        os.close(fd)


def temp_name(path: str) -> str:
    """A hidden temp path next to `path`, unique per process and call."""
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}")


def is_temp_name(filename: str) -> bool:
    """True for names made by `temp_name`."""
    return filename.startswith(".") and filename.endswith(TMP_SUFFIX)


def atomic_write(path: str, write: Callable[[int], T], durable: bool = True) -> T:
    """Create `path` through `write(fd)` so it appears complete or not at all; returns what `write` returns.

    `durable=False` skips the fsyncs: still atomic against a killed process, not against power loss.
    """
    tmp = temp_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        try:
            result = write(fd)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(os.path.dirname(path) or ".")
    return result


def write_bytes_atomic(path: str, data: bytes, durable: bool = True) -> None:
    """Atomically replace `path` with `data`."""

    def write(fd: int) -> None:
        view = memoryview(data)
        while len(view):
            view = view[os.write(fd, view) :]

    atomic_write(path, write, durable)
