"""``torch.save`` zip files without their tensors in memory: locate storages to read, stream records to write.

Reading: ``torch.load(map_location="meta")`` rebuilds every tensor on the meta device and records the file offset of
its storage (``storage._checkpoint_offset``); :func:`locate_storages` checks those offsets against the zip directory
and marks the tensors as on disk (``sources``), so nothing is read until a writer copies the bytes.

Writing: :func:`save_streamed` writes exactly the bytes ``torch.save`` would write for a state dict whose ``model``
entries are compact tensors equal to the given sources. ``torch.save`` runs under ``skip_data`` on empty tensors of
the same shapes (nothing is allocated or touched) into a temporary file of the same name (the records' folder is
named after the file), which it leaves sparse: that gives every byte of the file except the storages' data and
their CRC-32s. The data are then streamed from the sources between those bytes, and the CRC-32s (in each record's
data descriptor and central directory entry) and the ``.data/serialization_id`` record (a hash of the record names
and of the CRC-32s, ``caffe2/serialize/inline_container.cc``) are filled in. Anything unexpected in that template
falls back to a plain ``torch.save`` of the materialized tensors.
"""

from __future__ import annotations

import bisect
import io
import re
import struct
import tempfile
import zipfile
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import IO, Any

import torch

from rl_ckpt.sources import Source, dtype_of, materialize, nbytes_of, on_disk, shape_of
from rl_ckpt.staged_file import Patch, StagedFile, StagingBuffers
from rl_ckpt.stream_io import FileReader, Prefetcher

_DATA_RECORD = re.compile(r"[^/]+/data/\d+")
_SERIALIZATION_ID = re.compile(r"[^/]+/\.data/serialization_id")
_DESCRIPTOR = b"PK\x07\x08"
_CD_ENTRY = b"PK\x01\x02"
_MASK64 = (1 << 64) - 1


def record_offsets(stream: IO[bytes]) -> dict[int, int]:
    """{byte offset of the data: size} of every storage record (``<archive>/data/<key>``) of a torch zip file."""
    out: dict[int, int] = {}
    with zipfile.ZipFile(stream) as z:
        for info in z.infolist():
            if _DATA_RECORD.fullmatch(info.filename):
                stream.seek(info.header_offset + 26)
                name_len, extra_len = struct.unpack("<HH", stream.read(4))
                out[info.header_offset + 30 + name_len + extra_len] = info.file_size
    return out


def locate_storages(tensors: Iterable[torch.Tensor], path: Path, base: int, stream: IO[bytes]) -> bool:
    """Mark meta tensors loaded from the torch zip ``stream`` (at byte ``base`` of ``path``) as on disk.

    False (nothing marked) when a storage's recorded offset is missing or does not start a record of its size.
    """
    tensors = list(tensors)
    offsets = record_offsets(stream)
    found = []
    for t in tensors:
        storage = t.untyped_storage()
        offset = getattr(storage, "_checkpoint_offset", None)
        if t.device.type != "meta" or offset is None or offsets.get(offset) != storage.nbytes():
            return False
        found.append(offset)
    for t, offset in zip(tensors, found):
        on_disk(t, path, base + offset)
    return True


class _TemplateError(Exception):
    """The ``skip_data`` output is not laid out as expected: use a plain ``torch.save``."""


def _read_template(path: Path) -> list[bytes | int]:
    """The file ``torch.save`` wrote under ``skip_data``: its bytes, with each storage record's data region (a hole
    the writer seeked over) replaced by its size."""
    with path.open("rb") as f:
        regions = sorted((offset, size) for offset, size in record_offsets(f).items() if size)
        f.seek(0, io.SEEK_END)
        end = f.tell()
        out: list[bytes | int] = []
        pos = 0
        for offset, size in [*regions, (end, 0)]:
            f.seek(pos)
            out.append(f.read(offset - pos))
            if size:
                out.append(size)
            pos = offset + size
    return out


