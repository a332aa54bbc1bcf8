"""Step samples without Ray: StepEnvManager (each turn's prompt and its history window) and AgentNativeStepEnvManager
(the environment's conversation), the samples and their columns, batch_adjust_mode, the divisor it adjusts to, and
the config checks of both."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from agentic_fixtures import InProcessGroup, make_setup

from apps.agentic.config import AgenticConfig
from apps.agentic.env_manager import EnvManager
from apps.agentic.envs import make_env
from apps.agentic.preflight import agentic_preflight
from apps.agentic.rollout import Turn
from apps.agentic.step_batch import adjust_batch, size_divisor, step_sample_rewards, with_step_returns
from apps.agentic.step_rollout import INVALID_TIP, NativeRunner, StepRunner, history_window, state_key
from apps.common.preflight import fill_model_paths, role_sections
from apps.common.yaml_config import load_config
from rl_core.batch import RolloutBatch
from rl_engines.config import WorkerConfigError
from rl_engines.role_worker import RoleWorker
from rl_engines.worker_group import WorkerBase
from tests.shared_dir import ROLL_EXAMPLES, ROLL_TARGETS, require_shared

STEP = "roll.pipeline.agentic.env_manager.step_env_manager.StepEnvManager"
TEMPLATE = "'Done {step_count}. Last {history_length}: [{history}] Now ({current_step}): {current_observation}'"
STEP_KEYS = (("env_manager_cls", STEP), ("history_length", 3), ("agent_template", TEMPLATE))
STEP_MODE = [f"+custom_envs.{tag}.{key}={value}" for tag in ("FrozenLake", "SimpleSokoban") for key, value in STEP_KEYS]


def _turn(observation: str, action: str | None, reward: float, response: str = "<answer>?</answer>") -> Turn:
    return Turn([1], [2], [-0.1], reward, observation, response, action)


def test_the_history_window_shows_the_last_turns_numbered_with_rolls_invalid_tip():
    turns = [_turn("s0", "Up", 0.0), _turn("s1", None, -0.01, "hello"), _turn("s2", "Left", 0.0)]
    # history_length 3: the current turn and the two before it (ROLL: history[-3:-1]).
    assert history_window(turns, 3) == (
        f"(step: 2, observation: s1, action: hello{INVALID_TIP}, reward: -0.01), "
        "(step: 3, observation: s2, action: Left, reward: 0.0)"
    )
    assert history_window(turns, 10).startswith("(step: 1, observation: s0, action: Up, reward: 0.0), ")
    # ROLL's default_history_length 5 after three turns: all three (history[-5:-1]), not the last one.
    assert history_window(turns, 5) == history_window(turns, 4) == history_window(turns, 10)
    assert history_window(turns, 5).count("(step: ") == 3
    assert history_window(turns, 2).count("(step: ") == 1
    assert history_window(turns, 1) == history_window(turns, None) == history_window([], 5) == ""


def test_state_keys_are_rolls_observation_hash():
    assert state_key("a") == state_key("a") != state_key("b")
    assert (
        state_key("a") == "980410da9522db17c3ab8743541f192a5ab27772a6154dbc7795ee909e653a5c"
    )  # sha256(b"str:a"), as ROLL's compute_object_hash("a")


@pytest.fixture(scope="module")
def step_run(tmp_path_factory):
    """Two rounds of step-mode episodes of the tiny setup, in this process."""
    root = make_setup(tmp_path_factory.mktemp("steps"))
    config = AgenticConfig.from_dict(load_config(root / "agentic.yaml", ["max_tokens_per_step=4", *STEP_MODE]))
    fill_model_paths(config.base)
    worker = RoleWorker("actor_infer", 0, 1, "127.0.0.1", WorkerBase.free_port(), {}, config.base.actor_infer)
    worker.initialize()
    manager = EnvManager(config, config.train_env_manager, "train")
    tokenizer = worker.strategy.tokenizer
    generating = replace(config.base.actor_infer.generating_args, temperature=1.0)
    runner = StepRunner(manager, tokenizer, generating, 600)
    try:
        episodes = runner.run(InProcessGroup(worker), step=0, rounds=2)
        yield config, episodes, runner.to_batch(episodes), tokenizer
    finally:
        manager.close()


def test_every_turn_is_a_sample_prompted_afresh_with_its_window(step_run):
    _, episodes, batch, tokenizer = step_run
    assert sum(len(e.turns) for e in episodes) == len(batch) and any(len(e.turns) > 2 for e in episodes)
    for episode in episodes:
        assert len(episode.turns) == len(episode.rewards)
        for index, turn in enumerate(episode.turns):
            prompt = tokenizer.decode(turn.prompt_ids, skip_special_tokens=True)
            assert f"Done {index}. Last {min(index, 2)}: [" in prompt and f"Now ({index + 1}): " in prompt
            assert episode.slot.env.instructions.splitlines()[0] in prompt  # no {env_instruction}: put first
            if index:  # the window: the previous turn's observation, action and reward
                previous = episode.turns[index - 1]
                assert f"(step: {index}, observation: {previous.observation}" in prompt
            if index >= 3:  # ... but not three turns back
                assert f"(step: {index - 2}," not in prompt
    columns = batch.non_tensor_batch
    row = 0
    for episode in episodes:
        for index, turn in enumerate(episode.turns):
            assert columns["step"][row] == index and columns["step_scores"][row] == turn.reward
            assert columns["episode_scores"][row] == pytest.approx(sum(episode.rewards))
            assert columns["state_hash"][row] == state_key(turn.observation)
            assert batch.batch["scores"][row] == pytest.approx(turn.reward)
            n = len(turn.response_ids)
            assert batch.batch["responses"][row, :n].tolist() == turn.response_ids
            assert batch.batch["response_mask"][row].sum() == n  # every sampled token of the turn, nothing else
            assert batch.batch["rollout_log_probs"][row, :n].tolist() == pytest.approx(turn.log_probs)
            row += 1
    assert len(set(columns["traj_id"])) == len(episodes)
    first_states = [columns["state_hash"][i] for i in range(len(batch)) if columns["step"][i] == 0]
    groups = [columns["traj_group_id"][i] for i in range(len(batch)) if columns["step"][i] == 0]
    for group in set(groups):  # the episodes of one env group start from one state: GiGPO's first anchor
        assert len({s for s, g in zip(first_states, groups, strict=True) if g == group}) == 1


def _rows(n: int) -> RolloutBatch:
    return RolloutBatch.from_dict({"scores": torch.arange(n, dtype=torch.float32)}, {"id": list(range(n))})


@pytest.mark.parametrize(
    ("mode", "size", "expected", "added", "removed"),
    [("copy", 10, 12, 2, 0), ("delete", 10, 8, 0, 2), ("auto", 10, 8, 0, 2), ("auto", 11, 8, 0, 3),
     ("auto", 3, 4, 1, 0), ("random_sample", 10, 4, 0, 6), ("random_sample", 3, 4, 1, 0), ("delete", 3, 4, 1, 0),
     ("copy", 8, 8, 0, 0)],
)  # fmt: skip
def test_batch_adjust_modes(mode, size, expected, added, removed):
    out, counts = adjust_batch(_rows(size), mode, 4, np.random.default_rng(0))
    assert len(out) == expected
    assert counts == {"system/batch_add_count": added, "system/batch_remove_count": removed}
    ids = list(out.non_tensor_batch["id"])
    assert set(ids) <= set(range(size)) and out.batch["scores"].tolist() == [float(i) for i in ids]
    if added:
        assert ids[:size] == list(range(size))  # the originals stay, copies follow
    if removed:
        assert ids == sorted(set(ids))  # kept in order, none twice
    again, _ = adjust_batch(_rows(size), mode, 4, np.random.default_rng(0))
    assert list(again.non_tensor_batch["id"]) == ids  # seeded: a resumed or replayed step adjusts alike


def test_the_divisor_is_rolls_lcm_of_the_batch_sizes(step_run):
    config = step_run[0]
    sections = role_sections(config.base)
    # actor_train on one rank: global batch 2 x 2 = 4, infer_batch_size 4 -> lcm 4.
    assert size_divisor(config, sections) == 4
    config.base.actor_train.infer_batch_size = 6
    try:
        assert size_divisor(config, sections) == 12
    finally:
        config.base.actor_train.infer_batch_size = 4
    # A configured critic scores and trains every step (whatever the estimator): its batch sizes count too.
    critic = replace(sections["actor_train"], infer_batch_size=5)
    assert size_divisor(config, {**sections, "critic": critic}) == 20


def test_gigpo_rewards_of_a_step_batch(step_run):
    config, _, batch, _ = step_run
    batch = with_step_returns(batch.index(slice(None)), 0.5)
    config = replace(config, base=replace(config.base, adv_estimator="gigpo"))
    rewards, metrics = step_sample_rewards(batch, config)
    assert rewards.shape == (len(batch),)
    assert {"critic/episode_rewards_norm/mean", "critic/step_rewards_norm/mean", "system/state_batch_size/max"} <= set(
        metrics
    )
    # The episode's last turn returns its own reward; an earlier turn adds half of the next one's return.
    columns = batch.non_tensor_batch
    for row in range(len(batch) - 1):
        if columns["traj_id"][row] == columns["traj_id"][row + 1]:
            expected = columns["step_scores"][row] + 0.5 * batch.batch["step_rewards"][row + 1]
            assert batch.batch["step_rewards"][row] == pytest.approx(float(expected))


def _gigpo_file():
    return load_config(require_shared(ROLL_TARGETS / "qwen2.5-0.5B-agentic/agent_val_frozen_lake_gigpo.yaml"))


def test_the_roll_gigpo_file_loads_and_passes_preflight():
    config = AgenticConfig.from_dict(_gigpo_file())
    assert config.base.adv_estimator == "gigpo" and config.mode(config.train_env_manager) == "step"
    assert (config.batch_adjust_mode, config.step_reward_gamma) == ("copy", 0.95)
    assert (config.episode_reward_weight, config.step_reward_weight) == (1.0, 1.0)
    assert config.custom_envs["FrozenLake"].history_length == 5
    report = agentic_preflight(config)
    assert report.train_plans["actor_train"].global_batch_size == 1024
    assert size_divisor(config, role_sections(config.base)) == 1024  # 16 x 8 x 8 ranks; infer 16 x 8
    assert any("adv_estimator: gigpo groups a turn's step return with the turns of its own env group" in note
               and "ROLL keys them by the state alone" in note for note in report.notes)  # fmt: skip


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda raw: (raw["custom_envs"]["FrozenLake"].update(env_manager_cls="x.TrajEnvManager",
                                                                 agent_template="{observation}"),
                      raw.update(val_env_manager=None)),
         "adv_estimator: gigpo needs step samples"),
        (lambda raw: raw["custom_envs"]["SimpleSokoban"].update(env_manager_cls="x.TrajEnvManager",
                                                                   agent_template="{observation}"),
         "val_env_manager.tags mix env managers"),
        (lambda raw: raw["custom_envs"]["FrozenLake"].update(env_manager_cls="a.b.StepConcatEnvManager"),
         "with concat samples it may use {history}, {current_observation}"),
        (lambda raw: raw.update(batch_adjust_mode="pad"), "batch_adjust_mode='pad'"),
        (lambda raw: raw.update(step_reward_gamma=1.5), "step_reward_gamma must be in [0, 1]"),
        (lambda raw: raw["custom_envs"]["FrozenLake"].update(agent_template="{nope}"),
         "with step samples it may use"),
    ],
)  # fmt: skip
def test_bad_step_mode_configs_name_the_key(change, message):
    raw = _gigpo_file()
    change(raw)
    with pytest.raises(WorkerConfigError) as err:
        AgenticConfig.from_dict(raw)
    assert message in str(err.value)


def test_rlvr_refuses_the_step_estimators():
    from apps.rlvr.config import RLVRConfig

    raw = load_config(require_shared(ROLL_EXAMPLES / "docs_examples" / "example_grpo.yaml"))
    raw["adv_estimator"] = "step_reinforce"
    with pytest.raises(WorkerConfigError, match="rewards single turns of agentic episodes"):
        RLVRConfig.from_dict(raw)


# ---------------------------------------------------------------------------------- AgentNativeStepEnvManager
NATIVE = "roll.pipeline.agentic.env_manager.agent_native_env_manager.AgentNativeStepEnvManager"


def test_the_native_sokoban_env_keeps_the_conversation():
    env = make_env("sokoban_native_env", {"dim_room": [5, 5], "search_depth": 6, "max_steps": 3})
    first = env.reset(3)
    assert [m["role"] for m in env.messages] == ["system", "user"]
    assert env.instructions in env.messages[0]["content"] and first in env.messages[1]["content"]
    assert "Decide the next action" in env.messages[1]["content"]  # ROLL's format reminder after every state
    env.step("no action here")
    env.step("<answer>Up</answer>")
    roles = [m["role"] for m in env.messages]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user"]
    assert env.messages[2]["content"] == "no action here"
    assert "the last action is not valid" in env.messages[3]["content"]  # after the invalid one ...
    assert "the last action is not valid" not in env.messages[5]["content"]  # ... not after a valid one


@pytest.fixture(scope="module")
def native_run(tmp_path_factory):
    """Two rounds of native episodes (sokoban_native_env) of the tiny setup, in this process."""
    root = make_setup(tmp_path_factory.mktemp("native"))
    raw = load_config(root / "agentic.yaml", ["max_tokens_per_step=4"])
    raw["custom_envs"]["Native"] = {"env_type": "sokoban_native_env", "env_manager_cls": NATIVE, "max_steps": 3,
                                    "env_config": {"dim_room": [5, 5], "search_depth": 6, "max_steps": 3}}  # fmt: skip
    raw["train_env_manager"].update(tags=["Native"], num_groups_partition=None)
    raw["val_env_manager"] = None
    config = AgenticConfig.from_dict(raw)
    fill_model_paths(config.base)
    worker = RoleWorker("actor_infer", 0, 1, "127.0.0.1", WorkerBase.free_port(), {}, config.base.actor_infer)
    worker.initialize()
    manager = EnvManager(config, config.train_env_manager, "train")
    tokenizer = worker.strategy.tokenizer
    generating = replace(config.base.actor_infer.generating_args, temperature=1.0)
    runner = NativeRunner(manager, tokenizer, generating, 900)
    try:
        episodes = runner.run(InProcessGroup(worker), step=0, rounds=2)
        yield episodes, runner.to_batch(episodes), tokenizer
    finally:
        manager.close()


def test_native_samples_are_the_environments_conversation_turn_by_turn(native_run):
    episodes, batch, tokenizer = native_run
    assert sum(len(e.turns) for e in episodes) == len(batch) and any(len(e.turns) > 1 for e in episodes)
    for episode in episodes:
        for index, turn in enumerate(episode.turns):
            messages = json.loads(turn.observation)  # the conversation the turn's prompt rendered
            assert [m["role"] for m in messages] == ["system", "user"] + ["assistant", "user"] * index
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            assert turn.prompt_ids == list(tokenizer(text, add_special_tokens=False)["input_ids"])
            if index:  # the previous turn's response is in it, as the assistant said it
                assert messages[-2]["content"] == episode.turns[index - 1].response
    assert list(batch.non_tensor_batch["state_hash"]) == [state_key(t.observation) for e in episodes for t in e.turns]


def test_the_roll_native_file_loads_and_passes_preflight():
    raw = load_config(require_shared(ROLL_TARGETS / "qwen2.5-0.5B-agentic/agentic_val_sokoban_native.yaml"))
    raw["num_nodes"] = 3  # its device_mapping spans 24 devices of 8-GPU nodes
    config = AgenticConfig.from_dict(raw)
    assert config.mode(config.train_env_manager) == "native" and config.base.adv_estimator == "step_reinforce"
    norm = config.reward_normalization
    assert (norm.grouping, norm.norm_mean_type, norm.norm_std_type) == ("traj_group_id", "group", "batch")
    report = agentic_preflight(config)
    # 1024 episodes of at least one turn, resized to a multiple of 2048 (1 x 128 x 16 ranks): one optimizer step.
    assert report.train_plans["actor_train"].samples_per_step == 2048


def test_the_native_manager_needs_an_environment_that_keeps_its_conversation():
    raw = _gigpo_file()
    raw["custom_envs"]["FrozenLake"]["env_manager_cls"] = NATIVE
    with pytest.raises(WorkerConfigError, match="needs an environment that keeps its own conversation"):
        AgenticConfig.from_dict(raw)
