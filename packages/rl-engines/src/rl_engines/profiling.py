"""Per-call profiles of a role's work (ROLL's ``profiler_timeline`` / ``profiler_memory`` / ``profiler_output_dir``).

When a pipeline asks for them (through the workers' environment, :func:`profiler_env`), rank 0 of every role
profiles each call of ``generate``, ``compute_log_probs``, ``compute_values`` and ``train_step`` into
``<output_dir>/<role>/<method>/``:

- timeline: a ``torch.profiler`` trace per call (PyTorch's TensorBoard trace files, ``*.pt.trace.json``; CPU
  activity, and CUDA kernels on a GPU), with Python stacks, as ROLL's ``local_profiler``;
- memory: a CUDA allocator snapshot per call (``snapshot_<time>.pickle``, PyTorch's memory visualiser reads it). It
  records CUDA memory only: without a CUDA device a log line says so once and nothing is written.

Only one of the two at a time (ROLL's rule; the pipeline config refuses both).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import torch

TIMELINE, MEMORY, OUTPUT_DIR = "RL_PROFILER_TIMELINE", "RL_PROFILER_MEMORY", "RL_PROFILER_OUTPUT_DIR"
"""The workers' environment variables that switch profiling on and say where it goes."""
MAX_MEMORY_EVENTS = 100_000
"""Allocator events a memory snapshot keeps (ROLL's bound)."""
logger = logging.getLogger(__name__)
_warned: set[str] = set()
F = TypeVar("F", bound=Callable[..., Any])


def profiler_env(timeline: bool, memory: bool, output_dir: str) -> dict[str, str]:
    """The workers' environment for these settings (empty when both are off)."""
    if timeline and memory:
        raise ValueError("profiler_timeline and profiler_memory are both set; profile one at a time (as ROLL).")
    if not (timeline or memory):
        return {}
    return {TIMELINE if timeline else MEMORY: "1", OUTPUT_DIR: str(Path(output_dir).resolve())}


@contextlib.contextmanager
def profiled(role: str, rank: int, method: str) -> Iterator[None]:
    """Profile the enclosed call as the environment asks (rank 0 of a role only)."""
    timeline, memory = os.environ.get(TIMELINE) == "1", os.environ.get(MEMORY) == "1"
    if rank != 0 or not (timeline or memory):
        yield
        return
    folder = Path(os.environ.get(OUTPUT_DIR, "./output/profiler")) / role / method
    folder.mkdir(parents=True, exist_ok=True)
    if timeline:
        with _timeline(folder):
            yield
    elif torch.cuda.is_available():
        torch.cuda.memory._record_memory_history(max_entries=MAX_MEMORY_EVENTS, stacks="python")
        try:
            yield
        finally:
            stamp = datetime.now().strftime("%Y%m%d_%H%M%S_%f")
            torch.cuda.memory._dump_snapshot(str(folder / f"snapshot_{stamp}.pickle"))  # type: ignore[no-untyped-call]
            torch.cuda.memory._record_memory_history(enabled=None)
    else:
        if role not in _warned:
            _warned.add(role)
            logger.warning("%s: profiler_memory records CUDA allocator snapshots; there is no CUDA device here, so "
                           "nothing is recorded (profiler_timeline profiles CPU work).", role)  # fmt: skip
        yield


@contextlib.contextmanager
def _timeline(folder: Path) -> Iterator[None]:
    from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, on_trace_ready=tensorboard_trace_handler(str(folder)), with_stack=True):
        yield


def profile_call(method: F) -> F:
    """Decorate a role worker's method (``self.role``, ``self.rank``) with :func:`profiled`."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with profiled(self.role, self.rank, method.__name__):
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]
