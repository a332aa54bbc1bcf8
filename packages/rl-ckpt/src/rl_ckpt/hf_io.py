"""HuggingFace folders: lazy safetensors reading, a streaming sharded safetensors writer, config and tokenizer."""

from __future__ import annotations

import json
import re
import shutil
import struct
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rl_ckpt.errors import CheckpointError
from rl_ckpt.sources import Source, dtype_of, materialize, nbytes_of, on_disk, shape_of
from rl_ckpt.spec import ModelSpec, hf_config_dict
from rl_ckpt.staged_file import StagedFile, StagingBuffers
from rl_ckpt.stream_io import FileReader, Prefetcher

INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str | int) -> int:
    """``"5GB"`` -> 5_000_000_000 (decimal units as in transformers; KiB / MiB / GiB binary); ints pass through."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise CheckpointError(f"--max_shard_size {text!r} is not a size like 5GB, 500MB or 2GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


class HFCheckpoint:
    """A HF model folder read lazily: one tensor at a time from its safetensors shard."""

    def __init__(self, path: Path) -> None:
        self.path = path
        config = path / "config.json"
        if not config.is_file():
            raise CheckpointError(f"{path} has no config.json; is --checkpoint_path a HuggingFace model folder?")
        self.config: dict[str, Any] = json.loads(config.read_text(encoding="utf-8"))
        self.weight_map = self._weight_map()
        self.aliases: dict[str, str] = {}
        """Other names of tensors (a vision-language model's text-model names: see :meth:`read_as`)."""
        self._handles: dict[str, Any] = {}
        self._headers: dict[str, tuple[dict[str, Any], int]] = {}

    def _weight_map(self) -> dict[str, str]:
        index = self.path / INDEX_FILE
        if index.is_file():
            return dict(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
        single = self.path / "model.safetensors"
        if not single.is_file():
            raise CheckpointError(
                f"{self.path} has neither {INDEX_FILE} nor model.safetensors (only safetensors weights are read; "
                "re-save the model with save_pretrained(..., safe_serialization=True))"
            )
        with safe_open(str(single), framework="pt") as f:
            return dict.fromkeys(f.keys(), "model.safetensors")

    def __contains__(self, name: str) -> bool:
        return self.aliases.get(name, name) in self.weight_map

    def read_as(self, text_name: Callable[[str], str]) -> None:
        """Read every tensor also under ``text_name`` of its name in the files (a vision-language model's language
        model and vision tower under its text twin's names and ``visual.*``: ``rl_ckpt.spec.vl_text_name``)."""
        self.aliases = {text_name(name): name for name in self.weight_map if text_name(name) != name}

    def _handle(self, name: str) -> Any:
        name = self.aliases.get(name, name)
        if name not in self.weight_map:
            raise CheckpointError(f"tensor {name!r} is missing from {self.path}")
        file = self.weight_map[name]
        if file not in self._handles:
            self._handles[file] = safe_open(str(self.path / file), framework="pt")
        return self._handles[file]

    def get(self, name: str) -> torch.Tensor:
        """Tensor ``name`` (a copy); raises naming the folder when it is missing."""
        tensor: torch.Tensor = self._handle(name).get_tensor(self.aliases.get(name, name))
        return tensor

    def lazy(self, name: str) -> torch.Tensor:
        """Tensor ``name`` left on disk: a meta tensor marked with its file and offset (see ``sources``); slices
        of it read only their bytes when written or materialized. Unknown dtypes are read into memory."""
        name = self.aliases.get(name, name)
        if name not in self.weight_map:
            raise CheckpointError(f"tensor {name!r} is missing from {self.path}")
        file = self.weight_map[name]
        if file not in self._headers:
            self._headers[file] = safetensors_header(self.path / file)
        header, data_start = self._headers[file]
        entry = header.get(name)
        if not isinstance(entry, dict) or entry.get("dtype") not in _TORCH_DTYPES:
            return self.get(name)
        begin, end = (int(x) for x in entry["data_offsets"])
        meta = torch.empty(tuple(int(n) for n in entry["shape"]), dtype=_TORCH_DTYPES[entry["dtype"]], device="meta")
        if meta.numel() * meta.element_size() != end - begin:
            raise CheckpointError(f"{self.path / file}: tensor {name} has {end - begin} bytes for shape {meta.shape}")
        return on_disk(meta, self.path / file, data_start + begin)

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of tensor ``name``, read from the file header only."""
        return tuple(int(n) for n in self._handle(name).get_slice(self.aliases.get(name, name)).get_shape())

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """``tensor[start:stop]`` of ``name`` as a zero-copy view of the memory-mapped file (copy it to keep it)."""
        view: torch.Tensor = self._handle(name).get_slice(self.aliases.get(name, name))[start:stop]
        return view

    def get_columns(self, name: str, start: int, stop: int) -> torch.Tensor:
        """``tensor[:, start:stop]`` of ``name``, a strided view of the memory-mapped file."""
        view: torch.Tensor = self._handle(name).get_slice(self.aliases.get(name, name))[:, start:stop]
        return view

    def release(self) -> None:
        """Close the memory-mapped files: the pages read so far stop counting in this process's memory."""
        self._handles.clear()

    def generation_config(self) -> dict[str, Any] | None:
        """generation_config.json as a dict, when the folder has one."""
        file = self.path / "generation_config.json"
        return dict(json.loads(file.read_text(encoding="utf-8"))) if file.is_file() else None


_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_TORCH_DTYPES = {name: dtype for dtype, name in _SAFETENSORS_DTYPES.items()}


def safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """(JSON header, byte offset of the data) of a safetensors file; raises naming the file when malformed."""
    with path.open("rb") as f:
        head = f.read(8)
        size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < size <= 100 * 2**20:
            raise CheckpointError(f"{path} is not a safetensors file (header length {size})")
        try:
            header: dict[str, Any] = json.loads(f.read(size))
        except ValueError as err:
            raise CheckpointError(f"{path}: unreadable safetensors header ({err})") from None
    return header, 8 + size


def write_safetensors(
    path: Path,
    tensors: Mapping[str, Source],
    metadata: dict[str, str],
    *,
    buffers: StagingBuffers | None = None,
    reader: FileReader | None = None,
    direct: bool = True,
) -> None:
    """A safetensors file streamed from the sources (``safetensors.torch.save_file`` would first copy every tensor
    into one bytes object): 8-byte header length, JSON header, then the data in ``tensors``' order, each source
    read straight into the write buffers (see ``stream_io``).

    Falls back to ``save_file`` for dtypes outside the table above and on big-endian machines.
    """
    if sys.byteorder != "little" or any(dtype_of(t) not in _SAFETENSORS_DTYPES for t in tensors.values()):
        save_file({k: materialize(t).contiguous() for k, t in tensors.items()}, str(path), metadata=metadata)
        return
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors.items():
        size = nbytes_of(t)
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype_of(t)],
            "shape": list(shape_of(t)),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    own_reader = reader is None
    reader = FileReader() if reader is None else reader
    sources = list(tensors.values())
    prefetch = Prefetcher(reader, sources)
    try:
        with StagedFile(path, buffers or StagingBuffers(), direct=direct) as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for i, t in enumerate(sources):
                prefetch.before(i)
                f.write_source(t, reader)
    finally:
        if own_reader:
            reader.close()


class ShardedSafetensorsWriter:
    """Writes tensors as they come into ``model-0000X-of-0000Y.safetensors`` shards plus the index.

    Queues sources (tensors in memory, or on disk and not read yet, see ``sources``) up to one shard
    (``max_shard_bytes``, or one tensor when that is larger), then streams them into the shard file through a few
    reused 16 MiB buffers: a source on disk is read only then, so the memory held is the queued in-memory tensors
    plus the buffers. Shards get their final ``-of-N`` names in :meth:`close`, when N is known. ``direct``: write
    with O_DIRECT where the file system takes it (see ``stream_io``).
    """

    def __init__(self, out_dir: Path, max_shard_bytes: int, *, direct: bool = True) -> None:
        self.out_dir = out_dir
        self.max_shard_bytes = max_shard_bytes
        self.direct = direct
        self._buffer: dict[str, Source] = {}
        self._buffer_bytes = 0
        self._files: list[Path] = []
        self._where: dict[str, int] = {}
        self.total_bytes = 0
        self._staging: StagingBuffers | None = None
        self._reader = FileReader()
        out_dir.mkdir(parents=True, exist_ok=True)

    def add(self, name: str, tensor: Source) -> None:
        """Queue ``tensor`` as ``name`` (not copied: do not change it before :meth:`close`); raises when a name
        comes twice."""
        if name in self._where or name in self._buffer:
            raise CheckpointError(f"tensor {name!r} was produced twice; the checkpoint has duplicate layers")
        size = nbytes_of(tensor)
        if self._buffer and self._buffer_bytes + size > self.max_shard_bytes:
            self.flush()
        self._buffer[name] = tensor
        self._buffer_bytes += size
        self.total_bytes += size
        if self._buffer_bytes >= self.max_shard_bytes:
            self.flush()

    def flush(self) -> None:
        """Write the buffered tensors as the next shard and drop them."""
        if not self._buffer:
            return
        path = self.out_dir / f".partial-{len(self._files) + 1:05d}.safetensors"
        if self._staging is None:
            self._staging = StagingBuffers()
        write_safetensors(
            path, self._buffer, {"format": "pt"}, buffers=self._staging, reader=self._reader, direct=self.direct
        )
        self._where.update(dict.fromkeys(self._buffer, len(self._files)))
        self._files.append(path)
        self._buffer, self._buffer_bytes = {}, 0

    def close(self) -> dict[str, str]:
        """Flush, give the shards their final names, write the index; returns the weight map."""
        try:
            self.flush()
        finally:
            self._reader.close()
        n = len(self._files)
        names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for path, name in zip(self._files, names):
            path.replace(self.out_dir / name)
        weight_map = {key: names[i] for key, i in sorted(self._where.items())}
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        return weight_map


def write_hf_config(out_dir: Path, spec: ModelSpec, dtype: torch.dtype) -> None:
    """config.json through transformers' config class when importable (validates it), else as plain JSON."""
    cfg = hf_config_dict(spec, str(dtype).removeprefix("torch."))
    try:
        from transformers import AutoConfig
    except ImportError:
        (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
        return
    kwargs = {k: v for k, v in cfg.items() if k != "model_type"}
    AutoConfig.for_model(str(cfg.get("model_type", spec.model_type)), **kwargs).save_pretrained(out_dir)


def write_generation_config(out_dir: Path, generation: dict[str, Any] | None, tokenizer_path: Path | None) -> None:
    """generation_config.json from the carried dict, else copied from the tokenizer folder, else not written."""
    if generation is not None:
        text = json.dumps(generation, indent=2) + "\n"
        (out_dir / "generation_config.json").write_text(text, encoding="utf-8")
    elif tokenizer_path is not None and (tokenizer_path / "generation_config.json").is_file():
        shutil.copy2(tokenizer_path / "generation_config.json", out_dir / "generation_config.json")


def copy_tokenizer(tokenizer_path: Path, out_dir: Path) -> list[str]:
    """Copy the tokenizer files found in ``tokenizer_path``; raises when there are none."""
    if not tokenizer_path.is_dir():
        raise CheckpointError(f"--tokenizer_path {tokenizer_path} is not a folder")
    copied = [name for name in TOKENIZER_FILES if (tokenizer_path / name).is_file()]
    if not copied:
        raise CheckpointError(f"--tokenizer_path {tokenizer_path} holds none of {', '.join(TOKENIZER_FILES)}")
    for name in copied:
        shutil.copy2(tokenizer_path / name, out_dir / name)
    return copied


def vocab_size_from_tokenizer(tokenizer_path: Path) -> int | None:
    """The model vocabulary size known from a tokenizer folder: its config.json, else tokenizer.json's size."""
    config = tokenizer_path / "config.json"
    if config.is_file():
        size = json.loads(config.read_text(encoding="utf-8")).get("vocab_size")
        return int(size) if size else None
    tok = tokenizer_path / "tokenizer.json"
    if not tok.is_file():
        return None
    data = json.loads(tok.read_text(encoding="utf-8"))
    ids = set(data.get("model", {}).get("vocab", {}).values()) | {t["id"] for t in data.get("added_tokens", [])}
    return max(ids) + 1 if ids else None
