"""A conversion's output folder: removed again when the conversion fails, and a failure for lack of space reported
as one :class:`CheckpointError` naming the file, the bytes written and free, and the fix.

Space running out shows up as ENOSPC, EDQUOT (quota) or EFBIG (``ulimit -f``), or, from torch's zip writer and
safetensors, as an error without errno whose text says so. rl_ckpt imports no sibling package, so this is its own
small copy of rl_engines' classifier (``rl_engines.disk_space``).
"""

from __future__ import annotations

import errno
import os
import resource
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rl_ckpt.errors import CheckpointError

NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
NO_SPACE_TEXTS = ("unexpected pos", "file write failed", "No space left on device", "Disk quota exceeded",
                  "File too large")  # fmt: skip


def out_of_space_cause(exc: BaseException) -> BaseException | None:
    """The error in ``exc`` or its causes / contexts that says space ran out; None when it is about something
    else."""
    seen: set[int] = set()
    by_text, todo = None, [exc]
    while todo:
        error = todo.pop(0)
        if id(error) in seen:
            continue
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in NO_SPACE_ERRNOS:
            return error
        if by_text is None and not isinstance(error, OSError) and any(t in str(error) for t in NO_SPACE_TEXTS):
            by_text = error
        context = None if error.__suppress_context__ else error.__context__  # `raise ... from None` cuts it
        todo += [e for e in (error.__cause__, context) if e is not None]
    return by_text


def format_bytes(count: float) -> str:
    """``1536`` -> ``"1.50 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.2f} {unit}"
        count /= 1024
    return f"{count:.2f} TiB"


def _tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _existing(path: Path) -> Path:
    current = path.absolute()
    while not current.exists() and current != current.parent:
        current = current.parent
    return current


def _describe(cause: BaseException) -> str:
    if isinstance(cause, OSError):
        where = f": '{cause.filename}'" if cause.filename else ""
        return f"[Errno {cause.errno}] {cause.strerror or cause}{where}"
    return f"{type(cause).__name__}: {' '.join(str(cause).split())}"


def out_of_space_message(out: Path, cause: BaseException, written: int) -> str:
    """What ran out, how much had been written, how much is free now (and the file-size limit), and the fix."""
    free = f"{format_bytes(shutil.disk_usage(_existing(out)).free)} are free there now"
    fix = "free space on that file system, or pass an --output_path on a larger one"
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft != resource.RLIM_INFINITY:
        free += f", and this process may write files of at most {format_bytes(soft)} (ulimit -f)"
        fix += ", or raise the file-size limit (ulimit -f)"
    return (
        f"cannot write the converted checkpoint to {out}: out of disk space ({_describe(cause)}). "
        f"{format_bytes(written)} had been written when it failed; that partial output was removed and "
        f"{free}. Fix: {fix}."
    )


@contextmanager
def output_folder(out: Path) -> Iterator[Path]:
    """Write a conversion's output into ``out``. On any failure what the conversion created there is removed (the
    whole folder when it did not exist before, else the entries it added); running out of space becomes a
    :class:`CheckpointError` (see :func:`out_of_space_message`), other errors pass unchanged."""
    before = set(os.listdir(out)) if out.is_dir() else None
    try:
        yield out
    except BaseException as exc:
        if before is None:
            created = [out]
        else:
            created = [out / name for name in os.listdir(out) if name not in before] if out.is_dir() else []
        written = sum(_tree_bytes(path) for path in created)
        for path in created:
            _remove(path)
        cause = out_of_space_cause(exc)
        if cause is None:
            raise
        raise CheckpointError(out_of_space_message(out, cause, written)) from exc
