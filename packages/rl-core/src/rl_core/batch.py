"""A batch container for one rollout (ROLL / verl call it ``DataProto``).

``RolloutBatch`` holds named tensors that share the batch dimension (``batch``), per-sample non-tensor values
as numpy object arrays of the same length (``non_tensor_batch``: prompts, ground truths, tags), and free-form
``meta_info``. The attribute names match verl's DataProto, so code written for one reads the other and
rl-replay dumps either.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


class BatchSizeError(ValueError):
    """A batch cannot be split the way a config asks."""


def _as_object_array(values: Any, key: str) -> np.ndarray:
    if isinstance(values, np.ndarray):
        return values
    array = np.empty(len(values), dtype=object)
    array[:] = list(values)
    if array.ndim != 1:
        raise ValueError(f"non_tensor_batch[{key!r}] must be one value per sample")
    return array


def _tensor_to_wire(tensor: torch.Tensor) -> tuple[np.ndarray, str, str]:
    """A CPU numpy array holding the tensor's bytes (bf16 travels as int16), its dtype and its device."""
    value = tensor.detach().cpu().contiguous()
    dtype = str(value.dtype).removeprefix("torch.")
    if value.dtype == torch.bfloat16:
        value = value.view(torch.int16)
    return value.numpy(), dtype, str(tensor.device)


def _tensor_from_wire(array: np.ndarray, dtype: str, device: str) -> torch.Tensor:
    if not array.flags.writeable:
        array = array.copy()  # read-only shared memory (Ray's object store): never hand it out as a tensor
    tensor = torch.from_numpy(array)
    if dtype == "bfloat16":
        tensor = tensor.view(torch.bfloat16)
    return tensor if device == "cpu" else tensor.to(device)


