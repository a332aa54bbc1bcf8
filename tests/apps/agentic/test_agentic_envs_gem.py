"""GEM's own environments through gem-llm (``env_type: game:GuessTheNumber-v0``, ``rg:<dataset>``): the adapter's
text, validity, success and suffix, its generators of its own, env_config checks, the refusals, ROLL's seed of a
reasoning-gym environment, and episodes of the trajectory and StepConcatEnvManager layouts, without Ray."""

from __future__ import annotations

import importlib.util
import random
import threading
from dataclasses import replace

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from apps.agentic.config import AgenticConfig
from apps.agentic.env_manager import EnvManager
from apps.agentic.envs import EnvConfigError, make_env
from apps.agentic.rollout import TrajectoryRunner, Turn
from apps.agentic.step_rollout import ConcatRunner, concat_user_message, state_key
from apps.common.preflight import fill_model_paths
from apps.common.yaml_config import load_config
from rl_core.batch import RolloutBatch
from rl_engines.config import WorkerConfigError
from rl_engines.tiny_model import build_tiny_causal_lm, build_tiny_tokenizer

if importlib.util.find_spec("gem") is None:  # not importorskip: importing gem first would put matplotlib's caches in ~
    pytest.skip("gem-llm is not installed (requirements-dev.txt pins it)", allow_module_level=True)

GUESS = "game:GuessTheNumber-v0"
SMALL = {"min_number": 1, "max_number": 20, "max_turns": 3}
CONCAT = "roll.pipeline.agentic.env_manager.step_concat_env_manager.StepConcatEnvManager"
CONFIG = """\
exp_name: tiny_gem
track_with: stdout
seed: 3
output_dir: {out}
num_gpus_per_node: 1
max_steps: 1
rollout_batch_size: 4
val_batch_size: 2
sequence_length: 1500
max_tokens_per_step: 6
adv_estimator: grpo
pretrain: {model}
actor_train:
  device_mapping: [0]
  training_args: {{per_device_train_batch_size: 2, gradient_accumulation_steps: 2}}
actor_infer:
  device_mapping: [0]
  strategy_args: {{strategy_name: hf_infer}}
  generating_args: {{max_new_tokens: 6, num_return_sequences: 1}}
train_env_manager: {{num_env_groups: 2, group_size: 2, tags: [Guess]}}
val_env_manager: {{num_env_groups: 2, group_size: 1, tags: [Guess]}}
custom_envs:
  Guess:
    env_type: {env_type}
    max_steps: 3
    agent_system_template: null
    agent_template: "{{observation}}\\n{{suffix}}"
    env_config: {{min_number: 1, max_number: 20, max_turns: 3}}
"""


def test_a_guess_is_read_from_the_response_and_the_game_ends_on_the_number():
    env = make_env(GUESS, SMALL)
    first = env.reset(11)
    assert first.startswith("You are playing Guess The Number.") and "between 1 and 20" in first
    assert env.suffix == "Enter your next guess." and env.instructions == ""  # the rules are the first observation
    target = env.env.game_number
    wrong = 1 if target != 1 else 2
    step = env.step(f"I think \\boxed{{{wrong}}}")
    assert not step.terminated and step.reward == 0.0 and step.info["action_is_valid"] and not step.info["success"]
    assert step.observation.startswith("At turn 1, you guessed")
    assert step.info["action"] == f"I think \\boxed{{{wrong}}}"  # GEM parses the action out of the response
    won = env.step(f"\\boxed{{{target}}}")
    assert won.terminated and won.reward == 1.0 and won.info["success"]
    env.reset(11)
    invalid = env.step("no number here")  # GEM's format error: -0.1, the episode ends
    assert invalid.terminated and invalid.reward == -0.1
    assert not invalid.info["action_is_valid"] and invalid.info["action"] is None and not invalid.info["success"]


