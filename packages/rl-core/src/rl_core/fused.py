"""The fused fast path: a pure-tensor function compiled into one graph (``torch.compile``, ``fullgraph=True``).

Inductor fuses the graph's element-wise ops and reductions into a few loops: C++ / OpenMP on CPU, Triton kernels on
GPU. The same Python function runs eagerly otherwise, so both paths compute the same math (they differ only in
the order of floating-point sums, tested to 1e-6). Callers pick with ``fused``:

- ``None`` (auto): fused when the input holds at least :data:`FUSED_MIN_TOKENS` elements (below that a one-time
  compile of tens of seconds costs more than it saves) and ``torch.compile`` can run here; the environment variable
  ``RL_CORE_FUSED`` overrides it (``1`` always fused, ``0`` never).
- ``True`` / ``False``: fused / eager; ``True`` raises when the compile fails instead of falling back.

An automatic choice whose compile fails (no C++ compiler, an unsupported platform) logs one warning and runs eager
from then on. Shapes are compiled as dynamic: new batch or response lengths reuse the compiled graph; new option
values (a threshold, a loss mode) compile once more each.

On CPU, Inductor's loops handle bool tensors slowly: reading one or converting a float to one (``.bool()``) runs a
scalar loop per vector (measured at 128 x 4096, one thread: 1.2 ms per bool mask read against 0.1 ms to copy it
as float32; a masked row sum 1.7 ms with ``.bool()``, 0.08 ms with ``mask != 0``), and writing one 4.7 ms against
0.18 ms for float32. So the fused path hands the function its CPU bool tensors as float32 0 / 1, and the
function reads masks as comparisons (:func:`rl_core.masked.is_set`), which compile to vector instructions; it
computes the same either way. A graph with a backward keeps only its inputs for it, and the backward recomputes
what it needs from them (AOTAutograd's ``activation_memory_budget`` 0): the loss's forward would otherwise save
its dual-clip branch as a bool tensor. Measured on the vanilla loss at 128 x 4096, one thread: forward 13.6 ->
1.45 ms with it. Neither on GPU, where bool tensors cost no more than their bytes.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch

logger = logging.getLogger(__name__)

FUSED_MIN_TOKENS = 1 << 16
"""Auto mode fuses inputs with at least this many elements ([B, T] = 65536, e.g. 16 x 4096)."""
ENV_VAR = "RL_CORE_FUSED"

F = TypeVar("F", bound=Callable[..., Any])
_compiled: dict[Callable[..., Any], Callable[..., Any]] = {}
_broken: set[Callable[..., Any]] = set()


def _env_choice() -> bool | None:
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{ENV_VAR}={value!r}: use 1 (always fused), 0 (never) or leave it unset (auto).")


def wants_fused(fn: Callable[..., Any], numel: int, fused: bool | None) -> bool:
    """Whether a call of ``fn`` on ``numel`` elements takes the fused path (see the module docstring)."""
    if fused is None:
        fused = _env_choice()
    if fused is None:
        fused = numel >= FUSED_MIN_TOKENS and fn not in _broken
    return fused and not torch.compiler.is_compiling()  # inside a caller's compiled graph: inline, no nesting


def compiled(fn: F) -> F:
    """``fn`` compiled once per process as one graph with dynamic shapes."""
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, fullgraph=True)
    return _compiled[fn]  # type: ignore[return-value]


def _dynamic_shapes(args: tuple[Any, ...]) -> None:
    """Mark every dimension of the tensor arguments dynamic (one graph for every batch and response length).
    ``torch.compile(dynamic=True)`` would do that too, but it also turns the option values into symbols, and its
    CPU code then runs at half the speed measured with marked tensor dimensions."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            for dim in range(arg.dim()):
                torch._dynamo.maybe_mark_dynamic(arg, dim)


def _inputs_only_on_cpu(args: tuple[Any, ...]) -> contextlib.AbstractContextManager[Any]:
    """Where the tensors are on the CPU: compile with nothing but the inputs saved for the backward (see the module
    docstring)."""
    if any(isinstance(arg, torch.Tensor) and arg.device.type == "cpu" for arg in args):
        patch: contextlib.AbstractContextManager[Any] = torch._functorch.config.patch(activation_memory_budget=0.0)
        return patch
    return contextlib.nullcontext()


def _float_mask(arg: Any) -> Any:
    """A CPU bool tensor as float32 0 / 1 (read through a uint8 view: one fast eager pass, 0.04 ms at 128 x 4096)."""
    if isinstance(arg, torch.Tensor) and arg.dtype == torch.bool and arg.device.type == "cpu":
        return arg.view(torch.uint8).to(torch.float32)
    return arg


def call(fn: Callable[..., Any], numel: int, fused: bool | None, *args: Any) -> Any:
    """``fn(*args)``, fused or eager as :func:`wants_fused` decides for ``numel`` input elements. The fused path
    gets CPU bool tensors as float32 0 / 1 (see the module docstring): ``fn`` reads masks with
    :func:`rl_core.masked.is_set` and returns masks in the dtype of the ones it was given, which the caller casts
    back."""
    if not wants_fused(fn, numel, fused):
        return fn(*args)
    args = tuple(_float_mask(arg) for arg in args)
    _dynamic_shapes(args)
    try:
        with _inputs_only_on_cpu(args):
            return compiled(fn)(*args)
    except torch._dynamo.exc.BackendCompilerFailed as error:  # the compiler itself, not the math, failed
        if fused is True or _env_choice() is True:
            raise
        _broken.add(fn)
        logger.warning("rl_core fused path unavailable for %s (%s); running it eagerly.", fn.__qualname__, error)
        return fn(*args)