class _Image(io.RawIOBase):
    """The template read back as a file (holes read as zeros), for ``zipfile``."""

    def __init__(self, segments: list[tuple[int, bytes | int]], size: int) -> None:
        super().__init__()
        self.segments = [(start, seg) for start, seg in segments if isinstance(seg, bytes)]
        self.starts = [start for start, _ in self.segments]
        self.size, self.pos = size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence] + offset
        return self.pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self.size - self.pos))
        view[:n] = bytes(n)
        i = max(0, bisect.bisect_right(self.starts, self.pos) - 1)
        while i < len(self.segments) and self.segments[i][0] < self.pos + n:
            start, seg = self.segments[i]
            lo, hi = max(start, self.pos), min(start + len(seg), self.pos + n)
            if lo < hi:
                view[lo - self.pos : hi - self.pos] = seg[lo - start : hi - start]
            i += 1
        self.pos += n
        return n


def _hash_combine(seed: int, value: int) -> int:
    """``c10::hash_combine`` on 64-bit size_t."""
    return (seed ^ ((value + 0x9E3779B9 + ((seed << 6) & _MASK64) + (seed >> 2)) & _MASK64)) & _MASK64


class _Plan:
    """Where the template's holes are, and the bytes to patch once the holes' CRC-32s are known."""

    def __init__(self, segments: list[bytes | int], sizes: list[int]) -> None:
        self.placed: list[tuple[int, bytes | int]] = []
        pos = 0
        for seg in segments:
            if seg != 0 and seg != b"":
                self.placed.append((pos, seg))
                pos += seg if isinstance(seg, int) else len(seg)
        holes = [(start, seg) for start, seg in self.placed if isinstance(seg, int)]
        if [n for _, n in holes] != sizes:
            raise _TemplateError(f"holes {[n for _, n in holes]} != storages {sizes}")
        self.image = _Image(self.placed, pos)
        self.entries: list[tuple[int, int, int, int]] = []
        """(data offset, size, CRC-32 in the template, central directory entry offset) per record, in order."""
        with zipfile.ZipFile(self.image) as z:
            cd_pos: int = z.start_dir
            infos = z.infolist()
        for info in infos:
            entry = self._read(cd_pos, 46)
            if entry[:4] != _CD_ENTRY or struct.unpack("<I", entry[42:46])[0] not in (info.header_offset, 0xFFFFFFFF):
                raise _TemplateError("central directory entry not where expected")
            name_len, extra_len = struct.unpack("<HH", self._read(info.header_offset + 26, 4))
            data = info.header_offset + 30 + name_len + extra_len
            if info.file_size and self._read(data + info.file_size, 4) != _DESCRIPTOR:
                raise _TemplateError("no data descriptor after a record")
            self.entries.append((data, info.file_size, info.CRC, cd_pos))
            n, m, k = struct.unpack("<HHH", entry[28:34])
            cd_pos += 46 + n + m + k
        self.holes = {start for start, _ in holes}
        if not infos or not _SERIALIZATION_ID.fullmatch(infos[-1].filename) or self.entries[-1][1] != 40:
            raise _TemplateError("no trailing 40-byte serialization_id record")
        if not self.holes <= {data for data, *_ in self.entries[:-1]}:
            raise _TemplateError("a hole is not a record's data")
        self.descriptor_of = {data: data + size for data, size, *_ in self.entries}

    def _read(self, offset: int, n: int) -> bytes:
        self.image.seek(offset)
        return self.image.read(n)

    def final_patches(self, crcs: Mapping[int, int]) -> dict[int, bytes]:
        """{file offset: bytes} of the central directory CRC-32s and the serialization_id record."""
        out: dict[int, bytes] = {}
        combined = 0
        for data, size, crc, cd in self.entries[:-1]:
            if data in self.holes:
                crc = crcs[data]
                out[cd + 16] = struct.pack("<I", crc)
            if size:  # torch combines the CRC of each data descriptor it writes (none for empty records)
                combined = _hash_combine(combined, crc)
        data, size, _, cd = self.entries[-1]
        old = self._read(data, size)
        if not old.isdigit():
            raise _TemplateError("serialization_id is not decimal digits")
        sid = old[:20] + f"{combined:020d}".encode()
        out[data] = sid
        out[data + size + 4] = out[cd + 16] = struct.pack("<I", zlib.crc32(sid))
        return out


