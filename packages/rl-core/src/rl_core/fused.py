"""The fused fast path: a pure-tensor function compiled into one graph (``torch.compile``, ``fullgraph=True``).

Inductor fuses the graph's element-wise ops and reductions into a few loops: C++ / OpenMP on CPU, Triton kernels on
GPU. The same Python function runs eagerly otherwise, so both paths compute the same math (they differ in the
order of floating-point sums and, on CPU, in the last bit of ``exp``; tested to 1e-6). Callers pick with ``fused``:

- ``None`` (auto): fused when the input holds at least :data:`FUSED_MIN_TOKENS` elements (below that a one-time
  compile of tens of seconds costs more than it saves) and ``torch.compile`` can run here; the environment variable
  ``RL_CORE_FUSED`` overrides it (``1`` always fused, ``0`` never).
- ``True`` / ``False``: fused / eager; ``True`` raises when the compile fails instead of falling back.

An automatic choice whose compile fails (no C++ compiler, an unsupported platform, more than
:data:`RECOMPILE_LIMIT` graphs for one function) logs one warning and runs that function eagerly from then on.
Shapes are compiled as dynamic: new batch or response lengths reuse the compiled graph; new option values (a
threshold, a loss mode) compile once more each.

On CPU, Inductor's loops handle bool and byte tensors slowly: reading one, comparing one or converting a float to
one (``.bool()``) runs a scalar loop per vector (measured at 128 x 4096, one thread: a masked row sum 1.2 ms
reading a bool mask, 1.6 ms comparing a byte mask, 0.06 ms with a float32 one; writing a bool mask 4.7 ms against
0.18 ms for float32), but a conversion between bytes and float32 is vector code both ways. So the fused path hands
the function its CPU bool tensors as bytes (a ``uint8`` view: no copy), the function reads masks with
:func:`rl_core.masked.is_set` (bytes -> float32 -> comparison) and writes the masks it returns with
:func:`rl_core.masked.mask_as` (float32 0 / 1 -> bytes), and :func:`restore_mask` gives the caller its bool dtype
back as a view. A graph with a backward keeps only its inputs for it, and the backward recomputes what it needs
from them (AOTAutograd's ``activation_memory_budget`` 0): the loss's forward would otherwise save its dual-clip
branch as a bool tensor. Measured on the vanilla loss at 128 x 4096, one thread: forward 13.6 -> 1.45 ms with it.
Neither on GPU, where bool tensors cost no more than their bytes.

Every ``exp`` in these graphs is ``torch.exp``, which Inductor's CPU code calls as a vector routine (Sleef's). A
call inside a loop with accumulators would spill them (every vector register is caller-saved), so each graph keeps
its ``exp`` in an element-wise loop of its own: the correction returns its ``exp(old - rollout)``
(:func:`rl_core.rollout_corr.correction_stacked`), which makes Inductor store it from such a loop, the loss's
forward stores its ratio from one as well, and its backward is a single element-wise loop. Until 2026-12-07 the
loss used a polynomial ``exp`` of element-wise ops (written for graphs whose ``exp`` sat inside a row loop), which
takes more instructions than the vector routine in a loop of its own; measured against it at 128 x 4096, one
thread, in one process, in turn, two runs: the loss's backward 1.06 -> 0.96 ms and 1.27 -> 1.14 ms, its forward
unchanged (1.34 / 1.35 ms, 1.62 / 1.66 ms).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

logger = logging.getLogger(__name__)

FUSED_MIN_TOKENS = 1 << 16
"""Auto mode fuses inputs with at least this many elements ([B, T] = 65536, e.g. 16 x 4096)."""
ENV_VAR = "RL_CORE_FUSED"

RECOMPILE_LIMIT = 32
"""Graphs one function may compile per process: one per combination of option values and input dtypes (Dynamo's
default limit, 8, is per code object, and a fused caller past it would fail: ``fullgraph=True``)."""
_COMPILE_FAILURES = (torch._dynamo.exc.BackendCompilerFailed, torch._dynamo.exc.FailOnRecompileLimitHit)

F = TypeVar("F", bound=Callable[..., Any])
_compiled: dict[tuple[Callable[..., Any], bool], Callable[..., Any]] = {}

CPU_INDUCTOR_OPTIONS = {"reorder_for_locality": False}
"""Inductor's options for a graph of CPU tensors. Its locality pass moves each op next to its first user, and its
scheduler fuses no two loops whose ops lie more than 64 apart: the correction's off-policy row sums, whose users
are the graph's last ops, were moved away from the row loop that reads the same tensors and took passes over the
batch of their own (two more loops over the tokens). Without the pass they share that loop (measured at 128 x
4096, one thread, in one process, in turn: correction 1.21 -> 1.12 ms, the loss unchanged)."""
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


def compiled(fn: F, on_cpu: bool = False) -> F:
    """``fn`` compiled once per process as one graph with dynamic shapes (for CPU tensors with
    :data:`CPU_INDUCTOR_OPTIONS`)."""
    key = (fn, on_cpu)
    if key not in _compiled:
        _compiled[key] = torch.compile(fn, fullgraph=True, options=dict(CPU_INDUCTOR_OPTIONS) if on_cpu else None)
    return _compiled[key]  # type: ignore[return-value]


def _dynamic_shapes(args: tuple[Any, ...]) -> None:
    """Mark every dimension of the tensor arguments dynamic (one graph for every batch and response length).
    ``torch.compile(dynamic=True)`` would do that too, but it also turns the option values into symbols, and its
    CPU code then runs at half the speed measured with marked tensor dimensions."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            for dim in range(arg.dim()):
                torch._dynamo.maybe_mark_dynamic(arg, dim)


