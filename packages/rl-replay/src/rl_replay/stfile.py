"""Safetensors files written as a stream with a running CRC-32, and parsed without copies.

The files follow the safetensors format (8-byte little-endian header length, JSON header, raw
little-endian tensor bytes) and open with the reference `safetensors` library. rl_replay writes them
itself so that each tensor's bytes go from the array to the file once, checksummed on the way, and
reads them into one buffer whose slices become the loaded arrays, so a load is one read plus one
checksum pass. Nothing in a file is ever executed: the header is JSON, dtypes come from a fixed table.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

import numpy as np

from rl_replay.checksum import finish_crc32, read_with_crc32, start_crc32
from rl_replay.errors import ChecksumMismatchError, DumpFormatError

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the reference implementation's limit
_CHUNK = 8 * 1024 * 1024

# safetensors dtype code -> numpy dtype; BF16 / F8 have no numpy dtype and load through torch.
NUMPY_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype("bool"),
    "U8": np.dtype("<u1"),
    "I8": np.dtype("<i1"),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
}
TORCH_ONLY_ITEMSIZE = {"BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1}
ITEMSIZE = {**{code: dt.itemsize for code, dt in NUMPY_DTYPES.items()}, **TORCH_ONLY_ITEMSIZE}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor to write: its raw bytes as a C-contiguous little-endian array and its dtype code."""

    name: str
    code: str
    shape: tuple[int, ...]
    data: np.ndarray  # any dtype; its bytes are written as they are


@dataclass(frozen=True)
class RawTensor:
    """One tensor of a parsed file: dtype code, shape and a uint8 view of its bytes (no copy)."""

    code: str
    shape: tuple[int, ...]
    raw: np.ndarray  # uint8, 1-D, a slice of the file buffer


def numpy_view(tensor: RawTensor) -> np.ndarray:
    """View a parsed tensor as a numpy array of its dtype (no copy). Raises for BF16 / F8."""
    dtype = NUMPY_DTYPES.get(tensor.code)
    if dtype is None:
        raise DumpFormatError(f"dtype {tensor.code} has no numpy equivalent; load it with torch installed")
    return tensor.raw.view(dtype).reshape(tensor.shape)


def _header_bytes(entries: list[TensorEntry], metadata: dict[str, str]) -> bytes:
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for entry in entries:
        header[entry.name] = {
            "dtype": entry.code,
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.data.nbytes],
        }
        offset += entry.data.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    pad = (8 - (8 + len(encoded)) % 8) % 8  # tensor data starts 8-byte aligned
    return encoded + b" " * pad


def order_entries(entries: list[TensorEntry]) -> list[TensorEntry]:
    """Largest item size first (as the reference writer does): every tensor starts aligned to its dtype."""
    return sorted(entries, key=lambda e: (-ITEMSIZE[e.code], e.name))


def write_safetensors(fd: int, entries: list[TensorEntry], metadata: dict[str, str]) -> tuple[int, int]:
    """Write a safetensors file to an open file descriptor; returns (bytes written, CRC-32 of them)."""
    entries = order_entries(entries)
    header = _header_bytes(entries, metadata)
    pieces = _chunks(struct.pack("<Q", len(header)) + header, entries)
    started = start_crc32(pieces)  # checksummed by other cores while this thread writes
    for piece in pieces:
        _write_all(fd, piece)
    return sum(len(p) for p in pieces), finish_crc32(started, pieces)


def _chunks(head: bytes, entries: list[TensorEntry]) -> list[memoryview]:
    out = [memoryview(head)]
    for entry in entries:
        if entry.data.nbytes == 0:
            continue
        flat = np.ascontiguousarray(entry.data).reshape(-1).view(np.uint8).data
        out.extend(flat[i : i + _CHUNK] for i in range(0, len(flat), _CHUNK))
    return out


def _write_all(fd: int, data: memoryview) -> None:
    while len(data):
        written = os.write(fd, data)
        data = data[written:]


def read_verified(path: str, expected_size: int, expected_crc: int) -> np.ndarray:
    """Read a whole file into a fresh uint8 buffer, checking its size and CRC-32 against the manifest."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if size != expected_size:
            raise ChecksumMismatchError(
                f"[Rollout Mock] {path} is {size} bytes but the manifest recorded {expected_size}: "
                "the file is truncated or was replaced after the dump. Re-run dump mode for this step."
            )
        try:
            buf, crc = read_with_crc32(f.fileno(), size)
        except EOFError as exc:
            raise ChecksumMismatchError(f"[Rollout Mock] {path} shrank while being read: {exc}") from None
    if crc != expected_crc:
        raise ChecksumMismatchError(
            f"[Rollout Mock] checksum mismatch in {path}: crc32 is {crc:08x}, the manifest recorded "
            f"{expected_crc:08x}. The file is corrupted; re-run dump mode for this step."
        )
    return buf


def parse_safetensors(buf: np.ndarray, path: str) -> tuple[dict[str, RawTensor], dict[str, str]]:
    """Parse a safetensors file held in a uint8 buffer; tensors are views into `buf`."""
    if buf.nbytes < 8:
        raise DumpFormatError(f"{path} is not a safetensors file: only {buf.nbytes} bytes")
    n = int.from_bytes(buf[:8].tobytes(), "little")
    if n > min(MAX_HEADER_BYTES, buf.nbytes - 8):
        raise DumpFormatError(f"{path} is not a safetensors file: header length {n} exceeds the file")
    try:
        header = json.loads(buf[8 : 8 + n].tobytes())
    except (UnicodeDecodeError, ValueError) as exc:
        raise DumpFormatError(f"{path} has an unreadable safetensors header: {exc}") from None
    if not isinstance(header, dict):
        raise DumpFormatError(f"{path} has a safetensors header that is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise DumpFormatError(f"{path} has safetensors __metadata__ that is not a string map")
    data = buf[8 + n :]
    tensors = {name: _parse_entry(name, info, data, path) for name, info in header.items()}
    return tensors, metadata


def _parse_entry(name: str, info: object, data: np.ndarray, path: str) -> RawTensor:
    bad = f"{path}: bad safetensors entry {name!r}"
    if not isinstance(info, dict) or info.get("dtype") not in ITEMSIZE:
        raise DumpFormatError(f"{bad}: dtype must be one of {sorted(ITEMSIZE)}")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise DumpFormatError(f"{bad}: shape {shape!r}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets):
        raise DumpFormatError(f"{bad}: data_offsets {offsets!r}")
    begin, end = offsets
    nbytes = ITEMSIZE[info["dtype"]] * math.prod(shape)
    if not 0 <= begin <= end <= data.nbytes or end - begin != nbytes:
        raise DumpFormatError(f"{bad}: data_offsets {offsets} do not hold {nbytes} bytes in the file")
    return RawTensor(code=info["dtype"], shape=tuple(shape), raw=data[begin:end])