def save_streamed(
    path: Path,
    state: Mapping[str, Any],
    models: Mapping[str, Mapping[str, Source]],
    *,
    buffers: StagingBuffers,
    reader: FileReader,
    direct: bool = True,
) -> None:
    """``torch.save({**state, **models})`` (``models``: entry name -> state dict, e.g. ``{"model": ...}``, or
    ``model0``, ``model1``, ... for Megatron's virtual pipeline chunks) with every tensor compact (its own storage,
    exactly its bytes), streamed from the sources (see the module doc); ``state`` must hold no tensors."""
    placeholders = {key: {k: torch.empty(shape_of(s), dtype=dtype_of(s)) for k, s in model.items()}
                    for key, model in models.items()}  # fmt: skip
    ordered = [s for model in models.values() for s in model.values()]  # the order torch pickles (and stores) them
    try:
        with tempfile.TemporaryDirectory(prefix="rl_ckpt_") as tmp:
            template = Path(tmp) / path.name  # torch names the records' folder after the file: same name
            with torch.serialization.skip_data():
                torch.save({**state, **placeholders}, template)
            segments = _read_template(template)
        plan = _Plan(segments, [n for n in map(nbytes_of, ordered) if n])
        final = plan.final_patches({start: 0 for start in plan.holes})  # checks the layout before writing
    except (_TemplateError, AttributeError, zipfile.BadZipFile, struct.error):
        whole = {key: {k: materialize(s).clone() for k, s in model.items()} for key, model in models.items()}
        torch.save({**state, **whole}, path)
        return
    del placeholders
    patches = sorted(_patches(plan, final), key=lambda p: p[0])
    sources = [s for s in ordered if nbytes_of(s)]
    prefetch = Prefetcher(reader, sources)
    first = 0  # patches before it lie in segments already written
    done = 0
    with StagedFile(path, buffers, direct=direct) as f:
        for start, seg in plan.placed:
            if isinstance(seg, int):
                prefetch.before(done)
                f.write_source(sources[done], reader, slot=start)
                done += 1
                continue
            end = start + len(seg)
            while first < len(patches) and patches[first][0] + patches[first][1] <= start:
                first += 1
            mine = [_clip(p, start, end) for p in patches[first:] if p[0] < end and p[0] + p[1] > start]
            f.write(seg, mine)


def _patches(plan: _Plan, final: Mapping[int, bytes]) -> list[tuple[int, int, Patch]]:
    """(file offset, length, patch) of each hole's data descriptor CRC-32 and of ``plan.final_patches``."""
    done: dict[int, bytes] = {}

    def descriptor(hole: int) -> Patch:
        return lambda crcs: struct.pack("<I", crcs[hole])

    def final_part(at: int) -> Patch:
        def patch(crcs: Mapping[int, int]) -> bytes:
            if not done:  # computed once, when the first of them is written (after the last hole's bytes)
                done.update(plan.final_patches(crcs))
            return done[at]

        return patch

    out = [(plan.descriptor_of[hole] + 4, 4, descriptor(hole)) for hole in plan.holes]
    return out + [(at, len(value), final_part(at)) for at, value in final.items()]


def _clip(patch: tuple[int, int, Patch], start: int, end: int) -> tuple[int, int, Patch]:
    """The part of a patch (at a file offset) inside the segment [start, end), at an offset relative to ``start``."""
    at, length, fn = patch
    lo, hi = max(at, start), min(at + length, end)
    return lo - start, hi - lo, lambda crcs: fn(crcs)[lo - at : hi - at]
