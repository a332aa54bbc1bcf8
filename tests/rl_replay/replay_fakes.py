"""Stand-ins shaped like verl's DataProto, tensordict's TensorDict and our rl_core batch container.

They live in an importable module (not inside a test) because rl_replay rebuilds a batch with its
original class only when that class is already imported, as it is in a real pipeline.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any


class FakeTensorDict(MutableMapping):  # type: ignore[type-arg]
    """Like tensordict.TensorDict, a MutableMapping: TensorDict(source, batch_size=...), td[key], batch_size."""

    def __init__(self, source: dict[str, Any], batch_size: Any, device: Any = None) -> None:
        self._data = dict(source)
        self.batch_size = list(batch_size)
        self.device = device

    def keys(self) -> Any:
        return self._data.keys()

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._data[key] = value

    def __delitem__(self, key: str) -> None:
        del self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)  # as TensorDict: the number of keys


@dataclass
class FakeDataProto:
    """Like verl.protocol.DataProto: a dataclass with batch (TensorDict), non_tensor_batch, meta_info."""

    batch: Any = None
    non_tensor_batch: dict[str, Any] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)


class PositionalOnlyBatch:
    """A container whose __init__ does not take batch / non_tensor_batch / meta_info keywords."""

    def __init__(self, tensors: dict[str, Any]) -> None:
        self.batch = tensors
        self.non_tensor_batch: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}


def numpy_batch(samples: int = 4, seq: int = 6, seed: int = 0) -> dict[str, Any]:
    """A small rollout batch of numpy arrays and per-sample strings."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return {
        "input_ids": rng.integers(0, 1000, (samples, seq), dtype=np.int64),
        "old_log_probs": rng.standard_normal((samples, seq), dtype=np.float32),
        "response_mask": rng.random((samples, seq)) > 0.3,
        "prompt": np.array([f"prompt {i} 问题" for i in range(samples)], dtype=object),
    }
