"""Batch <-> (safetensors tensors, JSON tree): exact round trip without pickle.

Numeric arrays and tensors go to safetensors; everything else becomes a JSON tree whose tagged nodes
(`{"__t": ...}`) say how to rebuild each value: tuples, bytes, non-finite floats, numpy scalars,
numpy string / object arrays, and batch containers found by duck typing (verl / ROLL DataProto:
`batch`, `non_tensor_batch`, `meta_info`; tensordict's TensorDict: `batch_size`, `keys`, `__getitem__`).
Containers come back as the same class when that class is already imported; rl_replay never imports
a module named in a file, so loading runs no code chosen by the file.
"""

from __future__ import annotations

import base64
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rl_replay import torchcompat
from rl_replay.errors import DumpFormatError, UnsupportedValueError
from rl_replay.stfile import NUMPY_DTYPES, RawTensor, TensorEntry, numpy_view

TAG = "__t"
_NUMPY_CODES = {dtype: code for code, dtype in NUMPY_DTYPES.items()}


@dataclass
class GenericBatch:
    """Stand-in for a DataProto-like class that is not imported (e.g. in the CLI)."""

    batch: Any = None
    non_tensor_batch: dict[str, Any] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)
    class_name: str = ""


class GenericTensorDict(dict):  # type: ignore[type-arg]
    """Stand-in for a TensorDict-like class that is not imported: a dict plus `batch_size`."""

    def __init__(self, items: dict[str, Any], batch_size: list[int], class_name: str) -> None:
        super().__init__(items)
        self.batch_size = batch_size
        self.class_name = class_name


def is_dataproto_like(value: object) -> bool:
    """verl / ROLL DataProto or any object with `batch`, `non_tensor_batch` and `meta_info`."""
    return all(hasattr(value, a) for a in ("batch", "non_tensor_batch", "meta_info"))


def is_tensordict_like(value: object) -> bool:
    """tensordict's TensorDict (a MutableMapping) or alike: `batch_size`, `keys()` and item access."""
    return hasattr(value, "batch_size") and callable(getattr(value, "keys", None)) and hasattr(value, "__getitem__")


def class_path(cls: type) -> str:
    """`module:qualname` of a class."""
    return f"{cls.__module__}:{cls.__qualname__}"


def batch_size_of(batch: Any) -> int:
    """The batch dimension: what the `samples=` of the log lines reports."""
    if is_tensordict_like(batch):
        dims = list(batch.batch_size)
        return int(dims[0]) if dims else 1
    if is_dataproto_like(batch):
        if batch.batch is not None and batch_size_of(batch.batch):
            return batch_size_of(batch.batch)
        return batch_size_of(dict(batch.non_tensor_batch or {}))
    if isinstance(batch, Mapping):
        for value in batch.values():
            size = batch_size_of(value)
            if size:
                return size
        return 0
    shape = getattr(batch, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) else 1
    return len(batch) if isinstance(batch, (list, tuple)) else 0


