"""The dump directory's `manifest.json`: schema version, per-split run info, per-step size and CRC-32.

Shape (schema_version 1)::

    {"schema_version": 1, "format": "rl_replay rollout dump", "created_at": ISO-8601, "updated_at": ...,
     "checksum": "crc32",
     "splits": {"train": {"run_id": ..., "created_at": ..., "versions": {"rl_replay": ..., "numpy": ...,
                          "safetensors": ..., "torch": ..., "python": ...},
                          "deterministic": {...},
                          "steps": {"0": {"file": "train/step_000000.safetensors", "size": ...,
                                          "crc32": "8 hex digits", "samples": 128, "created_at": ...}}}}}

Updates are read-modify-write under an exclusive lock (`.manifest.lock`, POSIX flock), so the train and
val schedulers of one run may dump from different processes on one host; the file is replaced atomically.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
from collections.abc import Callable, Iterator
from typing import Any, cast

from rl_replay.__about__ import __version__
from rl_replay.atomic import write_bytes_atomic
from rl_replay.errors import DumpFormatError, DumpPathError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no cross-process lock
    fcntl = None  # type: ignore[assignment]

MANIFEST_NAME = "manifest.json"
LOCK_NAME = ".manifest.lock"
SCHEMA_VERSION = 1
FORMAT_NAME = "rl_replay rollout dump"


def now_iso() -> str:
    """Current UTC time, ISO-8601 with seconds."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def library_versions() -> dict[str, str]:
    """Versions of rl_replay, numpy, safetensors, torch (if installed) and python."""
    versions = {"rl_replay": __version__}
    for dist in ("numpy", "safetensors", "torch"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[dist] = importlib.metadata.version(dist)
    versions["python"] = platform.python_version()
    return versions


def manifest_path(dump_dir: str) -> str:
    """Path of the manifest of `dump_dir`."""
    return os.path.join(dump_dir, MANIFEST_NAME)


def confined_path(dump_dir: str, relative: object, entry: str) -> str:
    """`dump_dir/relative`, after checking that it cannot lead out of `dump_dir`.

    A dump travels between people and machines, so a path its manifest names must stay inside it:
    `relative` must be a relative path without '..', and once symlinks are resolved it must still lie
    inside the (resolved) dump directory; a symlink to another file of the dump is fine. `entry` names
    the manifest entry the path comes from (e.g. "splits.train.steps.0.file"). Raises DumpPathError.
    """
    problem = _escape(dump_dir, relative)
    if problem is not None:
        reason, fix = problem
        raise DumpPathError(
            f"[Rollout Mock] {manifest_path(dump_dir)}: {entry} = {relative!r} {reason}; rl_replay reads only "
            f"files inside the dump directory {dump_dir}. {fix} Do not replay a dump you cannot vouch for."
        )
    return os.path.join(dump_dir, cast(str, relative))


def _escape(dump_dir: str, relative: object) -> tuple[str, str] | None:
    """(why `relative` leaves `dump_dir`, how to fix it), or None when it stays inside."""
    as_written = (
        "Record it relative to the dump directory, as rl_replay writes it (e.g. 'train/step_000000.safetensors')."
    )
    if not isinstance(relative, str) or not relative or "\0" in relative:
        return "is not a relative path", as_written
    if os.path.isabs(relative) or os.path.splitdrive(relative)[0]:
        return "is an absolute path", as_written
    if ".." in relative.replace("\\", "/").split("/"):
        return "contains '..'", as_written
    root = os.path.realpath(dump_dir)
    real = os.path.realpath(os.path.join(root, relative))
    if os.path.commonpath([root, real]) != root:
        return (
            f"resolves to {real} (a symlink leads out)",
            "Copy the file into the dump directory instead of linking it.",
        )
    return None


def new_manifest() -> dict[str, Any]:
    """An empty manifest."""
    stamp = now_iso()
    return {
        "schema_version": SCHEMA_VERSION,
        "format": FORMAT_NAME,
        "created_at": stamp,
        "updated_at": stamp,
        "checksum": "crc32",
        "splits": {},
    }


def read_manifest(dump_dir: str) -> dict[str, Any] | None:
    """The parsed manifest of `dump_dir`, or None if it has none. Raises DumpFormatError if unreadable."""
    path = confined_path(dump_dir, MANIFEST_NAME, "the manifest itself")
    try:
        with open(path, "rb") as f:
            data: Any = json.loads(f.read())
    except FileNotFoundError:
        return None
    except (UnicodeDecodeError, ValueError) as exc:
        raise DumpFormatError(f"[Rollout Mock] manifest {path} is not valid JSON: {exc}") from None
    _validate(data, path)
    manifest: dict[str, Any] = data
    return manifest


def _validate(data: Any, path: str) -> None:
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        raise DumpFormatError(f"[Rollout Mock] {path} is not an rl_replay manifest")
    version = data.get("schema_version")
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise DumpFormatError(
            f"[Rollout Mock] {path} has schema_version {version!r}; this rl_replay {__version__} reads "
            f"up to {SCHEMA_VERSION}. Upgrade rl-replay."
        )
    splits = data.get("splits")
    if not isinstance(splits, dict):
        raise DumpFormatError(f"[Rollout Mock] {path}: 'splits' must be an object")
    for split, info in splits.items():
        steps = info.get("steps") if isinstance(info, dict) else None
        if not isinstance(steps, dict):
            raise DumpFormatError(f"[Rollout Mock] {path}: splits.{split}.steps must be an object")
        for key, record in steps.items():
            ok = key.isdigit() and isinstance(record, dict)
            ok = ok and isinstance(record.get("size"), int) and isinstance(record.get("crc32"), str)
            if not ok:
                raise DumpFormatError(f"[Rollout Mock] {path}: bad record for splits.{split}.steps.{key}")


def split_steps(manifest: dict[str, Any] | None, split: str) -> dict[int, dict[str, Any]]:
    """{step: record} of one split (empty when the split was never dumped)."""
    if manifest is None:
        return {}
    info = manifest["splits"].get(split) or {}
    return {int(k): v for k, v in info.get("steps", {}).items()}


@contextlib.contextmanager
def _locked(dump_dir: str) -> Iterator[None]:
    if fcntl is None:  # pragma: no cover
        yield
        return
    fd = os.open(os.path.join(dump_dir, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def update_manifest(dump_dir: str, change: Callable[[dict[str, Any]], None], durable: bool = True) -> dict[str, Any]:
    """Apply `change` to the manifest (created if absent) under the lock; write it atomically; return it."""
    with _locked(dump_dir):
        manifest = read_manifest(dump_dir) or new_manifest()
        change(manifest)
        manifest["updated_at"] = now_iso()
        text = json.dumps(manifest, indent=1, sort_keys=False) + "\n"
        write_bytes_atomic(manifest_path(dump_dir), text.encode("utf-8"), durable)
    return manifest
