"""Bucketed weight transfer from a train strategy into inference engines (ROLL's model_update).

Two transports, chosen by placement:
- **colocated** (train and infer share devices, so the same node): train rank 0 packs each bucket into one of
  two persistent shared-memory slots and every inference worker on that host copies it into its parameters
  while the next bucket is packed (two copies per byte, pipelined; host memory bounded by two buckets).
  Receivers on another host, or a platform without POSIX shared memory, get the bucket through Ray's object store.
- **separate** (disjoint devices, possibly other nodes): train rank 0 and the inference workers form their own
  process group (gloo on CPU, nccl on GPU, created without touching the default group) and rank 0 broadcasts
  each bucket as one flat byte tensor.

Tied weights (``lm_head.weight`` sharing ``model.embed_tokens.weight``) cross the wire once; the receiver loads
them under every name, since some engines (vLLM's CPU backend) keep a separate packed copy of ``lm_head``.
Every train rank iterates the weights (un-sharding is a collective); only rank 0 sends.
"""

from __future__ import annotations

import datetime
import mmap
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024
SYNC_NAMES = ("module", "checkpoint", "adapters")
"""What a weight sync sends (:class:`rl_engines.model_update.ModelUpdater`'s ``names``)."""
_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
                               torch.int32, torch.uint8, torch.bool)}  # fmt: skip