class Encoder:
    """Walks a batch; collects tensors as safetensors entries and returns the JSON tree."""

    def __init__(self) -> None:
        self.entries: list[TensorEntry] = []
        self._names: set[str] = set()

    def _add(self, path: str, code: str, shape: tuple[int, ...], data: np.ndarray) -> str:
        name = path or "value"
        if name in self._names or name == "__metadata__":
            name = f"{name}#{len(self.entries)}"
        self._names.add(name)
        self.entries.append(TensorEntry(name=name, code=code, shape=shape, data=data))
        return name

    def encode(self, value: Any, path: str) -> Any:
        """JSON tree node of `value`, found at `path` (used in tensor names and errors)."""
        kind = type(value)
        if value is None or kind in (bool, str, int):
            return value
        if kind is float:
            return value if math.isfinite(value) else {TAG: "float", "v": repr(value)}
        if isinstance(value, np.ndarray):
            return self._ndarray(value, path)
        if isinstance(value, np.generic):
            return {TAG: "npscalar", "v": self._ndarray(np.asarray(value), path)}
        if torchcompat.is_tensor(value):
            code, data, name = torchcompat.tensor_to_array(value, path)
            return {TAG: "pt", "name": self._add(path, code, tuple(value.shape), data), "dtype": name}
        if kind is list:
            return [self.encode(v, _join(path, i)) for i, v in enumerate(value)]
        if kind is tuple:
            return {TAG: "tuple", "v": [self.encode(v, _join(path, i)) for i, v in enumerate(value)]}
        if kind is bytes:
            return {TAG: "bytes", "b64": base64.b64encode(value).decode("ascii")}
        if is_tensordict_like(value):  # before Mapping: a TensorDict is a MutableMapping
            return self._tensordict(value, path)
        if isinstance(value, Mapping):
            return self._mapping(value, path)
        if is_dataproto_like(value):
            return self._dataproto(value, path)
        raise UnsupportedValueError(
            f"cannot store {path or 'the batch'} of type {kind.__module__}.{kind.__qualname__} without pickle: "
            "rl_replay stores torch tensors, numpy arrays, str / int / float / bool / None, bytes, lists, "
            "tuples, dicts, DataProto-like and TensorDict-like objects. Convert the value before dumping."
        )

    def _mapping(self, value: Mapping[Any, Any], path: str) -> Any:
        if all(type(k) is str for k in value) and TAG not in value:
            return {k: self.encode(v, _join(path, k)) for k, v in value.items()}
        items = [[self.encode(k, _join(path, "<key>")), self.encode(v, _join(path, k))] for k, v in value.items()]
        return {TAG: "dict", "items": items}

    def _tensordict(self, value: Any, path: str) -> Any:
        items = [[k, self.encode(value[k], _join(path, k))] for k in value.keys()]  # noqa: SIM118
        batch_size = [int(d) for d in value.batch_size]
        cls = value.class_name if isinstance(value, GenericTensorDict) else class_path(type(value))
        return {TAG: "tensordict", "cls": cls, "batch_size": batch_size, "items": items}

    def _dataproto(self, value: Any, path: str) -> Any:
        parts = {a: self.encode(getattr(value, a), _join(path, a)) for a in _DP_ATTRS}
        cls = value.class_name if isinstance(value, GenericBatch) else class_path(type(value))
        return {TAG: "dataproto", "cls": cls, **parts}

    def _ndarray(self, arr: np.ndarray, path: str) -> Any:
        shape = [int(d) for d in arr.shape]
        if arr.dtype.kind in "biuf":
            code = _NUMPY_CODES.get(arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype)
            if code is not None:
                data = np.ascontiguousarray(arr, dtype=NUMPY_DTYPES[code])
                return {TAG: "nd", "name": self._add(path, code, tuple(shape), data), "dtype": arr.dtype.str}
        if arr.dtype.kind in "US" and arr.dtype.itemsize:
            data = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
            name = self._add(path, "U8", (data.size,), data)
            return {TAG: "ndfixed", "name": name, "dtype": arr.dtype.str, "shape": shape}
        if arr.dtype.kind == "O":
            return self._object_array(arr, path, shape)
        raise UnsupportedValueError(
            f"cannot store {path or 'the batch'}: numpy dtype {arr.dtype} is not supported "
            "(bool, integer, float, fixed-width str / bytes and object arrays are)"
        )

    def _object_array(self, arr: np.ndarray, path: str, shape: list[int]) -> Any:
        flat = arr.reshape(-1)
        if flat.size and all(type(x) is str for x in flat):
            encoded = [x.encode("utf-8", "surrogatepass") for x in flat]
            offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
            np.cumsum([len(b) for b in encoded], out=offsets[1:])
            blob = np.frombuffer(b"".join(encoded), dtype=np.uint8)
            data_name = self._add(f"{path}#utf8", "U8", (blob.size,), blob)
            offsets_name = self._add(f"{path}#offsets", "I64", (offsets.size,), offsets)
            return {TAG: "ndstr", "data": data_name, "offsets": offsets_name, "shape": shape}
        return {TAG: "ndobj", "shape": shape, "v": [self.encode(x, _join(path, i)) for i, x in enumerate(flat)]}


_DP_ATTRS = ("batch", "non_tensor_batch", "meta_info")


def _join(path: str, key: object) -> str:
    return f"{path}/{key}" if path else str(key)


