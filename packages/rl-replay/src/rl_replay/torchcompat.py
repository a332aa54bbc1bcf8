"""Optional torch support. rl_replay never requires torch and never imports it just to look.

A batch can only hold torch tensors when torch is already imported, so dumping checks
`sys.modules`; loading a dump that holds torch tensors imports torch if it is installed.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType
from typing import Any

import numpy as np

from rl_replay.errors import UnsupportedValueError
from rl_replay.stfile import NUMPY_DTYPES, RawTensor, numpy_view

# torch dtype name -> safetensors code
TORCH_CODES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "int16": "I16",
    "uint16": "U16",
    "int32": "I32",
    "uint32": "U32",
    "int64": "I64",
    "uint64": "U64",
    "float16": "F16",
    "bfloat16": "BF16",
    "float32": "F32",
    "float64": "F64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}
_BITS_VIEW: dict[str, tuple[str, np.dtype]] = {
    "BF16": ("int16", np.dtype("<i2")),
    "F8_E4M3": ("uint8", np.dtype("u1")),
    "F8_E5M2": ("uint8", np.dtype("u1")),
}
_CODE_TO_NAME = {code: name for name, code in TORCH_CODES.items()}


def loaded_torch() -> ModuleType | None:
    """torch if this process has already imported it, else None (never imports)."""
    return sys.modules.get("torch")


def import_torch() -> ModuleType | None:
    """Import torch if it is installed, else None."""
    if "torch" in sys.modules:
        return sys.modules["torch"]
    if importlib.util.find_spec("torch") is None:
        return None
    return importlib.import_module("torch")


def is_tensor(value: object) -> bool:
    """True for a torch.Tensor (without importing torch)."""
    torch = loaded_torch()
    return torch is not None and isinstance(value, torch.Tensor)


def tensor_to_array(tensor: Any, path: str) -> tuple[str, np.ndarray, str]:
    """(safetensors code, C-contiguous numpy array of the same bytes, torch dtype name) of a tensor."""
    torch = loaded_torch()
    assert torch is not None
    name = str(tensor.dtype).removeprefix("torch.")
    code = TORCH_CODES.get(name)
    if code is None or tensor.layout != torch.strided:
        raise UnsupportedValueError(
            f"cannot store {path}: torch tensor with dtype {tensor.dtype} and layout {tensor.layout}; "
            f"supported are dense tensors of dtype {', '.join(sorted(TORCH_CODES))}"
        )
    t = tensor.detach().cpu().resolve_neg().contiguous()
    if code in _BITS_VIEW:
        t = t.view(getattr(torch, _BITS_VIEW[code][0]))
    return code, t.numpy(), name


def array_to_tensor(raw: RawTensor, torch: ModuleType) -> Any:
    """A torch tensor sharing the bytes of a parsed file tensor."""
    if raw.code in NUMPY_DTYPES:
        return torch.from_numpy(numpy_view(raw))
    bits = raw.raw.view(_BITS_VIEW[raw.code][1])
    return torch.from_numpy(bits).view(getattr(torch, _CODE_TO_NAME[raw.code])).reshape(raw.shape)


def array_without_torch(raw: RawTensor) -> np.ndarray:
    """A numpy stand-in for a torch tensor where torch is missing: bfloat16 widened to float32 (exact)."""
    if raw.code in NUMPY_DTYPES:
        return numpy_view(raw)
    if raw.code == "BF16":
        bits = raw.raw.view(np.dtype("<u2")).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(raw.shape)
    return raw.raw.reshape(raw.shape)  # float8: raw bits
