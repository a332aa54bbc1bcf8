"""The agentic loop end to end on CPU: a tiny local model playing FrozenLake and Sokoban for a few GRPO steps."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import yaml
from agentic_fixtures import make_setup

from apps.agentic.__main__ import main
from apps.common.yaml_config import load_config

pytestmark = pytest.mark.usefixtures("ray_session")  # the session's shared Ray (tests/conftest.py)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return make_setup(tmp_path_factory.mktemp("agentic"))


def _rows(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _args(setup, *overrides):
    return ["--config_path", str(setup), "--config_name", "agentic", *overrides]


@pytest.fixture(scope="module")
def dumped(setup):
    """The config's run as it is (output in ``out``), its episodes dumped by rl-replay's rollout_mock into
    ``dumps``: what the two tests below read."""
    dumps = setup / "dumps"
    assert main(_args(setup, "+rollout_mock.enable=true", "+rollout_mock.mode=dump",
                      f"+rollout_mock.dump_dir={dumps}")) == 0  # fmt: skip
    return setup / "out", dumps


def test_steps_run_validate_render_and_save(setup, dumped):
    rows = _rows(setup / "out")
    assert [r["step"] for r in rows] == [0, 1]
    for metrics in rows:
        for key in ("env/success_rate", "env/FrozenLake/success_rate", "env/SimpleSokoban/success_rate",
                    "env/num_turns/mean", "env/action_valid_rate", "actor/pg_loss", "actor/grad_norm",
                    "critic/score/mean", "mismatch/mismatch_kl", "val/success_rate", "time/rollout"):  # fmt: skip
            assert key in metrics, key
        assert 1.0 <= metrics["env/num_turns/mean"] <= 3.0
        # An untrained model rarely writes a valid action: the format penalty shows in the episode reward.
        assert metrics["env/episode_reward/mean"] < 0.5
        # The sampled tokens' log-probs of the engine match what actor_train recomputes (same weights at step 0).
    assert abs(rows[0]["mismatch/mismatch_kl"]) < 1e-4
    render = setup / "out" / "render" / "step_0"
    texts = sorted(render.glob("*.txt"))
    assert len(texts) == 4 and len(list(render.glob("*.png"))) == 4  # val_batch_size 4 = 2 envs x 2 rounds
    assert "--- state 0 ---" in texts[0].read_text() and "model:" in texts[0].read_text()
    checkpoint = setup / "out" / "checkpoints" / "checkpoint-1"
    assert (checkpoint / "actor_train" / "COMPLETE").exists() and (checkpoint / "actor_hf" / "config.json").exists()
    assert json.loads((checkpoint / "pipeline_state.json").read_text())["step"] == 1


def test_dump_then_mock_gives_identical_training_metrics(setup, dumped):
    """The rollout-dump-mock workflow on agentic episodes: replayed steps train bit for bit like the dumped run."""
    out, dumps = dumped
    mock = ["+rollout_mock.enable=true", "+rollout_mock.mode=mock", f"+rollout_mock.dump_dir={dumps}"]
    assert sorted(p.name for p in (dumps / "train").iterdir()) == ["step_000000.safetensors", "step_000001.safetensors"]
    assert main(_args(setup, *mock, f"output_dir={setup / 'mocked'}")) == 0
    result = subprocess.run([sys.executable, "-m", "rl_replay", "compare-metrics", str(out), str(setup / "mocked")],
                            capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    dumped_rows, mocked = _rows(out), _rows(setup / "mocked")
    assert [r["actor/pg_loss"] for r in dumped_rows] == [r["actor/pg_loss"] for r in mocked]
    assert [r["val/success_rate"] for r in dumped_rows] == [r["val/success_rate"] for r in mocked]
    synced = lambda row: any(key.startswith("model_update/") for key in row)  # noqa: E731
    assert all(synced(r) for r in dumped_rows) and not any(synced(r) for r in mocked)  # actor_infer not started


def test_async_episodes_run_one_step_ahead(setup):
    overrides = ["max_steps=3", "eval_steps=2", "async_generation_ratio=1", f"output_dir={setup / 'async'}",
                 "render_save_dir=null", "actor_train.device_mapping=[0]", "actor_infer.device_mapping=[1]",
                 "actor_train.training_args.per_device_train_batch_size=4"]  # fmt: skip
    assert main(_args(setup, *overrides)) == 0
    rows = _rows(setup / "async")
    assert [r["async/staleness/max"] for r in rows] == [0.0, 1.0, 1.0]
    assert "time/validation_pause" in rows[0] and "val/success_rate" in rows[2] and "val/success_rate" not in rows[1]
    assert all("time/sync_wait" in r for r in rows)
    assert abs(rows[1]["mismatch/mismatch_kl"]) > 100 * abs(rows[0]["mismatch/mismatch_kl"])  # stale behaviour policy


def test_bad_configs_exit_2_naming_the_key(setup, capsys):
    assert main(_args(setup, "rollout_batch_size=6")) == 2
    assert "rollout_batch_size (6) must be a multiple of train_env_manager" in capsys.readouterr().err
    assert main(_args(setup, "train_env_manager.tags=[Nope,FrozenLake]")) == 2
    assert "train_env_manager.tags names ['Nope']" in capsys.readouterr().err
    assert main(_args(setup, "+rewards={}")) == 2
    assert "rewards is not an agentic pipeline key" in capsys.readouterr().err
    assert main(_args(setup, "async_generation_ratio=1")) == 2
    assert "needs actor_infer on devices of its own" in capsys.readouterr().err


def test_the_sokoban_config_runs(setup):
    """apps/agentic/configs/agentic_sokoban_cpu.yaml with the tiny model, shortened (one training rank, as the
    other tests here)."""
    from pathlib import Path

    folder = Path(__file__).resolve().parents[3] / "apps" / "agentic" / "configs"
    out = setup / "sokoban"
    overrides = [f"pretrain={setup / 'model'}", "max_steps=1", "eval_steps=1", f"output_dir={out}",
                 f"render_save_dir={out}/render", "rollout_batch_size=8", "train_env_manager.num_env_groups=2",
                 "val_batch_size=2", "val_env_manager.num_env_groups=2", "max_tokens_per_step=6",
                 "actor_train.training_args.per_device_train_batch_size=4",
                 "actor_train.device_mapping=[0]"]  # fmt: skip
    assert main(["--config_path", str(folder), "--config_name", "agentic_sokoban_cpu", *overrides]) == 0
    (row,) = _rows(out)
    assert "env/SimpleSokoban/success_rate" in row and "val/SimpleSokoban/success_rate" in row
    assert len(list((out / "render" / "step_0").glob("*_SimpleSokoban.png"))) == 2


def test_a_run_killed_after_its_checkpoint_resumes_like_the_uninterrupted_run(setup):
    """Environments are seeded by step, so a run resumed from checkpoint-1 (checkpoint-2 lost to a kill) meets the
    same rooms and lakes at step 2 and trains the same; metrics.jsonl and timeline.json hold each step once."""
    out = setup / "killed"
    base = ["eval_steps=0", "render_save_dir=null", "max_steps=3", f"output_dir={out}"]
    assert main(_args(setup, *base, "save_steps=2")) == 0  # checkpoints 1 and 2; the uninterrupted run
    uninterrupted = _rows(out)[2]
    (out / "checkpoints" / "checkpoint-2" / "pipeline_state.json").unlink()  # written last by save(): killed before
    assert main(_args(setup, *base, "resume_from_checkpoint=true")) == 0
    rows = _rows(out)
    assert [row["step"] for row in rows] == [0, 1, 2]
    for key in ("critic/score/mean", "env/num_turns/mean", "actor/pg_loss", "actor/grad_norm", "mismatch/mismatch_kl"):
        assert rows[2][key] == pytest.approx(uninterrupted[key], abs=1e-6), key
    trace = json.loads((out / "timeline.json").read_text())["traceEvents"]
    phases = sorted((event["args"]["step"], event["name"]) for event in trace)
    assert phases == sorted({*phases}) and {step for step, _ in phases} == {0, 1, 2}


STEP = "roll.pipeline.agentic.env_manager.step_env_manager.StepEnvManager"
STEP_MODE = [f"+custom_envs.{tag}.{key}={value}" for tag in ("FrozenLake", "SimpleSokoban")
             for key, value in (("env_manager_cls", STEP), ("history_length", 2))]  # fmt: skip


def test_gigpo_on_step_samples_replays_bitwise_and_resumes_like_the_uninterrupted_run(setup):
    """StepEnvManager + gigpo + batch_adjust_mode copy: every turn trains as a sample, the count made a multiple of
    the training batch; a rollout_mock replay of the step samples trains bit for bit alike, and a run resumed from
    checkpoint-0 (checkpoint-1 lost to a kill) trains step 1 like the uninterrupted run."""
    out, dumps, mocked = setup / "gigpo", setup / "gigpo_dumps", setup / "gigpo_mocked"
    base = [*STEP_MODE, "adv_estimator=gigpo", "eval_steps=0", "render_save_dir=null", "save_steps=1"]
    dump = ["+rollout_mock.enable=true", "+rollout_mock.mode=dump", f"+rollout_mock.dump_dir={dumps}"]
    assert main(_args(setup, *base, *dump, f"output_dir={out}")) == 0
    rows = _rows(out)
    for row in rows:
        adjusted = row["system/step_samples"] + row["system/batch_add_count"]
        assert row["system/batch_remove_count"] == 0 and adjusted % 4 == 0  # actor_train's global batch: 2 x 2
        assert row["system/step_samples"] >= 8  # 8 episodes of 1 to 3 turns
        for key in ("critic/episode_rewards_norm/mean", "critic/step_rewards_norm/mean", "system/state_batch_size/max",
                    "env/success_rate", "actor/pg_loss"):  # fmt: skip
            assert key in row, key
    assert any(row["system/step_samples"] > 8 for row in rows)  # multi-turn episodes: more samples than episodes
    mock = ["+rollout_mock.enable=true", "+rollout_mock.mode=mock", f"+rollout_mock.dump_dir={dumps}"]
    assert main(_args(setup, *base, *mock, f"output_dir={mocked}")) == 0
    keys = ("actor/pg_loss", "actor/grad_norm", "critic/step_rewards_norm/mean", "system/batch_add_count")
    assert [[r[k] for k in keys] for r in _rows(mocked)] == [[r[k] for k in keys] for r in rows]
    (out / "checkpoints" / "checkpoint-1" / "pipeline_state.json").unlink()  # written last by save(): killed before
    assert main(_args(setup, *base, f"output_dir={out}", "resume_from_checkpoint=true")) == 0
    resumed = _rows(out)
    assert [row["step"] for row in resumed] == [0, 1]
    for key in (*keys, "system/step_samples", "env/num_turns/mean", "mismatch/mismatch_kl"):
        assert resumed[1][key] == pytest.approx(rows[1][key], abs=1e-6), key


def test_the_rollout_pipeline_samples_what_training_samples_and_trains_nothing(setup, dumped, tmp_path, capsys):
    """ROLL's AgenticRolloutPipeline on a file shaped as its agentic_rollout_sokoban.yaml (no actor_train section,
    adv_estimator left at gae with no critic), which the training entry point refuses, naming this one. With the
    same seeds and weights its step-0 episodes are bit for bit those the training run sampled at its step 0 (both
    dumped by rollout_mock); nothing trains or is saved."""
    from safetensors.torch import load_file

    from apps.agentic.config import AgenticConfig
    from apps.agentic.rollout_pipeline import AgenticRolloutPipeline

    _, train_dumps = dumped
    rollout_dumps = tmp_path / "dumps"
    dump = ["+rollout_mock.enable=true", "+rollout_mock.mode=dump", f"+rollout_mock.dump_dir={rollout_dumps}"]
    raw = load_config(setup / "agentic.yaml", [f"output_dir={tmp_path / 'out'}", "max_steps=1", *dump])
    del raw["actor_train"], raw["adv_estimator"]
    with open(tmp_path / "rollout.yaml", "w") as file:
        yaml.safe_dump(raw, file)
    assert main(["--config_path", str(tmp_path), "--config_name", "rollout"]) == 2
    assert "python -m apps.agentic.rollout_pipeline" in capsys.readouterr().err
    lines: list[str] = []
    (row,) = AgenticRolloutPipeline(AgenticConfig.from_dict(raw), log=lines.append).run()
    step_0 = "train/step_000000.safetensors"
    ours, trained = load_file(rollout_dumps / step_0), load_file(train_dumps / step_0)
    assert set(trained) - set(ours) == {"non_tensor_batch/policy_version"}  # the training queue's weights version
    assert all(torch.equal(ours[k], trained[k]) for k in ours)
    trained_row = _rows(setup / "out")[0]
    for key in ("success_rate", "num_turns/mean", "FrozenLake/success_rate", "SimpleSokoban/success_rate"):
        assert row[f"val/{key}"] == trained_row[f"env/{key}"], key
    assert row["val/score/mean"] == pytest.approx(trained_row["env/episode_reward/mean"], abs=1e-6)
    assert row["system/samples"] == 8 and row["time/step_rollout"] > 0
    examples = json.loads(next(line for line in lines if line.startswith("[{")))
    assert len(examples) == 8 and all(example["prompt"] and example["response"] for example in examples)
    scores = sorted(example["episode_score"] for example in examples)
    assert (scores[0], scores[-1]) == (row["val/score/min"], row["val/score/max"])
    assert row["val/score/mean"] == pytest.approx(sum(scores) / 8, abs=1e-6)
    assert not (tmp_path / "out" / "checkpoints").exists()
    assert _rows(tmp_path / "out" / "rollout_pipeline")[0]["step"] == 0  # beside a training run's files, not over them
