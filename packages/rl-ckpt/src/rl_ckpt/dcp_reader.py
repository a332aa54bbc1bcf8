"""torch.distributed.checkpoint (DCP) folders, read without a process group and without running code from them.

A DCP folder holds ``.metadata`` (a pickle: for every tensor its global shape, dtype and the chunks it was saved in,
and for every chunk the file, byte offset and length) and the data files (``__<rank>_<n>.distcp``), in which each
chunk is a ``torch.save`` blob. :class:`DcpFolder` reads the metadata with an allow-listed unpickler and plans
any region of a tensor (the whole tensor, or one index of its leading dimension) as views of just the chunks that
cover it, concatenated (``sources``): each chunk is opened once with ``torch.load(weights_only=True)`` on the meta
device and its bytes are read only when written out, only the region's. Non-tensor entries (pickled objects) are
never loaded.
"""

from __future__ import annotations

import io
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rl_ckpt.errors import CheckpointError
from rl_ckpt.safe_load import load_restricted_pickle, load_torch_bytes
from rl_ckpt.sources import Concat, Source, cat, materialize, shape_of
from rl_ckpt.torch_zip import locate_storages

METADATA_FILE = ".metadata"
_DCP_METADATA_CLASSES = (
    "Metadata",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorProperties",
    "MetadataIndex",
    "StorageMeta",
    "_MEM_FORMAT_ENCODING",
)


@dataclass(frozen=True)
class Chunk:
    """One saved piece of a tensor: where it sits in the global tensor and where its bytes are."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    """Data file, relative to the folder."""
    start: int
    length: int


@dataclass(frozen=True)
class TensorEntry:
    """A tensor of the checkpoint: global shape, dtype and its chunks."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[Chunk, ...]


