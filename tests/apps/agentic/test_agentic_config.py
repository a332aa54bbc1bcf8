"""ROLL's agentic config files load as typed configs and pass pre-flight; bad keys fail naming the key."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml
from agentic_fixtures import CONFIG

from apps.agentic.config import AgenticConfig
from apps.agentic.env_manager import EnvManager, group_seed
from apps.agentic.env_sections import EnvManagerConfig
from apps.agentic.envs import make_env
from apps.agentic.preflight import agentic_preflight
from apps.agentic.step_batch import step_sample_rewards
from apps.common.yaml_config import load_config
from rl_core.batch import RolloutBatch
from rl_engines.config import WorkerConfigError
from tests.shared_dir import ROLL_EXAMPLES, ROLL_TARGETS, require_shared, roll_example_files, roll_target_files

AGENTIC_DIR = ROLL_EXAMPLES / "qwen2.5-0.5B-agentic"
AGENTIC_FILES = roll_example_files("qwen2.5-0.5B-agentic/*.yaml") + roll_target_files(
    "qwen2.5-0.5B-agentic/agentic_val_sokoban_dynamic_batching.yaml",  # dynamic batching (issue 15)
    "qwen2.5-0.5B-agentic/agent_val_frozen_lake.yaml",  # per-manager generating_args, env_instruction (issue 17)
    "qwen2.5-vl-3B-agentic/agentic_val_sokoban.yaml",  # VLTrajEnvManager, grids rendered as pictures (issue 23)
)


@pytest.fixture(params=AGENTIC_FILES, ids=lambda p: p.name)
def roll_file(request):
    return require_shared(request.param)


def test_the_roll_agentic_files_exist():
    require_shared(AGENTIC_DIR)
    assert [p.name for p in AGENTIC_FILES] == ["agent_val_frozen_lake_async.yaml",
                                               "agentic_sokoban_rollout_mock_dump.yaml",
                                               "agentic_val_sokoban_dynamic_batching.yaml",
                                               "agent_val_frozen_lake.yaml", "agentic_val_sokoban.yaml"]  # fmt: skip


def test_every_roll_agentic_file_loads_and_passes_preflight(roll_file):
    """Hydra defaults (traj_envs.yaml), its template variables and ${custom_env.*} entries, megatron_train / vllm."""
    config = AgenticConfig.from_dict(load_config(roll_file))
    assert config.max_tokens_per_step == 64  # the file's override of traj_envs.yaml's 128 ...
    assert config.custom_envs["SimpleSokoban"].max_tokens_per_step == 64  # ... interpolated into every env
    assert config.custom_envs["SimpleSokoban"].env_config["dim_room"] == [6, 6]
    grid = config.custom_envs["SokobanDifferentGridVocab"].env_config
    assert grid["grid_vocab"]["W"] == "wall"
    assert config.reward_normalization.grouping == "traj_group_id"
    manager = config.train_env_manager
    assert manager.num_envs == config.base.rollout_batch_size  # ROLL: one episode per environment and step
    report = agentic_preflight(config)
    assert report.train_plans["actor_train"].samples_per_step == config.base.rollout_batch_size


@pytest.mark.parametrize(
    ("changes", "length", "note"),
    [
        ({"response_length": 1024, "prompt_length": 2048}, 8192,
         "prompt_length / response_length: ROLL reads them only to derive a null sequence_length and sequence_length "
         "is 8192, so they change nothing"),
        ({"response_length": 512, "sequence_length": None}, 1536,
         "sequence_length is null: prompt_length (1024) + response_length (512) = 1536 tokens"),
        ({"response_length": 512, "prompt_length": 256, "sequence_length": None}, 768, "(256) + response_length (512)"),
        ({"prompt_length": 256, "sequence_length": None}, 8192, "response_length is null, so sequence_length is the "
         "default 8192"),
    ],
)  # fmt: skip
def test_prompt_and_response_length_derive_a_null_sequence_length_as_in_roll(changes, length, note):
    """ROLL's base config (shared by its agentic pipeline) sets sequence_length = prompt_length (1024 when absent) +
    response_length when sequence_length is null, then drops both; its deepeyes.yaml sets them to interpolate
    ${response_length} into max_tokens_per_step. They used to be refused here as RLVR-only keys."""
    config = AgenticConfig.from_dict(_config(**changes))
    assert config.sequence_length == length
    assert any(note in n for n in agentic_preflight(config).notes)


def test_rolls_seq_mean_token_sum_norm_divides_an_episode_batch_by_sequence_length_minus_one():
    """ROLL's agentic workers aggregate with the same agg_loss: seq-mean-token-sum-norm divides the token sums by
    the width of the loss mask its env managers pad to sequence_length, minus the first token, alone."""
    from apps.common.algorithm import AlgorithmSettings

    config = AgenticConfig.from_dict(_config(loss_agg_mode="seq-mean-token-sum-norm", sequence_length=1536))
    assert any("divide by sequence_length - 1 = 1535 (the width" in n for n in agentic_preflight(config).notes)
    actor = AlgorithmSettings.from_config(config.base, sequence_length=config.sequence_length).actor
    assert (actor.loss_agg_mode, actor.norm_length) == ("token-sum-norm", 1535.0)


def test_a_sequence_length_within_a_turn_passes_as_in_roll_and_a_bad_length_names_the_key():
    """ROLL cuts each turn to the room its context leaves (make_decision), so a sequence_length no longer than
    max_tokens_per_step runs there: it passes, with a note (the turns' budgets: test_agentic_episodes.py)."""
    config = AgenticConfig.from_dict(_config(response_length=40, prompt_length=20, sequence_length=None))
    notes = agentic_preflight(config).notes  # every turn may take max_tokens_per_step = 64 tokens
    assert any("sequence_length (60 = prompt_length + response_length) is at most max_tokens_per_step (64)" in note
               for note in notes)  # fmt: skip
    assert not any(
        "is at most max_tokens_per_step" in note for note in agentic_preflight(AgenticConfig.from_dict(_config())).notes
    )
    with pytest.raises(WorkerConfigError, match=r"response_length must be >= 1, got 0"):
        AgenticConfig.from_dict(_config(response_length=0))


def test_guide_spellings_of_env_manager_keys():
    """The config guide writes env_groups / n_groups; the example files num_env_groups / num_groups_partition."""
    config = EnvManagerConfig.from_dict({"env_groups": 4, "n_groups": [1, 3], "tags": ["A", "B"]}, "m")
    assert config.num_env_groups == 4 and config.partition() == [1, 3]
    assert EnvManagerConfig.from_dict({"num_env_groups": 5, "tags": ["A", "B"]}, "m").partition() == [3, 2]
    with pytest.raises(WorkerConfigError, match=r"m.num_groups_partition \[1, 1\] sums to 2, not num_env_groups=4"):
        EnvManagerConfig.from_dict({"env_groups": 4, "n_groups": [1, 1], "tags": ["A", "B"]}, "m")
    with pytest.raises(WorkerConfigError, match=r"m\.worker_cls='my\.Manager' is not an env manager"):
        EnvManagerConfig.from_dict({"tags": ["A"], "worker_cls": "my.Manager"}, "m")


def _config(**changes):
    raw = load_config(require_shared(AGENTIC_DIR / "agentic_sokoban_rollout_mock_dump.yaml"))
    raw.update(changes)
    return raw


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"rewards": {}}, "rewards is not an agentic pipeline key"),
        ({"rl_loss_coef": 0.5}, "rl_loss_coef is not an agentic pipeline key: ROLL's agentic config has no"),
        # ROLL's agentic pipeline drops / never reads them: they had trained sequence_ppo and added a length reward
        ({"importance_sampling": "seq"}, "importance_sampling='seq' changes nothing in an agentic run: ROLL's agentic"),
        ({"add_len_reward": True}, "add_len_reward=True changes nothing in an agentic run: ROLL's agentic pipeline"),
        ({"reward_normalization": {"grouping": "nope", "method": "mean_std"}}, "reward_normalization.grouping='nope'"),
        ({"reward_normalization": {"grouping": "traj_group_id", "norm_std_type": "sample"}},
         "reward_normalization.norm_std_type='sample'; use batch, group or null"),
        ({"train_env_manager": {"tags": ["Nope"], "num_env_groups": 1}}, "train_env_manager.tags names ['Nope']"),
        ({"custom_envs": {"SimpleSokoban": {"env_type": "chess"}}}, "custom_envs.SimpleSokoban.env_type='chess'"),
        ({"custom_envs": {"SimpleSokoban": {"env_type": "game:Wordle-v0"}}},
         "custom_envs.SimpleSokoban.env_type 'game:Wordle-v0' needs NLTK's words corpus"),
        ({"custom_envs": {"SimpleSokoban": {"env_type": "sokoban", "agent_template": "{oops}"}}},
         "custom_envs.SimpleSokoban.agent_template cannot be formatted"),
        ({"rollout_batch_size": 100}, "rollout_batch_size (100) must be a multiple"),
    ],
)  # fmt: skip
def test_bad_agentic_keys_name_the_key(changes, message):
    raw = _config(**changes)
    if "custom_envs" in changes or "train_env_manager" in changes:
        raw["val_env_manager"] = None
    if "custom_envs" in changes:
        raw["train_env_manager"] = {"tags": ["SimpleSokoban"], "num_env_groups": 16, "group_size": 8}
    with pytest.raises(WorkerConfigError) as err:
        AgenticConfig.from_dict(raw)
    assert message in str(err.value)


