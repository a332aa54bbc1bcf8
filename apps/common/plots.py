"""A PNG of a run's curves next to its metrics: people would rather look than read."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

DEFAULT_CURVES = (
    ("critic/score/mean", "reward (score)"),
    ("val/score/mean", "validation score"),
    ("actor/pg_loss", "policy loss"),
    ("actor/kl_loss", "KL loss"),
    ("mismatch/mismatch_kl", "train / rollout mismatch KL"),
)


def quiet_matplotlib() -> None:
    """matplotlib caches fonts under ~/.cache and ~/.config unless told otherwise: keep them in the temp dir."""
    os.environ.setdefault("MPLCONFIGDIR", str(Path(tempfile.gettempdir()) / "rl_matplotlib"))


def plot_metrics(metrics_jsonl: Path, out_png: Path, curves: Sequence[tuple[str, str]] = DEFAULT_CURVES) -> Path | None:
    """Plot each logged curve of ``curves`` (skipping absent ones) against the step; returns the PNG path."""
    quiet_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_jsonl.read_text().splitlines() if line.strip()]
    present = [(key, title) for key, title in curves if any(key in row for row in rows)]
    if not rows or not present:
        return None
    figure, axes = plt.subplots(1, len(present), figsize=(4 * len(present), 3.2), squeeze=False)
    for axis, (key, title) in zip(axes[0], present):
        points = [(row["step"], row[key]) for row in rows if key in row]
        axis.plot([p[0] for p in points], [p[1] for p in points], marker=".", linewidth=1)
        axis.set_title(title)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(out_png, dpi=100)
    plt.close(figure)
    return out_png


def plot_runs(runs: dict[str, Path], key: str, title: str, out_png: Path) -> Path:
    """One metric of several runs on one axis (label -> the run's metrics.jsonl), e.g. two algorithms' success rate."""
    quiet_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 3.6))
    for label, metrics_jsonl in runs.items():
        rows = [json.loads(line) for line in metrics_jsonl.read_text().splitlines() if line.strip()]
        points = [(row["step"], row[key]) for row in rows if key in row]
        axis.plot([p[0] for p in points], [p[1] for p in points], marker=".", linewidth=1, label=label)
    axis.set_title(title)
    axis.set_xlabel("step")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(out_png, dpi=100)
    plt.close(figure)
    return out_png
