"""Step timings as a trace file that Perfetto (ui.perfetto.dev) and chrome://tracing open.

``with timer("train"):`` adds the block's seconds to ``timings["time/train"]`` (the step's metrics) and records a
complete event (Chrome trace format, ``ph: X``, microseconds) that ``write`` saves as ``timeline.json``. The loop
saves it with every checkpoint, and a resumed run continues that file (``resume``), so it reads as one run.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


class Timeline:
    """Collects phase events across steps."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.origin = time.perf_counter()

    def timer(self, timings: dict[str, float], step: int) -> PhaseTimer:
        """A context-manager factory for one step's phases."""
        return PhaseTimer(self, timings, step)

    def span(self, name: str, start: float, end: float, step: int, track: int = 0) -> None:
        """Record a phase timed elsewhere (``time.perf_counter()`` values) on ``track`` (a row of its own)."""
        self.events.append({
            "name": name, "cat": "step", "ph": "X", "pid": 0, "tid": track,
            "ts": (start - self.origin) * 1e6, "dur": (end - start) * 1e6, "args": {"step": step},
        })  # fmt: skip

    def write(self, path: Path) -> Path:
        """Save the trace (``{"traceEvents": [...]}``); atomically, so a killed run leaves the previous file."""
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps({"traceEvents": self.events, "displayTimeUnit": "ms"}))
        os.replace(partial, path)
        return path

    def resume(self, path: Path, first_step: int) -> None:
        """Continue the trace an earlier run saved at ``path``: keep its events of steps before ``first_step`` (a
        run killed after its last checkpoint may have saved later ones), and put this run's events after them."""
        try:
            saved = json.loads(path.read_text())["traceEvents"]
        except (FileNotFoundError, ValueError, KeyError, TypeError):  # none saved, or not a trace of ours
            return
        kept = [event for event in saved if event.get("args", {}).get("step", first_step) < first_step]
        end_us = max((event["ts"] + event.get("dur", 0.0) for event in kept), default=0.0)
        self.origin = time.perf_counter() - end_us / 1e6  # this run's first event starts where the kept ones end
        self.events = kept


class PhaseTimer:
    """``with timer("generate"): ...`` times one phase of a step."""

    def __init__(self, timeline: Timeline, timings: dict[str, float], step: int) -> None:
        self.timeline, self.timings, self.step = timeline, timings, step
        self._name = ""
        self._start = 0.0

    def __call__(self, name: str) -> PhaseTimer:
        self._name = name
        return self

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        end = time.perf_counter()
        key = f"time/{self._name}"
        self.timings[key] = self.timings.get(key, 0.0) + end - self._start
        self.timeline.events.append({
            "name": self._name, "cat": "step", "ph": "X", "pid": 0, "tid": 0,
            "ts": (self._start - self.timeline.origin) * 1e6, "dur": (end - self._start) * 1e6,
            "args": {"step": self.step},
        })  # fmt: skip
