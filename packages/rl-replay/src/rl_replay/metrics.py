"""Metric logs of two runs, read and compared: the guide's "step 4" (numerical alignment) made automatic.

JSONL format (what the apps write, one JSON object per line)::

    {"step": 0, "actor/pg_loss": 0.1234, "actor/grad_norm": 1.5, "critic/value_loss": 0.02}

`step` is an int; every other key with a number value is a metric (other values are ignored). Several
lines may share a step; later values win. A requested metric matches a logged name exactly or by its
last `/`-separated component (`pg_loss` matches `actor/pg_loss`). A run is a JSONL file, a directory with
`metrics.jsonl`, or a directory of TensorBoard event files (read when the `tensorboard` package is
installed: `pip install rl-replay[tensorboard]`).
"""

from __future__ import annotations

import glob
import importlib.util
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from rl_replay.errors import MetricsError

DEFAULT_METRICS = ("pg_loss", "total_loss", "value_loss", "approx_kl", "grad_norm")
METRICS_FILENAME = "metrics.jsonl"
Metrics = dict[int, dict[str, float]]  # step -> metric name -> value


def append_metrics(path: str | os.PathLike[str], step: int, metrics: Mapping[str, float]) -> None:
    """Append one `{"step": step, **metrics}` line to a JSONL metrics log (creating it)."""
    values = {name: float(value) for name, value in metrics.items()}
    line = json.dumps({"step": int(step), **values})
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")


def read_metrics(run: str | os.PathLike[str]) -> Metrics:
    """Metrics of a run: a JSONL file, a directory holding `metrics.jsonl`, or TensorBoard event files."""
    path = os.fspath(run)
    if os.path.isdir(path):
        jsonl = os.path.join(path, METRICS_FILENAME)
        if os.path.isfile(jsonl):
            return read_jsonl(jsonl)
        if glob.glob(os.path.join(glob.escape(path), "**", "events.out.tfevents.*"), recursive=True):
            return read_tensorboard(path)
        raise MetricsError(f"{path} holds neither {METRICS_FILENAME} nor TensorBoard event files")
    if not os.path.isfile(path):
        raise MetricsError(f"metrics log {path} does not exist")
    return read_jsonl(path)


def read_jsonl(path: str) -> Metrics:
    """Read a JSONL metrics log; errors name the file and line."""
    out: Metrics = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise MetricsError(f"{path}:{lineno}: not JSON ({exc})") from None
            step = record.get("step") if isinstance(record, dict) else None
            if type(step) is not int:
                raise MetricsError(f'{path}:{lineno}: each line must be an object with an int "step"')
            values = out.setdefault(step, {})
            for name, value in record.items():
                if name != "step" and type(value) in (int, float):
                    values[name] = float(value)
    return out


def tensorboard_available() -> bool:
    """True when the `tensorboard` package is installed."""
    return importlib.util.find_spec("tensorboard") is not None


def read_tensorboard(logdir: str) -> Metrics:
    """Scalars of every TensorBoard event file under `logdir` (needs the `tensorboard` package)."""
    if not tensorboard_available():
        raise MetricsError(
            f"{logdir} holds TensorBoard event files; install the tensorboard package to read them "
            "(pip install 'rl-replay[tensorboard]') or log metrics as JSONL"
        )
    from tensorboard.backend.event_processing import (  # type: ignore[import-not-found,import-untyped,unused-ignore]
        event_accumulator,
    )

    out: Metrics = {}
    run_dirs = sorted(
        {
            os.path.dirname(p)
            for p in glob.glob(os.path.join(glob.escape(logdir), "**", "events.out.tfevents.*"), recursive=True)
        }
    )
    for run_dir in run_dirs:
        acc = event_accumulator.EventAccumulator(run_dir, size_guidance={event_accumulator.SCALARS: 0})
        acc.Reload()
        prefix = os.path.relpath(run_dir, logdir)
        for tag in acc.Tags().get(event_accumulator.SCALARS, []):
            name = tag if prefix == "." else f"{prefix}/{tag}"
            for event in acc.Scalars(tag):
                out.setdefault(int(event.step), {})[name] = float(event.value)
    return out


@dataclass(frozen=True)
class MetricRow:
    """One (step, logged metric) comparison. `a` / `b` are None where a run lacks the value."""

    step: int
    metric: str
    a: float | None
    b: float | None
    ok: bool

    @property
    def abs_diff(self) -> float | None:
        """|a - b| (None when a value is missing)."""
        if self.a is None or self.b is None:
            return None
        if math.isnan(self.a) and math.isnan(self.b):
            return 0.0
        return abs(self.a - self.b)


@dataclass
class MetricsComparison:
    """Result of `compare_metrics`: rows, plus which requested metrics neither run logged."""

    rows: list[MetricRow] = field(default_factory=list)
    not_logged: list[str] = field(default_factory=list)

    @property
    def diverged(self) -> bool:
        """True if any compared value differs beyond tolerance or is missing in one run."""
        return any(not row.ok for row in self.rows)


def match_names(requested: str, logged: Iterable[str]) -> list[str]:
    """Logged names equal to `requested` or whose last `/` component equals it."""
    return sorted(n for n in logged if n == requested or n.rsplit("/", 1)[-1] == requested)


def values_close(a: float, b: float, atol: float, rtol: float) -> bool:
    """|a - b| <= atol + rtol * |b| (numpy.isclose's rule); NaN equals NaN; inf only equals itself."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= atol + rtol * abs(b)


def compare_metrics(
    run_a: Metrics,
    run_b: Metrics,
    metrics: Sequence[str] = DEFAULT_METRICS,
    atol: float = 0.0,
    rtol: float = 0.0,
    common_steps_only: bool = False,
) -> MetricsComparison:
    """Compare two runs' metrics step by step. Defaults demand bit-identical values (atol = rtol = 0).

    Steps present in only one run count as divergence unless `common_steps_only` (e.g. a shorter mock run).
    """
    steps = sorted(set(run_a) & set(run_b)) if common_steps_only else sorted(set(run_a) | set(run_b))
    logged = {name for values in (*run_a.values(), *run_b.values()) for name in values}
    result = MetricsComparison()
    for requested in metrics:
        names = match_names(requested, logged)
        if not names:
            result.not_logged.append(requested)
        for name in names:
            for step in steps:
                a, b = run_a.get(step, {}).get(name), run_b.get(step, {}).get(name)
                if a is None and b is None:
                    continue  # logged at other steps only (e.g. eval metrics)
                ok = a is not None and b is not None and values_close(a, b, atol, rtol)
                result.rows.append(MetricRow(step, name, a, b, ok))
    result.rows.sort(key=lambda r: (r.step, r.metric))
    return result


def format_table(comparison: MetricsComparison, label_a: str = "run A", label_b: str = "run B") -> str:
    """A per-step text table of a comparison, one row per step and metric."""
    header = ("step", "metric", label_a, label_b, "abs diff", "status")
    rows = [header]
    for r in comparison.rows:
        diff = r.abs_diff
        rows.append(
            (
                str(r.step),
                r.metric,
                _num(r.a),
                _num(r.b),
                "-" if diff is None else f"{diff:.3e}",
                "ok" if r.ok else "DIFF",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def _num(value: float | None) -> str:
    return "missing" if value is None else repr(value)