def metadata_allow_list() -> dict[tuple[str, str], Any]:
    """The names a DCP ``.metadata`` pickle may resolve: DCP's metadata dataclasses, torch sizes / dtypes / layouts."""
    from torch.distributed.checkpoint import filesystem
    from torch.distributed.checkpoint import metadata as dcp_metadata

    allowed: dict[tuple[str, str], Any] = {
        ("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name) for name in _DCP_METADATA_CLASSES
    }
    allowed["torch.distributed.checkpoint.filesystem", "_StorageInfo"] = filesystem._StorageInfo
    allowed["torch.serialization", "_get_layout"] = torch.serialization._get_layout
    allowed["torch", "Size"] = torch.Size
    allowed["collections", "OrderedDict"] = OrderedDict
    for name, value in vars(torch).items():
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            allowed["torch", name] = value
    return allowed


def _chunk(path: Path, key: str, chunk: Any, storage: dict[tuple[str, tuple[int, ...]], Any]) -> Chunk:
    offsets = tuple(int(o) for o in chunk.offsets)
    info = storage.get((key, offsets))
    if info is None:
        raise CheckpointError(f"{path / METADATA_FILE}: no storage entry for chunk {offsets} of {key}; file corrupt")
    if getattr(info, "transform_descriptors", None):
        raise CheckpointError(
            f"{path}: tensor {key} is stored with transforms {info.transform_descriptors} (e.g. compression), "
            "which rl-ckpt does not read yet"
        )
    sizes = tuple(int(s) for s in chunk.sizes)
    return Chunk(offsets, sizes, str(info.relative_path), int(info.offset), int(info.length))


def parse_metadata(path: Path, metadata: Any) -> dict[str, TensorEntry]:
    """The tensor entries of an unpickled ``.metadata`` (pickled-object entries are left out)."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path / METADATA_FILE} is not torch.distributed.checkpoint metadata")
    storage = {
        (index.fqn, tuple(int(o) for o in index.offset or ())): info for index, info in metadata.storage_data.items()
    }
    entries: dict[str, TensorEntry] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            chunks = tuple(_chunk(path, key, c, storage) for c in meta.chunks)
            entries[key] = TensorEntry(key, tuple(int(s) for s in meta.size), meta.properties.dtype, chunks)
    return entries


class _FileSlice(io.RawIOBase):
    """Read-only view of bytes [start, start + length) of an open file (torch.load needs a seekable stream)."""

    def __init__(self, f: io.BufferedReader, start: int, length: int) -> None:
        super().__init__()
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = min(max(base + offset, 0), self.length)
        return self.pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        count = min(len(view), self.length - self.pos)
        self.f.seek(self.start + self.pos)
        got = self.f.readinto(view[:count])
        self.pos += got
        return got


def _overlap(chunk: Chunk, lo: list[int], hi: list[int]) -> tuple[list[slice], list[slice]] | None:
    """(slices into the chunk, slices into the region [lo, hi)) of their intersection; None when disjoint."""
    src, dst = [], []
    for off, size, a, b in zip(chunk.offsets, chunk.sizes, lo, hi):
        start, stop = max(off, a), min(off + size, b)
        if start >= stop:
            return None
        src.append(slice(start - off, stop - off))
        dst.append(slice(start - a, stop - a))
    return src, dst


class DcpFolder:
    """A DCP folder's tensors, read region by region (no process group, no code from the files)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        metadata_file = path / METADATA_FILE
        if not metadata_file.is_file():
            raise CheckpointError(f"{path} has no {METADATA_FILE}: the dist checkpoint is incomplete or still saving")
        self.tensors = parse_metadata(path, load_restricted_pickle(metadata_file, metadata_allow_list()))
        self._check_files()
        self._on_disk: dict[tuple[str, int], torch.Tensor] = {}

    def _check_files(self) -> None:
        """Raise naming the first data file that is missing or shorter than its chunks need."""
        needed: dict[str, tuple[int, str]] = {}
        for entry in self.tensors.values():
            for c in entry.chunks:
                end = max(needed.get(c.file, (0, ""))[0], c.start + c.length)
                needed[c.file] = (end, entry.key)
        for name, (end, key) in sorted(needed.items()):
            file = self.path / name
            if not file.is_file():
                raise CheckpointError(
                    f"missing data file {file} (it holds chunks of {key}, among others); the dist checkpoint is "
                    "incomplete: copy every __*.distcp file of the iteration folder"
                )
            if file.stat().st_size < end:
                raise CheckpointError(f"data file {file} is truncated ({file.stat().st_size} < {end} bytes)")

    def entry(self, key: str) -> TensorEntry:
        """The entry of ``key``; raises naming the folder when the checkpoint has no such tensor."""
        if key not in self.tensors:
            raise CheckpointError(f"tensor {key} is missing from the dist checkpoint {self.path}")
        return self.tensors[key]

    def _load_chunk(self, entry: TensorEntry, chunk: Chunk, *, meta: bool = False) -> torch.Tensor:
        where = f"chunk {chunk.offsets} of {entry.key} in {self.path / chunk.file}"
        with (self.path / chunk.file).open("rb") as f:
            stream = io.BufferedReader(_FileSlice(f, chunk.start, chunk.length))
            tensor = load_torch_bytes(stream, where, meta=meta)
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != chunk.sizes:
                raise CheckpointError(f"{where} does not hold a tensor of shape {chunk.sizes}; the file is corrupt")
            if meta and not locate_storages([tensor], self.path / chunk.file, chunk.start, stream):
                return self._load_chunk(entry, chunk)  # offsets not checked: read it into memory
        return tensor

    def _chunk(self, entry: TensorEntry, chunk: Chunk) -> torch.Tensor:
        """The chunk's tensor, left on disk (opened once) or, failing that, read into memory."""
        key = (chunk.file, chunk.start)
        if key in self._on_disk:
            return self._on_disk[key]
        tensor = self._load_chunk(entry, chunk, meta=True)
        if tensor.device.type == "meta":
            self._on_disk[key] = tensor
        return tensor

    def view(self, key: str, index: int | tuple[int, ...] | None = None) -> Source:
        """Tensor ``key`` whole, or ``key[index]`` (one stacked layer; a tuple: one entry of the leading
        dimensions, e.g. (layer, expert)), as views of its chunks, concatenated."""
        entry = self.entry(key)
        lo, hi = _region(entry.shape, index)
        pieces: list[tuple[tuple[int, ...], Source]] = []
        for chunk in entry.chunks:
            parts = _overlap(chunk, lo, hi)
            if parts is not None:
                corner = tuple(int(s.start) for s in parts[1])
                pieces.append((corner, self._chunk(entry, chunk)[tuple(parts[0])]))
        tiled = _tile(pieces, tuple(b - a for a, b in zip(lo, hi)), 0) if pieces else None
        if tiled is None:  # chunks not on a grid (or not covering the region): copy them into place
            return self._read_copy(key, index)
        for _ in _leading(index):
            tiled = _drop_leading(tiled)
        return tiled

    def read(self, key: str, index: int | tuple[int, ...] | None = None) -> torch.Tensor:
        """Tensor ``key`` whole, or ``key[index]`` (one slice of the leading dimension(s), see :meth:`view`)."""
        return materialize(self.view(key, index))

    def _read_copy(self, key: str, index: int | tuple[int, ...] | None) -> torch.Tensor:
        entry = self.entry(key)
        lo, hi = _region(entry.shape, index)
        out = torch.empty([b - a for a, b in zip(lo, hi)], dtype=entry.dtype)
        filled = 0
        for chunk in entry.chunks:
            parts = _overlap(chunk, lo, hi)
            if parts is not None:
                region = out[tuple(parts[1])]
                region.copy_(materialize(self._chunk(entry, chunk)[tuple(parts[0])]))
                filled += region.numel()
        if filled != out.numel():
            raise CheckpointError(
                f"{self.path}: the chunks of {key} cover {filled} of the {out.numel()} elements read; the metadata "
                "is inconsistent"
            )
        return out[(0,) * len(_leading(index))] if index is not None else out


def _leading(index: int | tuple[int, ...] | None) -> tuple[int, ...]:
    return () if index is None else (index,) if isinstance(index, int) else tuple(index)


def _region(shape: Sequence[int], index: int | tuple[int, ...] | None) -> tuple[list[int], list[int]]:
    """[lo, hi) per dimension of ``shape`` around the leading-dimension entry ``index``."""
    lo, hi = [0] * len(shape), list(shape)
    for dim, at in enumerate(_leading(index)):
        lo[dim], hi[dim] = at, at + 1
    return lo, hi


def _tile(pieces: list[tuple[tuple[int, ...], Source]], shape: tuple[int, ...], dim: int) -> Source | None:
    """The box ``shape`` as concatenations of ``pieces`` ((corner, source) each), when they tile it as a grid
    (dims in order: rows of pieces, then pieces within a row, ...); None otherwise."""
    if dim == len(shape):
        return pieces[0][1] if len(pieces) == 1 else None
    by_start: dict[int, list[tuple[tuple[int, ...], Source]]] = {}
    for corner, piece in pieces:
        by_start.setdefault(corner[dim], []).append((corner, piece))
    parts, at = [], 0
    for start in sorted(by_start):
        group = by_start[start]
        extents = {shape_of(piece)[dim] for _, piece in group}
        if start != at or len(extents) != 1:
            return None
        extent = extents.pop()
        sub = _tile(group, (*shape[:dim], extent, *shape[dim + 1 :]), dim + 1)
        if sub is None:
            return None
        parts.append(sub)
        at += extent
    return cat(parts, dim) if at == shape[dim] else None


def _drop_leading(src: Source) -> Source:
    """``src[0]`` of a source whose leading dimension has size 1."""
    if isinstance(src, Concat):
        return Concat([_drop_leading(p) for p in src.parts], src.dim - 1)
    return src[0]