@dataclass
class RolloutBatch:
    """Named tensors ``[B, ...]``, per-sample arrays ``[B]`` and meta info; every operation returns a new batch."""

    batch: dict[str, torch.Tensor] = field(default_factory=dict)
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.non_tensor_batch = {k: _as_object_array(v, k) for k, v in self.non_tensor_batch.items()}
        self._check_consistent()

    @classmethod
    def from_dict(
        cls,
        tensors: Mapping[str, torch.Tensor] | None = None,
        non_tensors: Mapping[str, Any] | None = None,
        meta_info: Mapping[str, Any] | None = None,
    ) -> RolloutBatch:
        """Build from plain mappings (lists become object arrays)."""
        return cls(dict(tensors or {}), dict(non_tensors or {}), dict(meta_info or {}))

    def _check_consistent(self) -> None:
        sizes = {f"batch[{k!r}]": int(v.shape[0]) for k, v in self.batch.items() if v.dim() > 0}
        sizes.update({f"non_tensor_batch[{k!r}]": len(v) for k, v in self.non_tensor_batch.items()})
        if len(set(sizes.values())) > 1:
            listing = ", ".join(f"{k}={n}" for k, n in sizes.items())
            raise ValueError(f"all entries of a batch must share the batch dimension, got {listing}")
        for key, value in self.batch.items():
            if value.dim() == 0:
                raise ValueError(f"batch[{key!r}] is a scalar; put scalars in meta_info")

    def __getstate__(self) -> dict[str, Any]:
        """Pickle tensors as numpy arrays: under protocol 5 (Ray, multiprocessing) their bytes travel out of band
        without a copy, where pickling a torch tensor runs ``torch.save`` per tensor (~15x slower through Ray)."""
        tensors = {key: _tensor_to_wire(value) for key, value in self.batch.items()}
        return {"batch": tensors, "non_tensor_batch": self.non_tensor_batch, "meta_info": self.meta_info}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.batch = {key: _tensor_from_wire(*wire) for key, wire in state["batch"].items()}
        self.non_tensor_batch = state["non_tensor_batch"]
        self.meta_info = state["meta_info"]

    def __len__(self) -> int:
        for value in self.batch.values():
            return int(value.shape[0])
        for array in self.non_tensor_batch.values():
            return len(array)
        return 0

    def __getitem__(self, key: str) -> torch.Tensor | np.ndarray:
        if key in self.batch:
            return self.batch[key]
        if key in self.non_tensor_batch:
            return self.non_tensor_batch[key]
        known = sorted([*self.batch, *self.non_tensor_batch])
        raise KeyError(f"batch has no key {key!r}; keys: {known}")

    def __contains__(self, key: object) -> bool:
        return key in self.batch or key in self.non_tensor_batch

    def select(self, keys: Iterable[str] | None = None, non_tensor_keys: Iterable[str] | None = None) -> RolloutBatch:
        """A batch with only the named entries (None keeps all of that kind)."""
        tensors = self.batch if keys is None else {k: self._tensor(k) for k in keys}
        if non_tensor_keys is None:
            others = self.non_tensor_batch
        else:
            others = {k: self._non_tensor(k) for k in non_tensor_keys}
        return RolloutBatch(dict(tensors), dict(others), dict(self.meta_info))

    def _tensor(self, key: str) -> torch.Tensor:
        if key not in self.batch:
            raise KeyError(f"batch has no tensor {key!r}; tensors: {sorted(self.batch)}")
        return self.batch[key]

    def _non_tensor(self, key: str) -> np.ndarray:
        if key not in self.non_tensor_batch:
            raise KeyError(f"batch has no non-tensor {key!r}; non-tensors: {sorted(self.non_tensor_batch)}")
        return self.non_tensor_batch[key]

    def index(self, indices: slice | Sequence[int] | torch.Tensor | np.ndarray) -> RolloutBatch:
        """Samples picked by a slice, integer indices or a bool mask, in that order (also reorders)."""
        if isinstance(indices, slice):
            np_idx: slice | np.ndarray = indices
            torch_idx: slice | torch.Tensor = indices
        else:
            np_idx = indices.cpu().numpy() if isinstance(indices, torch.Tensor) else np.asarray(indices)
            if np_idx.dtype == bool:
                np_idx = np.nonzero(np_idx)[0]
            np_idx = np_idx.astype(np.int64)
            torch_idx = torch.from_numpy(np_idx)
        tensors = {
            k: v[torch_idx.to(v.device) if isinstance(torch_idx, torch.Tensor) else torch_idx]
            for k, v in self.batch.items()
        }
        others = {k: v[np_idx] for k, v in self.non_tensor_batch.items()}
        return RolloutBatch(tensors, others, dict(self.meta_info))

    def slice(self, start: int, end: int) -> RolloutBatch:
        """Samples ``start:end``."""
        return self.index(slice(start, end))

    def reorder(self, indices: Sequence[int] | torch.Tensor | np.ndarray) -> RolloutBatch:
        """Samples in the order of ``indices`` (a permutation of ``range(len(self))``)."""
        order = np.asarray(indices.cpu() if isinstance(indices, torch.Tensor) else indices)
        if sorted(order.tolist()) != list(range(len(self))):
            raise ValueError(f"reorder needs a permutation of range({len(self)}), got {len(order)} indices")
        return self.index(order)

    def chunk(self, chunks: int) -> list[RolloutBatch]:
        """Split into ``chunks`` equal parts (dispatch to data-parallel ranks).

        Raises :class:`BatchSizeError` when the batch is smaller than ``chunks`` or not divisible by it, with
        the fix (ROLL FAQ: "batch_size 32 < chunks 64").
        """
        size = len(self)
        if chunks <= 0:
            raise BatchSizeError(f"chunks must be positive, got {chunks}")
        if size < chunks:
            raise BatchSizeError(
                f"batch_size {size} < chunks {chunks}: the rollout batch is smaller than the data-parallel size "
                "it is dispatched to. Raise rollout_batch_size (samples = rollout_batch_size * "
                "num_return_sequences_in_group) or shrink the device_mapping of the role that receives it."
            )
        if size % chunks:
            raise BatchSizeError(
                f"batch_size {size} is not divisible by chunks {chunks}: make rollout_batch_size * "
                "num_return_sequences_in_group a multiple of the receiving role's data-parallel size."
            )
        step = size // chunks
        return [self.slice(i * step, (i + 1) * step) for i in range(chunks)]

    def split(self, size: int) -> list[RolloutBatch]:
        """Consecutive parts of ``size`` samples (the last may be shorter): micro-batches."""
        if size <= 0:
            raise BatchSizeError(f"split size must be positive, got {size}")
        return [self.slice(i, min(i + size, len(self))) for i in range(0, len(self), size)]

    def repeat(self, repeat_times: int, interleave: bool = True) -> RolloutBatch:
        """Each sample ``repeat_times`` times: ``aabb`` when ``interleave`` (one group per prompt), else ``abab``."""
        if repeat_times < 1:
            raise ValueError(f"repeat_times must be >= 1, got {repeat_times}")
        base = np.arange(len(self))
        order = np.repeat(base, repeat_times) if interleave else np.tile(base, repeat_times)
        return self.index(order)

    def to(self, device: torch.device | str) -> RolloutBatch:
        """Tensors moved to ``device``."""
        return RolloutBatch({k: v.to(device) for k, v in self.batch.items()}, dict(self.non_tensor_batch),
                            dict(self.meta_info))  # fmt: skip

    def union(self, other: RolloutBatch) -> RolloutBatch:
        """Entries of both batches (same samples); a key present in both must hold equal values."""
        if len(self) != len(other) and self.batch and other.batch:
            raise ValueError(f"union of batches of different sizes {len(self)} and {len(other)}")
        tensors = dict(self.batch)
        for key, value in other.batch.items():
            if key in tensors and not torch.equal(tensors[key], value):
                raise ValueError(f"union: tensor {key!r} differs between the two batches")
            tensors[key] = value
        others = {**self.non_tensor_batch, **other.non_tensor_batch}
        return RolloutBatch(tensors, others, {**self.meta_info, **other.meta_info})

    @staticmethod
    def concat(parts: Sequence[RolloutBatch]) -> RolloutBatch:
        """Samples of ``parts`` one after another (gather from ranks); meta info of the first part."""
        if not parts:
            raise ValueError("concat needs at least one batch")
        keys, others = set(parts[0].batch), set(parts[0].non_tensor_batch)
        for i, part in enumerate(parts[1:], start=1):
            if set(part.batch) != keys or set(part.non_tensor_batch) != others:
                raise ValueError(f"concat: part {i} has keys that differ from part 0")
        tensors = {k: torch.cat([p.batch[k] for p in parts]) for k in parts[0].batch}
        arrays = {k: np.concatenate([p.non_tensor_batch[k] for p in parts]) for k in parts[0].non_tensor_batch}
        return RolloutBatch(tensors, arrays, dict(parts[0].meta_info))


DataProto = RolloutBatch
"""Alias under the name ROLL and verl users know."""