class Decoder:
    """Rebuilds a batch from parsed tensors and the JSON tree.

    `generic=True` never imports anything and never needs a class: DataProto-like objects become
    `GenericBatch`, TensorDict-like ones `GenericTensorDict`, torch tensors numpy arrays (bfloat16
    widened to float32, which is exact). The CLI loads this way.
    """

    def __init__(self, tensors: dict[str, RawTensor], path: str, generic: bool = False) -> None:
        self.tensors = tensors
        self.path = path
        self.generic = generic
        self._torch = torchcompat.loaded_torch()

    def _fail(self, what: str) -> DumpFormatError:
        return DumpFormatError(f"{self.path}: {what}")

    def _tensor(self, name: object) -> RawTensor:
        if not isinstance(name, str) or name not in self.tensors:
            raise self._fail(f"the tree names a tensor {name!r} that the file does not hold")
        return self.tensors[name]

    def decode(self, node: Any) -> Any:
        """The value that `Encoder.encode` turned into `node`."""
        if node is None or type(node) in (bool, str, int, float):
            return node
        if type(node) is list:
            return [self.decode(v) for v in node]
        if type(node) is not dict:
            raise self._fail(f"unexpected JSON node {node!r}")
        tag = node.get(TAG)
        if tag is None:
            return {k: self.decode(v) for k, v in node.items()}
        handler = _HANDLERS.get(tag) if isinstance(tag, str) else None
        if handler is None:
            raise self._fail(f"unknown node type {tag!r} (written by a newer rl_replay?)")
        try:
            return handler(self, node)
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, DumpFormatError):
                raise
            raise self._fail(f"malformed {tag!r} node: {exc!r}") from None

    def _nd(self, node: dict[str, Any]) -> np.ndarray:
        arr = numpy_view(self._tensor(node["name"]))
        dtype = _safe_dtype(node["dtype"], "biuf")
        return arr if dtype == arr.dtype else arr.astype(dtype)

    def _pt(self, node: dict[str, Any]) -> Any:
        raw = self._tensor(node["name"])
        if self.generic:
            return torchcompat.array_without_torch(raw)
        if self._torch is None:
            self._torch = torchcompat.import_torch()
        if self._torch is None:
            raise self._fail(f"holds torch tensors ({node['dtype']}); install torch to load it")
        return torchcompat.array_to_tensor(raw, self._torch)

    def _ndfixed(self, node: dict[str, Any]) -> np.ndarray:
        dtype = _safe_dtype(node["dtype"], "US")
        return self._tensor(node["name"]).raw.view(dtype).reshape(node["shape"])

    def _ndstr(self, node: dict[str, Any]) -> np.ndarray:
        blob = self._tensor(node["data"]).raw.tobytes()
        offsets = numpy_view(self._tensor(node["offsets"])).tolist()
        out = np.empty(len(offsets) - 1, dtype=object)
        for i in range(len(out)):
            out[i] = blob[offsets[i] : offsets[i + 1]].decode("utf-8", "surrogatepass")
        return out.reshape(node["shape"])

    def _ndobj(self, node: dict[str, Any]) -> np.ndarray:
        items = node["v"]
        out = np.empty(len(items), dtype=object)
        for i, item in enumerate(items):
            out[i] = self.decode(item)
        return out.reshape(node["shape"])

    def _dict(self, node: dict[str, Any]) -> dict[Any, Any]:
        return {self.decode(k): self.decode(v) for k, v in node["items"]}

    def _tensordict(self, node: dict[str, Any]) -> Any:
        items = {str(k): self.decode(v) for k, v in node["items"]}
        batch_size = [int(d) for d in node["batch_size"]]
        cls = None if self.generic else self._resolve(node["cls"])
        if cls is None:
            return GenericTensorDict(items, batch_size, node["cls"])
        return cls(items, batch_size=batch_size)

    def _dataproto(self, node: dict[str, Any]) -> Any:
        parts = {a: self.decode(node[a]) for a in _DP_ATTRS}
        cls = None if self.generic else self._resolve(node["cls"])
        if cls is None:
            return GenericBatch(**parts, class_name=node["cls"])
        try:
            return cls(**parts)
        except TypeError:  # a class whose __init__ takes other arguments: set the attributes directly
            obj: Any = object.__new__(cls)
            for name, value in parts.items():
                setattr(obj, name, value)
            return obj

    def _resolve(self, path: str) -> type:
        module_name, _, qualname = path.partition(":")
        obj: Any = sys.modules.get(module_name)
        for part in qualname.split(".") if obj is not None else []:
            obj = getattr(obj, part, None)
        if not isinstance(obj, type):
            raise DumpFormatError(
                f"{self.path}: the batch was dumped as {path}, which is not imported in this process. "
                f"Import {module_name} before loading (rl_replay never imports modules named in a file), "
                "or load with generic=True."
            )
        return obj


def _safe_dtype(text: object, kinds: str) -> np.dtype:
    dtype = np.dtype(str(text))
    if dtype.kind not in kinds:
        raise ValueError(f"dtype {text!r} is not allowed here")
    return dtype


_HANDLERS: dict[str, Any] = {
    "nd": Decoder._nd,
    "pt": Decoder._pt,
    "ndfixed": Decoder._ndfixed,
    "ndstr": Decoder._ndstr,
    "ndobj": Decoder._ndobj,
    "dict": Decoder._dict,
    "tensordict": Decoder._tensordict,
    "dataproto": Decoder._dataproto,
    "tuple": lambda self, node: tuple(self.decode(v) for v in node["v"]),
    "bytes": lambda self, node: base64.b64decode(node["b64"], validate=True),
    "float": lambda self, node: float(node["v"]),
    "npscalar": lambda self, node: self.decode(node["v"])[()],
}
