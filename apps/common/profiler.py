"""ROLL's profiler keys (``profiler_timeline``, ``profiler_memory``, ``profiler_output_dir``) as the workers'
environment: rank 0 of every role then profiles each call (rl_engines.profiling)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from rl_engines.profiling import profiler_env


def worker_envs(config: Any, log: Callable[[str], None] = print) -> dict[str, str]:
    """``config.system_envs`` plus the profiler's switches; the profiles go to ``profiler_output_dir/<exp_name>/<start
    time>`` (ROLL's layout), named in a log line."""
    if not (config.profiler_timeline or config.profiler_memory):
        return dict(config.system_envs)
    folder = Path(config.profiler_output_dir) / config.exp_name / datetime.now().strftime("%Y%m%d-%H%M%S")
    kind = "torch.profiler traces" if config.profiler_timeline else "CUDA memory snapshots"
    log(f"[profiler] {kind} of every generate / log-prob / value / train call on rank 0 of each role: "
        f"{folder}/<role>/<method>/")  # fmt: skip
    return {**config.system_envs, **profiler_env(config.profiler_timeline, config.profiler_memory, str(folder))}
