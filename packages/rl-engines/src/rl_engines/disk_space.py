"""Writes that fail for lack of space, told apart from other errors and reported with the sizes involved.

A full disk shows up as ENOSPC, a quota as EDQUOT, a file-size limit (``ulimit -f``) as EFBIG; torch's zip
writer, which does not check every write, raises ``RuntimeError: [enforce fail at inline_container.cc:...] ...
unexpected pos N vs M`` (or ``... file write failed``) instead, and safetensors (HF ``save_pretrained``) an error
without errno whose text holds the OS message. :func:`out_of_space_cause` finds such an error in an
exception, its causes and (torch.distributed.checkpoint) its per-rank failures; :func:`out_of_space_message`
says which path, how much was being written, how much is free and what to do; :class:`OutOfSpaceError` carries it.
Pure standard library and no torch import, so the driver and the pre-flight checks use it too.
"""

from __future__ import annotations

import errno
import json
import resource
import shutil
import struct
from collections.abc import Iterator
from math import prod
from pathlib import Path

NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
"""Disk full, quota exceeded, file larger than the process's (or the file system's) size limit."""
TORCH_SHORT_WRITE = ("unexpected pos", "file write failed")
"""What torch's PyTorchStreamWriter raises (as RuntimeError, without an errno) when a write comes up short."""
NO_SPACE_TEXTS = (*TORCH_SHORT_WRITE, "No space left on device", "Disk quota exceeded", "File too large")
"""Messages of errors without an errno that mean space ran out (torch's short write; the OS text in safetensors')."""
SAVE_FIX = (
    "free space there, point output_dir (or checkpoint_config.output_dir) at a file system with room for it, or "
    "save less often (raise save_steps) and delete older checkpoint-<step> folders"
)
"""The fix of a checkpoint save, in the pipeline config's (ROLL's) keys."""


class OutOfSpaceError(OSError):
    """A write failed for lack of space (ENOSPC, EDQUOT, EFBIG or torch's short write).

    ``str()`` is the whole message: the path, the bytes being written and free, what was cleaned up and the fix;
    ``errno`` is the original one (ENOSPC when torch gave none) and ``filename`` the path that was being written.
    """

    def __init__(self, code: int, message: str, path: str) -> None:
        super().__init__(code, message, path)

    def __str__(self) -> str:
        return str(self.strerror)


def _failures(exc: BaseException) -> list[BaseException]:
    """The per-rank errors of a torch.distributed.checkpoint ``CheckpointException`` (``failures``: rank ->
    exception, or (exception, traceback)); empty for any other exception."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict):
        return []
    found = [value[0] if isinstance(value, tuple) else value for value in failures.values()]
    return [value for value in found if isinstance(value, BaseException)]


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, its causes and contexts, and the per-rank failures they wrap, each once."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        current = todo.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        context = None if current.__suppress_context__ else current.__context__  # `raise ... from None` cuts it
        todo += [e for e in (current.__cause__, context) if e is not None] + _failures(current)


def out_of_space_cause(exc: BaseException) -> BaseException | None:
    """The error in ``exc`` (or what it wraps) that says space ran out: an OSError with ENOSPC / EDQUOT / EFBIG,
    else one without errno whose message says so (:data:`NO_SPACE_TEXTS`); None when ``exc`` is about something
    else."""
    by_text = None
    for error in _chain(exc):
        if isinstance(error, OSError) and error.errno in NO_SPACE_ERRNOS:
            return error
        if by_text is None and not isinstance(error, OSError) and any(t in str(error) for t in NO_SPACE_TEXTS):
            by_text = error
    return by_text


def format_bytes(count: float) -> str:
    """``1536`` -> ``"1.50 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.2f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def existing_ancestor(path: str | Path) -> Path:
    """``path`` or its nearest existing parent (where a folder still to be created will live)."""
    current = Path(path).absolute()
    while not current.exists() and current != current.parent:
        current = current.parent
    return current


def free_bytes(path: str | Path) -> int:
    """Bytes an unprivileged process may still write on the file system of ``path`` (or its nearest existing
    parent)."""
    return shutil.disk_usage(existing_ancestor(path)).free


def file_size_limit() -> int | None:
    """This process's file-size limit (``ulimit -f``, RLIMIT_FSIZE) in bytes; None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def folder_bytes(path: str | Path) -> int:
    """Total size of the files under ``path`` (0 when it does not exist)."""
    root = Path(path)
    if root.is_file():
        return root.stat().st_size
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) if root.is_dir() else 0


def describe_cause(cause: BaseException) -> str:
    """One line: ``[Errno 28] No space left on device: '<file>'``, or torch's short write explained."""
    if isinstance(cause, OSError):
        where = f": '{cause.filename}'" if cause.filename else ""
        return f"[Errno {cause.errno}] {cause.strerror or cause}{where}"
    text = f"{type(cause).__name__}: {' '.join(str(cause).split())}"
    if any(marker in text for marker in TORCH_SHORT_WRITE):
        return f"torch wrote a file only in part ({text}), which it reports when space runs out"
    return text


def error_code(cause: BaseException) -> int:
    """The errno an :class:`OutOfSpaceError` for ``cause`` carries (ENOSPC for torch's short write)."""
    return cause.errno if isinstance(cause, OSError) and cause.errno else errno.ENOSPC


def out_of_space_message(
    what: str, path: str | Path, cause: BaseException, *, needed: int | None, cleaned: str, fix: str
) -> str:
    """``what`` failed at ``path``: the cause, the bytes ``needed`` (when known) against the bytes free there now (and
    the file-size limit when one is set), what was removed (``cleaned``), and ``fix``."""
    need = f"It needs about {format_bytes(needed)}; " if needed else ""
    free = f"{format_bytes(free_bytes(path))} are free on that file system"
    limit = file_size_limit()
    if limit is not None:
        free += f", and this process may write files of at most {format_bytes(limit)} (ulimit -f)"
        fix += ", or raise the file-size limit (ulimit -f)"
    return f"{what} {path}: out of disk space ({describe_cause(cause)}). {need}{free}. {cleaned} Fix: {fix}."


# ---- sizes of a model before it is loaded ------------------------------------------------------------------
def _safetensors_numel(file: Path) -> int:
    with file.open("rb") as handle:
        (size,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(size))
    return sum(prod(entry["shape"]) for name, entry in header.items() if name != "__metadata__")


def weights_numel(model_path: str | Path) -> int | None:
    """Number of weight elements in a local HF model folder, read from its safetensors headers (no tensor is
    loaded); None for a hub id, a folder without safetensors files or an unreadable header."""
    folder = Path(model_path)
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        return None
    try:
        return sum(_safetensors_numel(file) for file in files)
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
