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

The per-token ``exp`` of a log ratio goes through :func:`exp`: in a compiled CPU graph in float32 it is a
polynomial written as element-wise ops (:func:`_polynomial_exp`, within one ulp of the exact value), which
Inductor inlines into its loops. ``torch.exp`` compiles to a call to a vector exp routine inside the loop, and
every ymm register is caller-saved: the loop then spills each of its accumulators to the stack and back around
every call (the correction's main row loop holds 19). Measured on the rollout correction at 128 x 4096, one
thread, interleaved runs: 3.1-4.9 ms against 4.2-5.7 ms with ``torch.exp``. The correction now computes its
``exp`` once with ``torch.exp`` and returns it from its graph, which makes Inductor store it from an element-wise
loop of its own, where the call spills nothing (:func:`rl_core.rollout_corr.correction_stacked`; faster than the
polynomial there, whose ``2^n`` in the exponent bits is a scalar loop per vector). The policy loss's log ratio
is clamped to +-20 first, so it asks for ``exp(x, small=True)``: no range clamps or overflow selects, ``2^n``
from integer shifts (a bit cast has no vector form in Inductor's CPU code); with whole-batch sums taken as sums
of row sums (:func:`rl_core.losses.aggregation.total`), the loss's forward measured 2.7 -> 1.5 ms at 128 x 4096.
"""

from __future__ import annotations

import contextlib
import logging
import math
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


def _inputs_only_on_cpu(on_cpu: bool) -> contextlib.AbstractContextManager[Any]:
    """For CPU tensors: compile with nothing but the inputs saved for the backward (see the module docstring)."""
    if on_cpu:
        patch: contextlib.AbstractContextManager[Any] = torch._functorch.config.patch(activation_memory_budget=0.0)
        return patch
    return contextlib.nullcontext()


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


_LOG2E = 1.4426950408889634
_LN2_HI = 0.693359375  # ln 2 in 9 bits: n * _LN2_HI is exact in float32 for every |n| <= 128
_LN2_LO = -2.1219444005469058e-4  # ln 2 - _LN2_HI
_EXP_MAX = 88.72283935546875  # the smallest float32 whose exp overflows (ln(FLT_MAX) = 88.7228390...)
_EXP_MIN = -86.0  # below this (exp < 4.5e-38) the result is 0, where torch.exp gives tiny or subnormal values
_TAYLOR = (1 / 5040, 1 / 720, 1 / 120, 1 / 24, 1 / 6, 1 / 2, 1.0, 1.0)  # 1/7! .. 1/0!


_SMALL = 21.0
"""``exp(x, small=True)`` is for ``|x| <= _SMALL`` (a log ratio clamped to +-20) or NaN: ``n`` stays in [-30, 30]."""


def _polynomial_exp(x: torch.Tensor, small: bool = False) -> torch.Tensor:
    """float32 ``exp`` from element-wise arithmetic: ``x = n ln 2 + r`` with ``|r| <= ln 2 / 2`` (Cody-Waite, ln 2
    in two parts), ``exp(r)`` by its Taylor polynomial of degree 7 (truncation below 6e-9 relative), times ``2^n``
    built in the exponent bits. Within one float32 ulp of the exact value on [-86, 88.7] (0.85 ulp at most over
    2 * 10^6 points, where ``torch.exp`` is within 1.3); +inf and NaN as ``torch.exp``; 0 below -86. With ``small``
    (``|x| <= _SMALL`` or NaN, which the caller guarantees) the range clamps and the overflow / underflow selects are
    left out and ``2^n`` comes from integer shifts (:func:`_small_power_of_two`)."""
    clamped = x if small else x.clamp(_EXP_MIN, _EXP_MAX)
    n = torch.floor(clamped * _LOG2E + 0.5)
    r = clamped - n * _LN2_HI - n * _LN2_LO
    poly = r * _TAYLOR[0] + _TAYLOR[1]
    for coefficient in _TAYLOR[2:]:
        poly = poly * r + coefficient
    if small:
        return poly * _small_power_of_two(n)
    half_scale = ((n.to(torch.int32) + 126) * (1 << 23)).view(torch.float32)  # 2^(n-1): n = 128 stays finite
    y = poly * half_scale * 2.0
    y = torch.where(x > _EXP_MAX, math.inf, y)
    return torch.where(x < _EXP_MIN, 0.0, y)


def _small_power_of_two(n: torch.Tensor) -> torch.Tensor:
    """``2^n`` for integer-valued float32 ``n`` in [-30, 30]: ``2^a * 2^b * 2^-30`` with ``a + b = n + 30`` and both in
    [0, 30], each ``1 << k`` in int32 converted to float (exact). The exponent-bits form (``.view(torch.float32)``)
    compiles to a scalar loop per vector in Inductor's CPU code (it has no vector bit cast); shifts and int -> float
    conversions compile to vector instructions. (A full-range version of this, 2^r * (2^q)^16, measured no faster in
    the correction's graph, where Inductor then stored an earlier intermediate for its row loops.) A NaN ``n`` gives
    some finite scale, and the NaN polynomial it multiplies stays NaN."""
    total = n.to(torch.int32) + 30
    a = torch.bitwise_right_shift(total, 1)
    one = torch.ones_like(total)
    high = torch.bitwise_left_shift(one, a).to(torch.float32)
    low = torch.bitwise_left_shift(one, total - a).to(torch.float32)
    return high * (low * 2.0**-30)


class _PolynomialExp(torch.autograd.Function):
    """:func:`_polynomial_exp` whose gradient is its value, as ``exp``'s (the polynomial's own derivative is the
    Taylor series one degree shorter)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, small: bool) -> torch.Tensor:
        y = _polynomial_exp(x, small)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        y: torch.Tensor = ctx.saved_tensors[0]
        return grad * y, None


def exp(x: torch.Tensor, small: bool = False) -> torch.Tensor:
    """``torch.exp`` of a per-token tensor; inside a compiled graph on CPU in float32, :func:`_polynomial_exp`
    (see the module docstring). ``small``: the caller guarantees ``|x| <= 21`` or NaN (a log ratio clamped to
    +-20), which needs fewer instructions per token; outside that range the result is wrong."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or not torch.compiler.is_compiling():
        return torch.exp(x)
    if torch.is_grad_enabled() and x.requires_grad:
        return _PolynomialExp.apply(x, small)  # type: ignore[no-untyped-call, no-any-return]
    return _polynomial_exp(x, small)
