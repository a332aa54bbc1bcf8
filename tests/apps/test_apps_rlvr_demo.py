"""The README's first job runs (shortened here; the full run and its learning curve are in the issue notes)."""

from __future__ import annotations

import json

import pytest
from rlvr_fixtures import megatron_shim_overrides

from apps.rlvr.demo import main


def test_demo_runs_two_steps_and_reports_rewards(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["max_steps=2", f"output_dir={out}", f"logging_dir={out}/logs"]) == 0
    printed = capsys.readouterr().out
    assert "[demo] mean reward (fraction of correct sums): first 1 steps" in printed
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [0, 1]
    assert all(0.0 <= s["critic/score/mean"] <= 1.0 for s in steps)


@pytest.mark.parametrize("engine", ["deepspeed_train", "megatron_train"])
def test_the_demo_config_trains_with_each_training_engine(engine, tmp_path):
    """The demo config with actor_train on DeepSpeed (ZeRO-2, the default preset) or Megatron (TP=2 over the two
    CPU slots; the test harness's CUDA shims reach its workers through a sitecustomize on PYTHONPATH)."""
    pytest.importorskip("deepspeed" if engine == "deepspeed_train" else "megatron.core")
    out = tmp_path / engine
    strategy = "actor_train.strategy_args"
    overrides = ["max_steps=2", "eval_steps=0", f"output_dir={out}", f"logging_dir={out}/logs",
                 f"{strategy}.strategy_name={engine}"]  # fmt: skip
    if engine == "megatron_train":
        overrides += [f"+{strategy}.strategy_config.tensor_model_parallel_size=2",
                      f"+{strategy}.strategy_config.sequence_parallel=true",  # as ROLL's async example
                      "actor_train.training_args.gradient_accumulation_steps=2"]  # fmt: skip
        overrides += megatron_shim_overrides(tmp_path / "shims")
    assert main(overrides) == 0
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [0, 1]
    assert all("actor/pg_loss" in s and s["actor/grad_norm"] > 0 for s in steps)
    # the weight sync into hf_infer carried the trained weights: behaviour and trained policies agree
    assert all(abs(s["mismatch/mismatch_kl"]) < 1e-4 for s in steps)
