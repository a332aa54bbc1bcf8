"""Read-only views of dumps for people and CI: list, show, verify, diff (the CLI's engine)."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from rl_replay.atomic import is_temp_name
from rl_replay.codec import TAG, Decoder, GenericBatch, GenericTensorDict
from rl_replay.errors import ReplayError
from rl_replay.manifest import confined_path, read_manifest, split_steps
from rl_replay.replay import _STEP_FILE, load_file, step_file_path
from rl_replay.stfile import RawTensor, parse_safetensors, read_verified
from rl_replay.torchcompat import array_without_torch


def require_manifest(dump_dir: str) -> dict[str, Any]:
    """The manifest of `dump_dir`; ReplayError naming the directory if there is none."""
    manifest = read_manifest(dump_dir)
    if manifest is None:
        raise ReplayError(f"{dump_dir} is not an rl_replay dump directory (no manifest.json)")
    return manifest


def load_generic(dump_dir: str, step: int, split: str) -> Any:
    """Load a step verified, as generic values (numpy only, no class needed)."""
    steps = split_steps(require_manifest(dump_dir), split)
    if step not in steps:
        raise ReplayError(f"{dump_dir} has no step {step} in split {split!r} (it has {len(steps)} steps)")
    path = step_file_path(dump_dir, split, step, steps[step])
    return load_file(path, steps[step], step, split, generic=True)


def list_dump(dump_dir: str) -> list[str]:
    """Lines describing a dump: manifest header, then per split its run info and steps."""
    manifest = require_manifest(dump_dir)
    lines = [
        f"{dump_dir}: schema_version {manifest['schema_version']}, created {manifest.get('created_at')}, "
        f"updated {manifest.get('updated_at')}, checksum {manifest.get('checksum')}"
    ]
    for split, info in sorted(manifest["splits"].items()):
        steps = split_steps(manifest, split)
        total = sum(r["size"] for r in steps.values())
        versions = ", ".join(f"{k} {v}" for k, v in (info.get("versions") or {}).items())
        span = f"steps {min(steps)}..{max(steps)}" if steps else "no steps"
        lines.append(
            f"split {split}: {len(steps)} step(s) ({span}), {total / 2**20:.2f}MB, dumped {info.get('created_at')}"
        )
        lines.append(f"  versions: {versions}")
        lines.append(f"  deterministic: {info.get('deterministic')}")
        lines.append(f"  {'step':>6}  {'samples':>7}  {'size':>10}  crc32     file")
        for step, r in sorted(steps.items()):
            step_file_path(dump_dir, split, step, r)  # refuse a listing that names files outside the dump
            size = f"{r['size'] / 2**20:.2f}MB"
            lines.append(f"  {step:>6}  {r.get('samples', '?'):>7}  {size:>10}  {r['crc32']}  {r.get('file')}")
    return lines


def describe_step(dump_dir: str, step: int, split: str) -> list[str]:
    """Lines describing one step: its container type and every leaf with dtype, shape and a preview."""
    steps = split_steps(require_manifest(dump_dir), split)
    if step not in steps:
        raise ReplayError(f"{dump_dir} has no step {step} in split {split!r} (it has {len(steps)} steps)")
    record = steps[step]
    path = step_file_path(dump_dir, split, step, record)
    buf = read_verified(path, record["size"], int(record["crc32"], 16))
    tensors, metadata = parse_safetensors(buf, path)
    tree = json.loads(metadata["rl_replay"])["tree"]
    lines = [
        f"{path}: step {step} of {split}, samples={record.get('samples')}, {record['size'] / 2**20:.2f}MB, crc32 ok"
    ]
    lines.extend(_describe(tree, "", tensors))
    return lines


def _describe(node: Any, path: str, tensors: Mapping[str, RawTensor]) -> Iterator[str]:
    tag = node.get(TAG) if isinstance(node, dict) else None
    here = path or "<batch>"
    if isinstance(node, dict) and tag in (None, "dataproto", "tensordict"):
        if tag == "dataproto":
            yield f"{here}: DataProto-like {node['cls']}"
            children = [(k, node[k]) for k in ("batch", "non_tensor_batch", "meta_info")]
        elif tag == "tensordict":
            yield f"{here}: TensorDict-like {node['cls']} batch_size={node['batch_size']}"
            children = [(str(k), v) for k, v in node["items"]]
        else:
            children = list(node.items())
            if not children:
                yield f"{here}: {{}}"
        for key, child in children:
            yield from _describe(child, f"{path}/{key}" if path else key, tensors)
    elif tag in ("nd", "pt"):
        raw = tensors[node["name"]]
        kind = f"torch.{node['dtype']}" if tag == "pt" else f"numpy {np.dtype(node['dtype'])}"
        yield f"{here}: {kind} {list(raw.shape)} {_stats(array_without_torch(raw))}"
    elif tag in ("ndstr", "ndfixed", "ndobj"):
        arr = Decoder(dict(tensors), here, generic=True).decode(node)
        first = f", first: {_short(arr.reshape(-1)[0], 60)}" if arr.size else ""
        yield f"{here}: numpy {'str' if tag == 'ndstr' else arr.dtype} {node['shape']}{first}"
    else:
        yield f"{here}: {_short(Decoder(dict(tensors), here, generic=True).decode(node))}"


def _stats(arr: np.ndarray) -> str:
    if arr.size == 0:
        return "(empty)"
    if arr.dtype == np.bool_:
        return f"true={int(arr.sum())}/{arr.size}"
    values = arr.astype(np.float64)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")  # all-NaN arrays
        return f"min={np.nanmin(values):.6g} max={np.nanmax(values):.6g} mean={np.nanmean(values):.6g}"


def _short(node: Any, limit: int = 100) -> str:
    text = repr(node)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass
class Report:
    """Lines to print and whether a problem (verify) or a difference (diff) was found."""

    lines: list[str]
    failed: bool


def verify_dump(dump_dir: str) -> Report:
    """Check every step file against the manifest (size, CRC-32, header, step / split) and the reference
    safetensors reader; report files the manifest does not record and leftovers of killed dumps."""
    from safetensors import safe_open

    try:
        manifest = require_manifest(dump_dir)
    except ReplayError as exc:
        return Report([f"FAIL {exc}"], True)
    lines, failed, nbytes, count = [], False, 0, 0
    for split in sorted(manifest["splits"]):
        for step, record in sorted(split_steps(manifest, split).items()):
            try:
                path = step_file_path(dump_dir, split, step, record)
                tensors, _ = parse_safetensors(read_verified(path, record["size"], int(record["crc32"], 16)), path)
                load_file(path, record, step, split, generic=True)
                with safe_open(path, framework="numpy") as ref:
                    if set(ref.keys()) != set(tensors):
                        raise ReplayError(f"{path}: the safetensors library reads other tensors than rl_replay")
            except (OSError, ValueError, ReplayError) as exc:
                lines.append(f"FAIL {split} step {step}: {exc}")
                failed = True
                continue
            count, nbytes = count + 1, nbytes + record["size"]
        lines.extend(_strays(dump_dir, split, split_steps(manifest, split)))
    failed = failed or any(line.startswith("FAIL") for line in lines)
    lines.append(
        f"{'FAILED' if failed else 'OK'}: {count} step file(s) verified, {nbytes / 2**20:.2f}MB, in {dump_dir}"
    )
    return Report(lines, failed)


def _strays(dump_dir: str, split: str, steps: Mapping[int, Any]) -> Iterator[str]:
    try:
        split_dir = confined_path(dump_dir, split, f"splits.{split}")
    except ReplayError as exc:
        yield f"FAIL split {split}: {exc}"
        return
    for name in sorted(os.listdir(split_dir)) if os.path.isdir(split_dir) else []:
        match = _STEP_FILE.match(name)
        if match and (match.group(2) != "safetensors" or int(match.group(1)) not in steps):
            yield f"FAIL {split}/{name}: not recorded in the manifest (an interrupted dump, or another tool's file)"
        elif is_temp_name(name):
            yield f"note {split}/{name}: temp file of a killed dump (ignored; the next dump removes it)"


def flatten(value: Any, path: str = "") -> dict[str, Any]:
    """{path: leaf} of a (generic) batch: mappings, DataProto-like and TensorDict-like objects are walked."""
    if isinstance(value, GenericBatch):
        return {
            k: v
            for a in ("batch", "non_tensor_batch", "meta_info")
            for k, v in flatten(getattr(value, a), _join(path, a)).items()
        }
    if isinstance(value, (dict, GenericTensorDict)) and all(isinstance(k, str) for k in value):
        if not value:
            return {path: value}
        return {k: v for key, child in value.items() for k, v in flatten(child, _join(path, key)).items()}
    return {path or "<batch>": value}


def _join(path: str, key: str) -> str:
    return f"{path}/{key}" if path else key
