"""curves.png: written next to the metrics, and matplotlib's font cache stays out of the home directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_plot_is_written_and_nothing_lands_in_home(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps({"step": s, "critic/score/mean": s / 4}) for s in range(4)))
    env = {k: v for k, v in os.environ.items() if k != "MPLCONFIGDIR"} | {"HOME": str(tmp_path / "home")}
    code = ("from pathlib import Path; from apps.common.plots import plot_metrics; "
            f"print(plot_metrics(Path({str(metrics)!r}), Path({str(tmp_path / 'curves.png')!r})))")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "curves.png").stat().st_size > 1000
    assert not (tmp_path / "home").exists()