def _on_cpu(args: tuple[Any, ...]) -> bool:
    return any(isinstance(arg, torch.Tensor) and arg.device.type == "cpu" for arg in args)


@contextlib.contextmanager
def _inputs_only_on_cpu(on_cpu: bool) -> Iterator[None]:
    """For CPU tensors: compile with nothing but the inputs saved for the backward (see the module docstring). Set
    and restored directly, as :func:`_recompile_limit` does: 3.5 us a call, where ``config.patch`` measured 13."""
    if not on_cpu:
        yield
        return
    config = torch._functorch.config
    previous = config.activation_memory_budget
    config.activation_memory_budget = 0.0
    try:
        yield
    finally:
        config.activation_memory_budget = previous


def _byte_mask(arg: Any) -> Any:
    """A CPU bool tensor as its bytes (a view, see the module docstring); anything else as it is."""
    if isinstance(arg, torch.Tensor) and arg.dtype == torch.bool and arg.device.type == "cpu":
        return arg.view(torch.uint8)
    return arg


def restore_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A mask a fused function returned (bytes for a bool mask it was given) in the caller's ``dtype``: a bool view
    of 0 / 1 bytes (no copy), otherwise a conversion."""
    if mask.dtype == torch.uint8 and dtype == torch.bool:
        return mask.view(torch.bool)
    return mask.to(dtype)


@contextlib.contextmanager
def _recompile_limit() -> Iterator[None]:
    """Dynamo's recompile limit at least :data:`RECOMPILE_LIMIT` around a compiled call (set and restored directly:
    4.5 us a call, where ``torch._dynamo.config.patch`` measured 15 us)."""
    config = torch._dynamo.config
    previous = config.recompile_limit
    config.recompile_limit = max(previous, RECOMPILE_LIMIT)
    try:
        yield
    finally:
        config.recompile_limit = previous


def call(fn: Callable[..., Any], numel: int, fused: bool | None, *args: Any) -> Any:
    """``fn(*args)``, fused or eager as :func:`wants_fused` decides for ``numel`` input elements. The fused path
    gets CPU bool tensors as bytes (see the module docstring): ``fn`` reads masks with :func:`rl_core.masked.is_set`
    and returns masks in the dtype of the ones it was given, written with :func:`rl_core.masked.mask_as`, which the
    caller turns back with :func:`restore_mask`."""
    if not wants_fused(fn, numel, fused):
        return fn(*args)
    args = tuple(_byte_mask(arg) for arg in args)
    _dynamic_shapes(args)
    on_cpu = _on_cpu(args)
    try:
        with _inputs_only_on_cpu(on_cpu), _recompile_limit():
            return compiled(fn, on_cpu)(*args)
    except _COMPILE_FAILURES as error:  # the compiler, not the math, failed
        if fused is True or _env_choice() is True:
            raise
        _broken.add(fn)
        logger.warning("rl_core fused path unavailable for %s (%s); running it eagerly.", fn.__qualname__, error)
        return fn(*args)