def test_each_environment_draws_from_generators_of_its_own():
    """GEM's games draw from Python's global generator; episodes must not depend on other environments or threads."""
    alone = make_env(GUESS, SMALL)
    alone.reset(5)
    expected = alone.env.game_number
    random.seed(123)
    np.random.seed(456)  # noqa: NPY002  # GEM's games draw from the legacy global generators
    envs = [make_env(GUESS, SMALL) for _ in range(8)]
    barrier = threading.Barrier(len(envs))

    def play(env, seed):  # every environment resets and steps at once, on its own thread
        barrier.wait()
        env.reset(seed)
        env.step("\\boxed{3}")

    threads = [threading.Thread(target=play, args=(env, 5 if i % 2 else 100 + i)) for i, env in enumerate(envs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert random.random() == random.Random(123).random()  # the process's generators untouched
    assert np.random.random() == np.random.RandomState(456).random_sample()  # noqa: NPY002
    assert all(env.env.game_number == expected for env in envs[1::2])


def test_env_config_keys_are_the_environment_classes_arguments():
    env = make_env(GUESS)  # the registered defaults of game:GuessTheNumber-v0
    env.reset(0)
    assert (env.env.min_number, env.env.max_number, env.env.max_turns) == (1, 20, 10)
    with pytest.raises(EnvConfigError, match=r"env_config\.max_numbr is not a setting .*'max_number'"):
        make_env(GUESS, {"max_numbr": 30})


@pytest.mark.parametrize(
    ("env_type", "message"),
    [
        ("game:Wordle-v0", r"NLTK's words corpus.*no internet"),
        ("qa:HotpotQA", r"HuggingFace Hub dataset 'axon-rl/HotpotQA'.*roll_math"),
        ("math:GSM8K", r"HuggingFace Hub dataset"),
        ("game:Nope-v0", r"not an environment of gem-llm==0\.0\.4"),
    ],
)
def test_gem_environments_that_cannot_run_here_are_refused_naming_why(env_type, message):
    with pytest.raises(EnvConfigError, match=message):
        make_env(env_type, {})


def test_a_reasoning_gym_environment_gets_its_groups_seed(tmp_path):
    """ROLL replaces an env_config seed by the env group's: the two environments of a group build one question set,
    the groups different ones; the same run builds the same ones again."""
    overrides = ["custom_envs.Guess.env_type=rg:leg_counting", "custom_envs.Guess.env_config={size: 20, seed: 42}"]
    config = _config(tmp_path, GUESS, overrides)
    seeds = [[slot.env.env.seed for slot in EnvManager(config, config.train_env_manager, "train").slots]
             for _ in range(2)]  # fmt: skip
    assert seeds[0] == seeds[1]
    assert seeds[0][0] == seeds[0][1] != seeds[0][2] == seeds[0][3] and 42 not in seeds[0]
    question = EnvManager(config, config.train_env_manager, "train").slots[0].env.reset(7)
    assert "legs" in question


def test_a_gem_environment_that_cannot_run_is_refused_at_config_time_naming_the_key(tmp_path):
    with pytest.raises(WorkerConfigError, match=r"custom_envs\.Guess\.env_type 'game:Hangman-v0' needs NLTK"):
        _config(tmp_path, "game:Hangman-v0")


def test_the_concat_prompt_shows_earlier_observations_and_the_current_one_with_its_suffix():
    spec = _config_spec(history_length=3, agent_template="H:\n{history}\nNow:\n{current_observation}")
    turns = [Turn([], [], [], 0.0, f"obs{i}", f"resp{i}", None) for i in range(3)]
    # ROLL: history[-3:-1], the observations of the last two turns (not their responses)
    assert concat_user_message(spec, turns, "cur", "Next?") == "H:\nobs1\nobs2\nNow:\ncur\nNext?"
    assert concat_user_message(replace(spec, history_length=None), turns, "cur", "") == "H:\n\nNow:\ncur\n"


class ScriptedGuesses:
    """actor_infer's one call (world size 1) answering every context with the next guess ``\\boxed{n}``, n = 1, 2, ...
    per call: the tiny random model never writes a parsable guess, and GEM ends an episode at the first unparsable
    one; these tests are about the prompts and samples the runners build around GEM's environments."""

    world_size = 1

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.calls = tokenizer, 0

    def call(self, method: str, batch: RolloutBatch, args, dispatch: str) -> RolloutBatch:
        assert method == "generate" and dispatch == "dp_split"
        self.calls += 1
        ids = self.tokenizer(f"\\boxed{{{self.calls}}}", add_special_tokens=False)["input_ids"]
        rows = len(batch)
        return RolloutBatch.from_dict({
            "responses": torch.tensor([ids] * rows), "response_mask": torch.ones(rows, len(ids), dtype=torch.long),
            "rollout_log_probs": torch.zeros(rows, len(ids)),
        })  # fmt: skip


@pytest.fixture(scope="module")
def gem_runs(tmp_path_factory):
    """One round of GuessTheNumber episodes in each layout (trajectory; StepConcatEnvManager), in this process."""
    root = tmp_path_factory.mktemp("gem")
    concat = [f"+custom_envs.Guess.env_manager_cls={CONCAT}", "+custom_envs.Guess.history_length=2",
              'custom_envs.Guess.agent_template="Before:\\n{history}\\nNow:\\n{current_observation}"']  # fmt: skip
    configs = {"trajectory": _config(root, GUESS), "concat": _config(root, GUESS, concat)}
    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    runs = {}
    for layout, config in configs.items():
        manager = EnvManager(config, config.train_env_manager, "train")
        runner_cls = ConcatRunner if layout == "concat" else TrajectoryRunner
        runner = runner_cls(manager, tokenizer, config.base.actor_infer.generating_args, config.sequence_length)
        try:
            episodes = runner.run(ScriptedGuesses(tokenizer), step=0)
            runs[layout] = (episodes, runner.to_batch(episodes))
        finally:
            manager.close()
    return runs, tokenizer


def test_trajectory_episodes_show_gems_rules_and_suffix(gem_runs):
    runs, tokenizer = gem_runs
    episodes, batch = runs["trajectory"]
    assert len(batch) == len(episodes) == 4
    for episode in episodes:
        prompt = tokenizer.decode(episode.prompt_ids, skip_special_tokens=True)
        assert "You are playing Guess The Number." in prompt and "Enter your next guess." in prompt
        assert "system" not in prompt.split("You are playing")[0].lower()  # agent_system_template: null
        number = episode.slot.env.env.game_number  # guesses 1, 2, 3: found on turn `number`, else 3 turns
        assert episode.done and len(episode.rewards) == min(number, 3) and episode.success == (number <= 3)
        text = tokenizer.decode(episode.tokens, skip_special_tokens=True)
        if number > 1:  # the next user turn: GEM's observation and its suffix ({observation}\n{suffix})
            assert "At turn 1, you guessed 1, and the target number is higher than 1.\nEnter your next guess." in text
    assert {e.success for e in episodes} == {True, False}  # seed 3: one group's number is found, the other's is not


def test_concat_step_samples_prompt_each_turn_with_the_observations_before_it(gem_runs):
    runs, tokenizer = gem_runs
    episodes, batch = runs["concat"]
    assert len(batch) == sum(len(e.turns) for e in episodes) and any(len(e.turns) > 1 for e in episodes)
    for episode in episodes:
        for index, turn in enumerate(episode.turns):
            prompt = tokenizer.decode(turn.prompt_ids, skip_special_tokens=True)
            assert f"Now:\n{turn.observation}\nEnter your next guess." in prompt
            if index:  # history_length 2: the observation one turn back, not two
                assert f"Before:\n{episode.turns[index - 1].observation}\nNow:" in prompt
            else:
                assert "Before:\n\nNow:" in prompt
    assert list(batch.non_tensor_batch["state_hash"][:1]) == [state_key(episodes[0].turns[0].observation)]


def _config(root, env_type: str, overrides: list[str] | None = None) -> AgenticConfig:
    model = root / "model"
    if not (model / "config.json").exists():
        corpus = [make_env(GUESS, SMALL).reset(seed) for seed in range(3)]
        corpus += ["\\boxed{7} Enter your next guess. At turn 1, you guessed 7, and the target number is lower than"]
        build_tiny_tokenizer(model, corpus, vocab_size=500)
        build_tiny_causal_lm(model, vocab_size=503, max_position_embeddings=2048)
    path = root / f"gem_{len(list(root.glob('gem_*.yaml')))}.yaml"
    path.write_text(CONFIG.format(out=root / "out", model=model, env_type=env_type))
    config = AgenticConfig.from_dict(load_config(path, overrides or []))
    fill_model_paths(config.base)
    return config


def _config_spec(**changes):
    from apps.agentic.env_sections import EnvSpec

    return replace(EnvSpec(env_type=GUESS), **changes)