def test_groups_share_seeds_and_splits_never_meet():
    raw = _config()
    config = AgenticConfig.from_dict(raw)
    small = EnvManagerConfig.from_dict({"num_env_groups": 3, "group_size": 2, "tags": ["SimpleSokoban"],
                                        "max_env_num_per_worker": 4}, "m")  # fmt: skip
    manager = EnvManager(config, small, "train")
    try:
        seeds = manager.seeds(step=5, round_index=0)
        assert seeds[0] == seeds[1] and seeds[2] == seeds[3] and len(set(seeds)) == 3
        assert seeds != manager.seeds(step=6, round_index=0)
        assert len(manager.workers) == 2  # 6 environments, at most 4 per worker
        observations = manager.reset(seeds)
        assert observations[0] == observations[1] and observations[0] != observations[2]  # same seed, same room
        results = manager.step({0: "<answer>Up</answer>", 3: "no answer here"})
        assert set(results) == {0, 3} and not results[3].info["action_is_valid"]
        # a malformed Sokoban action: gym-sokoban's no-op step (-0.1) and the environment's format_penalty, as ROLL
        assert results[3].reward == pytest.approx(
            -0.1 + config.custom_envs["SimpleSokoban"].env_config["format_penalty"]
        )
    finally:
        manager.close()
    train = {group_seed(1, "train", s, 0, g) for s in range(50) for g in range(20)}
    val = {group_seed(1, "val", s, 0, g) for s in range(50) for g in range(20)}
    assert not train & val


