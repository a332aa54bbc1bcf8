"""The README's first job runs (shortened here; the full run and its learning curve are in the issue notes)."""

from __future__ import annotations

import json

from apps.rlvr.demo import main


def test_demo_runs_two_steps_and_reports_rewards(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["max_steps=2", f"output_dir={out}", f"logging_dir={out}/logs"]) == 0
    printed = capsys.readouterr().out
    assert "[demo] mean reward (fraction of correct sums): first 1 steps" in printed
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [0, 1]
    assert all(0.0 <= s["critic/score/mean"] <= 1.0 for s in steps)
