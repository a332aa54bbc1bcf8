"""Deterministic execution settings of the ROLL guide, applied and recorded.

The guide's `system_envs` for numerically aligned dump / mock runs::

    NCCL_ALGO: Ring                        # Ring algorithm for NCCL collectives
    NVTE_ALLOW_NONDETERMINISTIC_ALGO: '0'  # no non-deterministic Transformer Engine kernels
    CUBLAS_WORKSPACE_CONFIG: ':4096:8'     # deterministic cuBLAS workspaces
    DETERMINISTIC_MODE: '1'                # PyTorch deterministic mode (below)

DETERMINISTIC_MODE=1 means: torch.backends.cudnn.deterministic = True, torch.backends.cudnn.benchmark =
False, torch.use_deterministic_algorithms(True). These must be identical in dump and mock mode.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from typing import Any

from rl_replay import torchcompat

DETERMINISTIC_ENV: dict[str, str] = {
    "NCCL_ALGO": "Ring",
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    "DETERMINISTIC_MODE": "1",
}
TORCH_FLAGS = (
    "torch.backends.cudnn.deterministic",
    "torch.backends.cudnn.benchmark",
    "torch.use_deterministic_algorithms",
)


def enable_deterministic(env: MutableMapping[str, str] | None = None) -> dict[str, Any]:
    """Apply the guide's deterministic settings; returns them as `deterministic_settings()` reports.

    Sets NCCL_ALGO=Ring, NVTE_ALLOW_NONDETERMINISTIC_ALGO=0, CUBLAS_WORKSPACE_CONFIG=:4096:8 and
    DETERMINISTIC_MODE=1 in `env` (default `os.environ`; call this before CUDA is initialised, since
    cuBLAS reads its variable at start-up), then applies DETERMINISTIC_MODE to torch if torch is installed.
    Environment variables reach worker processes only if they are started afterwards (or get them
    through `system_envs`).
    """
    target = os.environ if env is None else env
    target.update(DETERMINISTIC_ENV)
    apply_deterministic_mode(target)
    return deterministic_settings(target)


def apply_deterministic_mode(env: Mapping[str, str] | None = None) -> bool:
    """If DETERMINISTIC_MODE is '1', set torch's deterministic flags; True if torch was configured.

    Call it in each worker process after its environment is set. Without torch installed it does nothing.
    """
    source = os.environ if env is None else env
    if source.get("DETERMINISTIC_MODE") != "1":
        return False
    torch = torchcompat.import_torch()
    if torch is None:
        return False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True)
    return True


def deterministic_settings(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The four environment variables (None when unset) and, if torch is already imported, its flags."""
    source = os.environ if env is None else env
    settings: dict[str, Any] = {name: source.get(name) for name in DETERMINISTIC_ENV}
    torch = torchcompat.loaded_torch()
    if torch is not None:
        settings[TORCH_FLAGS[0]] = bool(torch.backends.cudnn.deterministic)
        settings[TORCH_FLAGS[1]] = bool(torch.backends.cudnn.benchmark)
        settings[TORCH_FLAGS[2]] = bool(torch.are_deterministic_algorithms_enabled())
    return settings


def settings_differences(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """`NAME: dump=X, now=Y` for every setting that differs (torch flags only when both sides have them)."""
    diffs = []
    for name in (*DETERMINISTIC_ENV, *TORCH_FLAGS):
        if name not in recorded or name not in current:
            continue
        if recorded[name] != current[name]:
            diffs.append(f"{name}: dump={recorded[name]!r}, now={current[name]!r}")
    return diffs