def test_per_manager_generating_args_follow_rolls_precedence():
    """agent_val_frozen_lake.yaml samples with the managers' generating_args: train_env_manager's become
    actor_infer's, val_env_manager's sample validation; ROLL would let actor_infer's silently override both."""
    raw = load_config(require_shared(ROLL_TARGETS / "qwen2.5-0.5B-agentic/agent_val_frozen_lake.yaml"))
    config = AgenticConfig.from_dict(raw)
    assert config.base.actor_infer.generating_args.temperature == 0.99
    assert config.base.actor_infer.generating_args.top_k == 100
    assert config.val_env_manager is not None and config.val_env_manager.generating_args is not None
    assert config.val_env_manager.generating_args.temperature == 0.2
    lake = config.custom_envs["FrozenLakeLocallyDefineExamples"].env_config
    env = make_env("frozen_lake", lake)
    assert env.instructions.startswith("You are solving the FrozenLake puzzle. Forbid the whole")
    assert "Valid actions" in env.instructions  # the actions and the answer format still follow
    raw["actor_infer"]["generating_args"] = {"temperature": 0.5}
    with pytest.raises(WorkerConfigError, match=r"actor_infer\.generating_args and train_env_manager\.generating_args"):
        AgenticConfig.from_dict(raw)
    raw["actor_infer"].pop("generating_args")
    raw["val_env_manager"]["generating_args"]["num_return_sequences"] = 2
    with pytest.raises(WorkerConfigError, match=r"val_env_manager\.generating_args\.num_return_sequences is 2"):
        AgenticConfig.from_dict(raw)


def test_sampling_keys_a_manager_leaves_out_get_a_note_naming_it():
    """ROLL's defaults (temperature 0.95, top_p 0.7, top_k 50) differ from the plain sampling used here where a file
    leaves a key out: pre-flight names the section the file gives the sampling in."""
    raw = load_config(require_shared(ROLL_TARGETS / "qwen2.5-0.5B-agentic/agent_val_frozen_lake.yaml"))
    assert not AgenticConfig.from_dict(raw).base.sampling_notes  # ROLL's file sets all three
    del raw["train_env_manager"]["generating_args"]["top_p"]
    (note,) = AgenticConfig.from_dict(raw).base.sampling_notes
    assert note.startswith("[preflight] train_env_manager.generating_args leaves top_p out: this run samples with "
                           "top_p 1.0")  # fmt: skip


