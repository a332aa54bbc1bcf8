"""Compare two dumps step by step and key by key (`rl-replay diff`)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from rl_replay.inspection import Report, flatten, load_generic, require_manifest
from rl_replay.manifest import split_steps


def diff_dumps(dir_a: str, dir_b: str, atol: float = 0.0) -> Report:
    """Every step of every split in either dump, compared leaf by leaf.

    Numeric arrays: same dtype and shape, and |a - b| <= atol everywhere (NaN equals NaN); the report
    gives the max abs diff and the first differing index. Other values must be equal.
    """
    manifest_a, manifest_b = require_manifest(dir_a), require_manifest(dir_b)
    lines: list[str] = []
    compared = 0
    for split in sorted(set(manifest_a["splits"]) | set(manifest_b["splits"])):
        steps_a, steps_b = split_steps(manifest_a, split), split_steps(manifest_b, split)
        for step in sorted(set(steps_a) | set(steps_b)):
            if step not in steps_a or step not in steps_b:
                lines.append(f"{split} step {step}: only in {dir_a if step in steps_a else dir_b}")
                continue
            compared += 1
            a = flatten(load_generic(dir_a, step, split))
            b = flatten(load_generic(dir_b, step, split))
            for key in sorted(set(a) | set(b)):
                if key not in a or key not in b:
                    lines.append(f"{split} step {step} {key}: only in {dir_a if key in a else dir_b}")
                    continue
                problem = compare_values(a[key], b[key], atol)
                if problem:
                    lines.append(f"{split} step {step} {key}: {problem}")
    differ = bool(lines)
    verdict = "DIFFERENT" if differ else "IDENTICAL"
    lines.append(f"{verdict}: {compared} step(s) compared (atol={atol}), {len(lines)} difference(s)")
    return Report(lines, differ)


def compare_values(a: Any, b: Any, atol: float) -> str | None:
    """None when equal (within atol for numbers); else a description of the first difference."""
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return _compare_arrays(a, b, atol)
    if isinstance(a, np.generic) and isinstance(b, np.generic):
        return _compare_arrays(np.asarray(a), np.asarray(b), atol)
    if type(a) is not type(b):
        return f"type {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            problem = compare_values(x, y, atol)
            if problem:
                return f"at [{i}]: {problem}"
        return None
    if isinstance(a, dict):
        if list(a) != list(b):
            return f"keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            problem = compare_values(a[k], b[k], atol)
            if problem:
                return f"at [{k!r}]: {problem}"
        return None
    if isinstance(a, float) and isinstance(b, float):
        same = (math.isnan(a) and math.isnan(b)) or abs(a - b) <= atol or a == b
        return None if same else f"{a!r} vs {b!r} (abs diff {abs(a - b):.3e})"
    return None if a == b else f"{_short(a)} vs {_short(b)}"


def _compare_arrays(a: np.ndarray, b: np.ndarray, atol: float) -> str | None:
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"dtype/shape {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
    if a.dtype.kind in "iuf":
        wide = np.float64 if a.dtype.kind == "f" else np.int64 if a.dtype.kind == "i" else np.uint64
        x, y = a.astype(wide), b.astype(wide)
        with np.errstate(all="ignore"):
            diff = np.abs(x - y) if a.dtype.kind != "u" else np.maximum(x, y) - np.minimum(x, y)
            both_nan = np.isnan(x) & np.isnan(y) if a.dtype.kind == "f" else np.zeros(a.shape, bool)
            bad = ~((diff <= atol) | both_nan | (x == y))
        if not bad.any():
            return None
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        max_diff = float(np.nanmax(np.where(bad, diff, 0).astype(np.float64)))
        return f"max abs diff {max_diff:.6g}, first at {list(first)} ({x[first].item()!r} vs {y[first].item()!r})"
    if a.dtype.kind in "bUS":
        unequal = a != b
        if not unequal.any():
            return None
        first = tuple(int(i) for i in np.argwhere(unequal)[0])
        return f"{int(unequal.sum())} element(s) differ, first at {list(first)} ({a[first]!r} vs {b[first]!r})"
    flat_a, flat_b = a.reshape(-1), b.reshape(-1)
    for i in range(flat_a.size):
        problem = compare_values(flat_a[i], flat_b[i], atol)
        if problem:
            index = [int(j) for j in np.unravel_index(i, a.shape)] if a.ndim else []
            return f"first difference at {index}: {problem}"
    return None


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
