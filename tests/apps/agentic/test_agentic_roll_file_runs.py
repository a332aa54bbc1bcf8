"""The roll-targets agentic files of issue 17 run one step on CPU after the swaps a CPU needs and nothing else: model
paths (the tiny local model), devices (two CPU slots), engines (torch-native), sizes (a few small env groups, short
turns), files (outputs in a temp dir; GEM math's Hub dataset as a local .jsonl with its question / answer fields).
GiGPO on FrozenLake with StepEnvManager, step_reinforce on the native Sokoban conversation (group mean, batch std),
reinforce on GEM math questions (roll_math) with whole episodes, and Sokoban with ROLL's dynamic batching in the
training and log-prob passes of actor_train and the reference (issue 15)."""

from __future__ import annotations

import json

import pytest
from agentic_fixtures import make_setup

from apps.agentic.config import AgenticConfig
from apps.agentic.pipeline import AgenticPipeline
from apps.common.yaml_config import load_config
from tests.shared_dir import require_shared, roll_target_files

pytestmark = pytest.mark.usefixtures("ray_session")  # the session's shared Ray (tests/conftest.py)

FILES = roll_target_files(
    "qwen2.5-0.5B-agentic/agent_val_frozen_lake_gigpo.yaml",
    "qwen2.5-0.5B-agentic/agentic_val_sokoban_native.yaml",
    "qwen3_agentic_gem/gem_math_dapo.yaml",
    "qwen2.5-0.5B-agentic/agentic_val_sokoban_dynamic_batching.yaml",  # dynamic batching (issue 15)
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = make_setup(tmp_path_factory.mktemp("roll_files"))
    questions = [{"prompt": f"What is {a} + 1?", "solution": str(a + 1)} for a in range(6)]
    (root / "math.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    return root


def on_cpu(raw: dict, root, out) -> dict:
    """The ROLL file with the swaps above."""
    raw.update(pretrain=str(root / "model"), reward_pretrain=str(root / "model"), num_nodes=1, num_gpus_per_node=2,
               max_steps=1, save_steps=1, eval_steps=0, rollout_batch_size=8, val_batch_size=None,
               sequence_length=900, max_tokens_per_step=6, output_dir=str(out), logging_dir=str(out / "logs"),
               render_save_dir=None, checkpoint_config={"type": "file_system", "output_dir": str(out / "ckpt")},
               track_with="stdout", tracker_kwargs={})  # fmt: skip
    separate = bool(raw.get("async_generation_ratio"))  # generation ahead of training needs devices of its own
    for role, engine in (("actor_train", "fsdp2_train"), ("actor_infer", "hf_infer"), ("reference", "hf_infer")):
        if raw.get(role):
            raw[role]["strategy_args"] = {"strategy_name": engine}
            raw[role]["device_mapping"] = [1] if separate and role == "actor_infer" else [0]
            raw[role]["infer_batch_size"] = 2
    raw["actor_train"]["training_args"].update(per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                               warmup_steps=0)  # fmt: skip
    if raw["actor_infer"].get("generating_args"):
        raw["actor_infer"]["generating_args"]["max_new_tokens"] = 6
    raw["train_env_manager"].update(num_env_groups=2, group_size=4, num_groups_partition=[2], max_env_num_per_worker=0)
    raw["val_env_manager"] = None
    for spec in raw["custom_envs"].values():
        if spec.get("env_type") == "roll_math":
            spec["env_config"]["dataset_name"] = str(root / "math.jsonl")
    return raw


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_a_roll_agentic_file_runs_a_step_on_cpu(setup, tmp_path, path):
    config = AgenticConfig.from_dict(on_cpu(load_config(require_shared(path)), setup, tmp_path))
    pipeline = AgenticPipeline(config)
    (row,) = pipeline.run()
    assert row["env/num_turns/mean"] >= 1.0 and "actor/pg_loss" in row
    if config.mode(config.train_env_manager) != "trajectory":  # one sample per turn, resized to the batch of 4
        assert (row["system/step_samples"] + row["system/batch_add_count"]) % 4 == 0
    if config.base.adv_estimator == "gigpo":
        assert "system/state_batch_size/max" in row
    if "dapo_17k" in config.train_env_manager.tags:  # one question, one answer
        assert row["env/num_turns/mean"] == 1.0
    if "dynamic_batching" in path.name:  # ROLL's metrics of the passes with a token budget (no KL: no reference)
        for name in ("actor_train/train_step", "actor_train/compute_log_probs"):
            assert row[f"dynamic_batching/{name}/valid_tokens"] <= row[f"dynamic_batching/{name}/actual_tokens"]
    else:
        assert not any(key.startswith("dynamic_batching/") for key in row)
    assert (tmp_path / "ckpt" / "checkpoint-0" / "pipeline_state.json").exists()


def test_rolls_vl_sokoban_file_runs_a_step_on_cpu_with_pictures(tmp_path):
    """ROLL's Qwen2.5-VL Sokoban file (VLTrajEnvManager, render_mode rgb_array; issue 23) after the same swaps, on a
    tiny Qwen2.5-VL: the episodes' pictures reach generation and training."""
    from apps.agentic.envs import make_env
    from rl_engines.tiny_model import build_tiny_vl_model

    corpus = ["<answer>Up</answer> <answer>Down</answer>", make_env("sokoban").instructions]
    build_tiny_vl_model(tmp_path / "model", corpus, vocab_size=500)
    path = require_shared(roll_target_files("qwen2.5-vl-3B-agentic/agentic_val_sokoban.yaml")[0])
    raw = on_cpu(load_config(path), tmp_path, tmp_path / "out")
    raw["sequence_length"] = 1500  # the instructions and up to ten turns, each with a picture of the room
    config = AgenticConfig.from_dict(raw)
    assert config.visual(config.train_env_manager)
    (row,) = AgenticPipeline(config).run()
    assert row["env/num_turns/mean"] >= 1.0 and "actor/pg_loss" in row