@dataclass(frozen=True)
class TensorMeta:
    """Name, shape and dtype of one transferred tensor, plus the names it is also loaded under (tied weights)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    aliases: tuple[str, ...] = ()

    @property
    def nbytes(self) -> int:
        """Size in bytes."""
        return int(np.prod(self.shape, dtype=np.int64)) * _DTYPES[self.dtype].itemsize


@dataclass
class SyncStats:
    """What one sync moved and how long it took (reported as ``model_update/*`` metrics)."""

    bytes: int = 0
    tensors: int = 0
    buckets: int = 0
    seconds: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        """``time/model_update`` (s), ``model_update/bytes``, ``model_update/gigabytes_per_s``."""
        return {
            "time/model_update": self.seconds,
            "model_update/bytes": float(self.bytes),
            "model_update/tensors": float(self.tensors),
            "model_update/buckets": float(self.buckets),
            "model_update/gigabytes_per_s": self.bytes / max(self.seconds, 1e-9) / 1e9,
            **self.extra,
        }


def iter_buckets(
    weights: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    dtype: torch.dtype | None = None,
    *,
    on_host: bool = True,
) -> Iterator[list[tuple[TensorMeta, torch.Tensor]]]:
    """Group named tensors into buckets of at most ``bucket_bytes`` (a larger tensor travels alone).

    Tensors sharing storage with one earlier in the same bucket are folded into its ``aliases`` (senders yield
    tied names consecutively, so they share a bucket); ``dtype`` casts floating
    tensors (e.g. fp32 masters to the engine's bf16) before sending. Tensors are detached, contiguous and, with
    ``on_host`` (what leaves the process), on CPU; else on the device they came from.
    """
    pending: list[tuple[TensorMeta, torch.Tensor]] = []
    size = 0
    seen: dict[tuple[int, int], int] = {}
    for name, tensor in weights:
        key = (int(tensor.untyped_storage().data_ptr()), int(tensor.storage_offset()))
        if key in seen and tensor.data_ptr() != 0:  # tied to a tensor of this bucket: send once
            index = seen[key]
            meta, value = pending[index]
            pending[index] = (TensorMeta(meta.name, meta.shape, meta.dtype, (*meta.aliases, name)), value)
            continue
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        value = tensor.detach().contiguous()
        value = value.cpu() if on_host else value
        meta = TensorMeta(name, tuple(value.shape), str(value.dtype))
        if pending and size + meta.nbytes > bucket_bytes:
            yield pending
            pending, size, seen = [], 0, {}
        seen[key] = len(pending)
        pending.append((meta, value))
        size += meta.nbytes
    if pending:
        yield pending


def _as_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A zero-copy uint8 numpy view of a contiguous CPU tensor of any dtype."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


def _from_bytes(buffer: np.ndarray | torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only shared-memory buffers: we only read them
        raw = torch.from_numpy(buffer) if isinstance(buffer, np.ndarray) else buffer
    return raw.view(_DTYPES[meta.dtype]).view(meta.shape)


def expand_aliases(items: Iterable[tuple[TensorMeta, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every name a tensor is loaded under."""
    for meta, tensor in items:
        yield meta.name, tensor
        for alias in meta.aliases:
            yield alias, tensor


# ---- a guest in the sender's own process (rl_engines.shared_processes) ------------------------------------------
def load_in_process(
    weights: Iterable[tuple[str, torch.Tensor]],
    load: Callable[[Iterable[tuple[str, torch.Tensor]]], int],
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype | None = None,
) -> SyncStats:
    """Sync into an engine of the same process: the buckets a colocated sync would send (same casts, same
    tied-weight aliases), handed to ``load`` (the engine's ``load_weights``, which copies them) on their device."""
    stats, start = SyncStats(), time.perf_counter()
    for bucket in iter_buckets(weights, bucket_bytes, dtype, on_host=False):
        load(expand_aliases(bucket))
        stats.buckets += 1
        stats.tensors += len(bucket)
        stats.bytes += sum(meta.nbytes for meta, _ in bucket)
    stats.seconds = time.perf_counter() - start
    return stats


# ---- colocated: Ray object store --------------------------------------------------------------------------
def pack_for_store(bucket: list[tuple[TensorMeta, torch.Tensor]]) -> list[tuple[TensorMeta, np.ndarray]]:
    """The bucket as numpy views, which Ray serialises out-of-band (one copy into shared memory)."""
    return [(meta, _as_bytes(tensor)) for meta, tensor in bucket]


def unpack_from_store(payload: list[tuple[TensorMeta, np.ndarray]]) -> list[tuple[TensorMeta, torch.Tensor]]:
    """Tensors viewing the shared-memory buffers (no copy)."""
    return [(meta, _from_bytes(array, meta)) for meta, array in payload]


# ---- colocated, same host: persistent shared-memory slots -------------------------------------------------
SHM_DIR = Path("/dev/shm")


def shared_memory_available() -> bool:
    """Shared-memory staging needs a POSIX shm file system (Linux); elsewhere the object store is used."""
    return SHM_DIR.is_dir()


class SharedStaging:
    """Sender side: ``slots`` shared-memory buffers, created once and reused by every sync.

    The sender packs a bucket into a slot (one copy) while receivers on the same host copy the previous slot into
    their parameters (one copy each); mappings persist across syncs, so no page faults are paid again. Slots are
    created through ``multiprocessing.shared_memory``, whose resource tracker unlinks them even when the worker is
    killed; :meth:`close` unlinks them at once.
    """

    def __init__(self, slot_bytes: int, slots: int = 2) -> None:
        self.slot_bytes = slot_bytes
        self._slots: list[Any] = [self._create(slot_bytes) for _ in range(slots)]

    @staticmethod
    def _create(size: int) -> Any:
        from multiprocessing import shared_memory

        return shared_memory.SharedMemory(create=True, size=max(size, 1), name=f"rl_sync_{uuid.uuid4().hex[:16]}")

    def __len__(self) -> int:
        return len(self._slots)

    def slot(self, index: int, nbytes: int) -> tuple[str, torch.Tensor]:
        """Name and byte view of slot ``index``, grown to ``nbytes`` when a tensor is larger than a bucket."""
        if self._slots[index].size < nbytes:
            self._slots[index].close()
            self._slots[index].unlink()
            self._slots[index] = self._create(nbytes)
        shm = self._slots[index]
        return shm.name, torch.frombuffer(shm.buf, dtype=torch.uint8, count=shm.size)

    def close(self) -> None:
        """Unlink every slot (receivers keep their mappings until they drop them)."""
        for shm in self._slots:
            shm.close()
            shm.unlink()
        self._slots = []


class SharedStagingReader:
    """Receiver side: maps the sender's slots by name (plain mmap, so no resource tracker claims them)."""

    def __init__(self) -> None:
        self._maps: dict[str, tuple[mmap.mmap, torch.Tensor]] = {}

    def view(self, name: str) -> torch.Tensor:
        """A byte tensor over the named slot, mapped on first use and kept."""
        if name not in self._maps:
            with open(SHM_DIR / name, "r+b") as handle:
                mapped = mmap.mmap(handle.fileno(), 0)
            self._maps = {n: m for n, m in self._maps.items() if (SHM_DIR / n).exists()}  # drop replaced slots
            self._maps[name] = (mapped, torch.frombuffer(mapped, dtype=torch.uint8))
        return self._maps[name][1]

    def read(self, name: str, metas: list[TensorMeta]) -> list[tuple[TensorMeta, torch.Tensor]]:
        """The bucket's tensors as views into the slot (no copy)."""
        flat, offset, bucket = self.view(name), 0, []
        for meta in metas:
            bucket.append((meta, _from_bytes(flat[offset : offset + meta.nbytes], meta)))
            offset += meta.nbytes
        return bucket


def send_on_host(
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    staging: SharedStaging | None,
    shm_receivers: list[Any],
    store_receivers: list[Any],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype | None = None,
    timeout_s: float | None = None,
    load: Callable[[Iterable[tuple[str, torch.Tensor]]], int] | None = None,
) -> SyncStats:
    """Colocated sync, sender side. Same-host receivers read alternating shared-memory slots
    (``receive_shared_bucket``); the others get each bucket through the object store (``receive_weight_bucket``).
    A slot is reused only after every receiver copied its previous bucket out, so at most two are in flight.
    ``load``: an engine in this process (:func:`load_in_process`) takes each bucket too."""
    import ray

    if shm_receivers and staging is None:
        raise ValueError("shared-memory receivers need a SharedStaging")
    stats, start = SyncStats(), time.perf_counter()
    slots = len(staging) if staging is not None else 2
    in_flight: list[list[Any]] = [[] for _ in range(slots)]
    for index, bucket in enumerate(iter_buckets(weights, bucket_bytes, dtype)):
        slot = index % slots
        ray.get(in_flight[slot], timeout=timeout_s)  # the slot's previous bucket has been copied out
        metas = [meta for meta, _ in bucket]
        calls = []
        if shm_receivers and staging is not None:
            name = _pack_into_slot(staging, slot, bucket)
            calls += [receiver.receive_shared_bucket.remote(name, metas) for receiver in shm_receivers]
        if store_receivers:
            ref = ray.put(pack_for_store(bucket))
            calls += [receiver.receive_weight_bucket.remote(ref) for receiver in store_receivers]
        in_flight[slot] = calls
        if load is not None:
            load(expand_aliases(bucket))
        stats.buckets += 1
        stats.tensors += len(bucket)
        stats.bytes += sum(meta.nbytes for meta in metas)
    ray.get([ref for refs in in_flight for ref in refs], timeout=timeout_s)
    stats.seconds = time.perf_counter() - start
    return stats


def _pack_into_slot(staging: SharedStaging, slot: int, bucket: list[tuple[TensorMeta, torch.Tensor]]) -> str:
    name, flat = staging.slot(slot, sum(meta.nbytes for meta, _ in bucket))
    offset = 0
    for meta, tensor in bucket:
        flat[offset : offset + meta.nbytes].copy_(tensor.reshape(-1).view(torch.uint8))
        offset += meta.nbytes
    return name


# ---- separate: a dedicated collective group ----------------------------------------------------------------
class BroadcastGroup:
    """A process group of train rank 0 (rank 0 here) and the inference workers, apart from the default group."""

    def __init__(
        self,
        master_addr: str,
        master_port: int,
        rank: int,
        world_size: int,
        timeout_s: float,
        backend: str | None = None,
    ) -> None:
        """``backend`` None = nccl when this process sees a GPU, else gloo (nccl needs one GPU per rank)."""
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(master_addr, master_port, world_size, rank == 0, timeout=timeout)  # type: ignore[attr-defined]
        prefix = dist.PrefixStore("rl_engines_weight_sync", store)  # type: ignore[attr-defined]
        self.store = store
        self.rank = rank
        use_nccl = backend == "nccl" or (backend is None and torch.cuda.is_available())
        self.device = torch.device("cuda", torch.cuda.current_device()) if use_nccl else None
        if self.device is not None:
            self.group: Any = dist.ProcessGroupNCCL(prefix, rank, world_size, dist.ProcessGroupNCCL.Options())
        else:
            self.group = dist.ProcessGroupGloo(prefix, rank, world_size, timeout)

    def broadcast(self, flat: torch.Tensor) -> torch.Tensor:
        """Broadcast a flat uint8 tensor from rank 0 (through the GPU under nccl); returns it on CPU."""
        tensor = flat if self.device is None else flat.to(self.device)
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([tensor], options).wait()
        return tensor.cpu() if self.device is not None else tensor


def send_by_broadcast(
    weights: Iterable[tuple[str, torch.Tensor]],
    group: BroadcastGroup,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype | None = None,
) -> SyncStats:
    """Rank 0 side: broadcast a header (the bucket's metas as JSON bytes) then the flat bucket."""
    stats, start = SyncStats(), time.perf_counter()
    for bucket in iter_buckets(weights, bucket_bytes, dtype):
        _broadcast_header(group, [meta for meta, _ in bucket])
        group.broadcast(torch.cat([tensor.reshape(-1).view(torch.uint8) for _, tensor in bucket]))
        stats.buckets += 1
        stats.tensors += len(bucket)
        stats.bytes += sum(meta.nbytes for meta, _ in bucket)
    _broadcast_header(group, [])  # end of stream
    stats.seconds = time.perf_counter() - start
    return stats


def receive_by_broadcast(group: BroadcastGroup) -> Iterator[list[tuple[TensorMeta, torch.Tensor]]]:
    """Receiver side: yields each bucket's tensors until the sender's end-of-stream header."""
    while True:
        metas = _broadcast_header(group, None)
        if not metas:
            return
        flat = group.broadcast(torch.empty(sum(meta.nbytes for meta in metas), dtype=torch.uint8))
        offset, bucket = 0, []
        for meta in metas:
            bucket.append((meta, _from_bytes(flat[offset : offset + meta.nbytes], meta)))
            offset += meta.nbytes
        yield bucket


def _broadcast_header(group: BroadcastGroup, metas: list[TensorMeta] | None) -> list[TensorMeta]:
    """Rank 0 sends ``metas`` (JSON), the others receive them: a length broadcast, then the bytes."""
    import json

    if group.rank == 0:
        payload = json.dumps([[m.name, list(m.shape), m.dtype, list(m.aliases)] for m in metas or []]).encode()
        length = torch.tensor([len(payload)], dtype=torch.int64).view(torch.uint8)
        group.broadcast(length.clone())
        group.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        return list(metas or [])
    size = int(group.broadcast(torch.zeros(8, dtype=torch.uint8)).view(torch.int64)[0])
    raw = bytes(group.broadcast(torch.empty(size, dtype=torch.uint8)).numpy().tobytes())
    return [TensorMeta(n, tuple(s), d, tuple(a)) for n, s, d, a in json.loads(raw.decode())]