def test_a_decaying_schedule_without_max_steps_gets_rolls_count():
    """ROLL's set_max_steps: agent_val_frozen_lake_gigpo.yaml uses cosine without training_args.max_steps; it decays
    over max_steps x rollout_batch_size x ppo_epochs / (per_device x accumulation x dp) = 10240 x 1024 / 1024."""
    raw = load_config(require_shared(ROLL_TARGETS / "qwen2.5-0.5B-agentic/agent_val_frozen_lake_gigpo.yaml"))
    config = AgenticConfig.from_dict(raw)
    assert config.base.actor_train.training_args.max_steps is None
    report = agentic_preflight(config)
    assert config.base.actor_train.training_args.max_steps == 10240
    assert any("actor_train.training_args.max_steps is not set: 10240 optimizer steps" in n for n in report.notes)
    raw["actor_train"]["training_args"]["max_steps"] = 7  # given: kept
    config = AgenticConfig.from_dict(raw)
    agentic_preflight(config)
    assert config.base.actor_train.training_args.max_steps == 7


def test_asym_clip_normalises_as_rolls_mean_std_without_a_clamp(tmp_path):
    """ROLL's current agentic norm treats method asym_clip as mean_std (its [-1, 3] clamp went in Nov 2025): in
    groups of four scores with std 4, a low outlier lands 1.5 std below its group's mean, unclamped."""
    text = CONFIG.format(out=tmp_path / "out", model=tmp_path / "model")
    config = AgenticConfig.from_dict(yaml.safe_load(text.replace("method: mean_std", "method: asym_clip")))
    scores = torch.tensor([0.0, 0.0, 0.0, 8.0, 8.0, 8.0, 8.0, 0.0])
    batch = RolloutBatch({"scores": scores}, {"traj_group_id": np.array([0] * 4 + [1] * 4), "tag": np.array(["a"] * 8)})
    rewards, _ = step_sample_rewards(batch, config)
    assert rewards.tolist() == pytest.approx([-0.5, -0.5, -0.5, 1.5, 0.5, 0.5, 0.5, -1.5])  # (x - mean) / 4
    notes = "\n".join(agentic_preflight(config).notes)
    assert "[preflight] reward_normalization.method: asym_clip normalises as mean_std" in notes


def test_reward_normalization_without_grouping_normalises_over_the_batch_as_in_roll(tmp_path):
    """ROLL's RewardNormalizationConfig.grouping defaults to batch: scores [1, 0, 0, 0] of two env groups, method
    mean, give [0.75, -0.25, -0.25, -0.25] (per env group they would give [0.5, -0.5, 0, 0])."""
    text = CONFIG.format(out=tmp_path / "out", model=tmp_path / "model")
    config = AgenticConfig.from_dict(yaml.safe_load(text.replace("{grouping: traj_group_id, method: mean_std}",
                                                                 "{method: mean}")))  # fmt: skip
    assert config.reward_normalization.grouping == "batch"
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0])
    batch = RolloutBatch({"scores": scores}, {"traj_group_id": np.array([0, 0, 1, 1]), "tag": np.array(["a"] * 4)})
    rewards, _ = step_sample_rewards(batch, config)
    assert rewards.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])


AGENTIC_PG = "roll.pipeline.agentic.agentic_actor_pg_worker.ActorWorker"


def _with_actor_keys(changes: dict) -> dict:
    """The example file with top-level ``changes``, its ``actor_train`` entry merged into the file's section."""
    raw = _config()
    changes = dict(changes)
    actor = changes.pop("actor_train", {})
    raw.update(changes)
    raw["actor_train"].update(actor)
    return raw


@pytest.mark.parametrize(
    ("changes", "loss"),
    [
        ({}, "vanilla"),
        ({"ratio_type": "segment"}, "segment_ppo"),  # ROLL's agentic ActorWorker on one ratio per turn
        ({"ratio_type": "segment", "actor_train": {"worker_cls": AGENTIC_PG, "pg_variant": "ppo"}}, "segment_ppo"),
        ({"actor_train": {"worker_cls": AGENTIC_PG, "pg_variant": "topr"}}, "topr"),  # the agentic PG worker's loss
    ],
)  # fmt: skip
def test_ratio_type_and_the_agentic_pg_worker_pick_the_loss(changes, loss):
    from apps.common.algorithm import AlgorithmSettings

    config = AgenticConfig.from_dict(_with_actor_keys(changes))
    assert AlgorithmSettings.from_config(config.base, ratio_type=config.ratio_type).actor.policy_loss == loss


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"ratio_type": "turn"}, "ratio_type='turn'; valid values: ['token', 'segment']"),
        ({"ratio_type": "segment", "actor_train": {"worker_cls": AGENTIC_PG, "pg_variant": "tis"}},
         "ratio_type: segment is ROLL's PPO on one ratio per segment (an assistant turn), but the configured loss is "
         "'tis'"),
        ({"ratio_type": "segment", "importance_sampling": "seq"}, "importance_sampling='seq' changes nothing"),
    ],
)  # fmt: skip
def test_a_segment_ratio_is_refused_where_it_is_not_built(changes, message):
    with pytest.raises(WorkerConfigError) as err:
        AgenticConfig.from_dict(_with_actor_keys(changes))
    assert message in str(err.value)


