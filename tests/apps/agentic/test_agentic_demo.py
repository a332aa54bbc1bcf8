"""The agentic demo runs (shortened here; the full run and its success curve are in the issue notes)."""

from __future__ import annotations

import json

from apps.agentic.demo import main
from apps.agentic.demo_model import LAKE_4X4, _move, expert_moves


def test_the_expert_of_the_warm_up_solves_the_lake():
    moves, cell = expert_moves(), (0, 0)
    for _ in range(6):
        cell = _move(cell, moves[cell])
        assert LAKE_4X4[cell[0]][cell[1]] != "H"
    assert LAKE_4X4[cell[0]][cell[1]] == "G"


def test_demo_runs_two_steps_and_reports_success(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["max_steps=2", "eval_steps=1", f"output_dir={out}", f"render_save_dir={out}/render"]) == 0
    printed = capsys.readouterr().out
    assert "[demo] FrozenLake success rate: first 1 steps" in printed
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [0, 1]
    # The warm-up leaves a model that writes valid actions and sometimes reaches the goal.
    assert all(s["env/action_valid_rate"] > 0.5 for s in steps)
    assert all(0.0 <= s["env/success_rate"] <= 1.0 for s in steps) and "val/success_rate" in steps[1]
    assert len(list((out / "render" / "step_1").glob("*.png"))) == 8