def test_a_managers_format_penalty_changes_nothing_as_in_roll():
    """ROLL declares train_env_manager.format_penalty and reads it nowhere: a malformed action scores its
    environment's env_config.format_penalty (ROLL's agent_val_frozen_lake_gigpo.yaml sets -0.1 beside FrozenLake's
    -0.01). It had overwritten every environment's."""
    from apps.agentic.preflight import manager_penalty_notes

    raw = _config()
    raw["train_env_manager"] = {**raw["train_env_manager"], "format_penalty": -0.7}
    config = AgenticConfig.from_dict(raw)
    manager = EnvManager(config, config.train_env_manager, "train")
    try:
        seeds = manager.seeds(step=0, round_index=0)
        manager.reset(seeds)
        result = manager.step({0: "no answer here"})[0]
        assert not result.info["action_is_valid"]
        penalty = config.custom_envs[manager.slots[0].tag].env_config["format_penalty"]
        assert result.reward == pytest.approx(-0.1 + penalty) and penalty != -0.7  # Sokoban: no-op step + penalty
    finally:
        manager.close()
    assert "train_env_manager.format_penalty (-0.7) changes nothing" in manager_penalty_notes(config)[0]


def test_validation_samples_with_actor_infers_generating_args_when_its_manager_has_none(tmp_path):
    """ROLL gives val_env_manager actor_infer's generating_args (agentic_config.py's __post_init__); validation had
    been greedy here when the manager had none."""
    from agentic_fixtures import make_setup

    from apps.agentic.pipeline import AgenticPipeline

    raw = load_config(make_setup(tmp_path) / "agentic.yaml")
    raw["actor_infer"]["generating_args"]["temperature"] = 0.7
    pipeline = AgenticPipeline(AgenticConfig.from_dict(raw))
    try:
        assert pipeline.val_runner is not None and pipeline.val_runner.generating.temperature == 0.7
    finally:
        pipeline.train_envs.close()
        if pipeline.val_envs is not None:
            pipeline.val_envs.close()


def test_whole_episodes_are_resized_by_batch_adjust_mode_as_roll_resizes_every_batch(tmp_path):
    """ROLL's adjust_batch runs on trajectory batches too: 8 episodes with a log-prob pass of 3 samples (size_divide
    lcm(4, 3) = 12) train 12 samples with batch_adjust_mode: copy (4 copies). Only step samples had been resized."""
    from agentic_fixtures import make_setup

    from apps.agentic.pipeline import AgenticPipeline
    from apps.agentic.step_batch import adjusted_size

    raw = load_config(make_setup(tmp_path) / "agentic.yaml")
    raw["actor_train"]["infer_batch_size"] = 3
    pipeline = AgenticPipeline(AgenticConfig.from_dict(raw))
    try:
        assert pipeline.divisor == 12 and pipeline.report.train_plans["actor_train"].samples_per_step == 12  # too
        episodes = RolloutBatch.from_dict({"response_mask": torch.ones(8, 3)}, {"traj_group_id": list("aabbccdd")})
        samples, plans, counts = pipeline._samples(episodes, step=0)
        assert len(samples) == 12 and counts["system/batch_add_count"] == 4.0
        assert plans["actor_train"].samples_per_step == 12 and plans["actor_train"].optimizer_steps_per_rollout == 3
        assert list(samples.non_tensor_batch["traj_group_id"])[:8] == list("aabbccdd")  # the episodes, then copies
    finally:
        pipeline.train_envs.close()
        if pipeline.val_envs is not None:
            pipeline.val_envs.close()
    assert [adjusted_size(8, mode, 12) for mode in ("copy", "delete", "auto", "random_sample")] == [12, 12, 12, 12]
    assert [adjusted_size(14, mode, 12) for mode in ("copy", "delete", "auto", "random_sample")] == [24, 12, 12, 12]


def test_the_defaults_of_shared_keys_roll_drops_in_agentic_runs_pass():
    """ROLL runs agentic files that give add_len_reward: false or importance_sampling: token (it drops or never reads
    them); only another value is refused (test_bad_agentic_keys_name_the_key)."""
    config = AgenticConfig.from_dict(_config(add_len_reward=False, importance_sampling="token"))
    assert config.base.add_len_reward is False and config.base.importance_sampling == "token"
