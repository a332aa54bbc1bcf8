"""Tool use around an environment (ROLL's ``custom_envs.<tag>.tool_wrapper``, GEM's ToolEnvWrapper): the python_code
tool finds and runs a response's code in the sandbox with ROLL's observations, the wrapper counts calls, pays the
tool rewards and hands other responses to the environment, and an episode of ROLL's dapo_17k_with_python_code tag
(roll-targets' GEM math envs) shows the tool's result as a ``tool`` message between the turns."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
from agentic_fixtures import make_setup
from transformers import AutoTokenizer

from apps.agentic.config import AgenticConfig
from apps.agentic.env_manager import EnvManager
from apps.agentic.envs import StepResult
from apps.agentic.envs.tools import (
    BLOCKED,
    MAX_USES_NOTE,
    ROLL_PYTHON_INSTRUCTION,
    PythonCodeArgs,
    PythonCodeTool,
    ToolEnv,
    parse_tool_wrapper,
)
from apps.agentic.rollout import TrajectoryRunner, episode_metrics
from apps.common.sandbox import missing_isolation
from apps.common.yaml_config import load_config
from rl_core.batch import RolloutBatch
from rl_engines.config import WorkerConfigError
from tests.shared_dir import require_shared, roll_target_files

needs_sandbox = pytest.mark.skipif(bool(missing_isolation()), reason=f"no sandbox here: {missing_isolation()}")
PYTHON = {"tool_id": "python_code", "tool_args": {"timeout": 5, "sandbox_type": "none"}}
WRAPPER = {"wrapper_args": {"tool_reward": 0.1, "tool_success_reward": 0.5, "max_tool_uses": 2},
           "tool_configs": [PYTHON]}  # fmt: skip


@pytest.fixture(scope="module")
def tool():
    tool = PythonCodeTool(PythonCodeArgs())
    yield tool
    tool.close()


def test_the_call_is_the_first_code_block_of_either_form_ending_earliest(tool):
    assert tool.parse("think <code>print(1)</code> then ```python\nprint(2)```") == "print(1)"
    assert tool.parse("```python\nprint(2)``` and <code>print(1)</code>") == "print(2)"
    assert tool.parse("```\npython print(3)```") == "print(3)"  # ROLL's pattern: ``` then optional newline, python
    assert tool.parse("no code, \\boxed{4}") is None
    custom = PythonCodeTool(PythonCodeArgs(patterns=[r"<py>(.*?)</py>"], tool_instruction="Use <py>."))
    assert custom.parse("<code>x</code><py>print(5)</py>") == "print(5)" and custom.instructions == "Use <py>."
    assert tool.instructions == ROLL_PYTHON_INSTRUCTION
    custom.close()


@needs_sandbox
def test_programs_run_in_the_sandbox_with_rolls_observations(tool):
    ok = tool.call("<code>print(6 * 7)</code>")
    # ROLL's words: the prefix, the output (its own newline) and one more newline
    assert (ok.parsed, ok.error, ok.observation) == (True, False, "Code execution result: 42\n\n")
    fixed = tool.call("<code>print(sqrt(16), Counter('aab')['a'])</code>")  # run again with the common imports
    assert (fixed.error, fixed.observation) == (False, "Code execution result: 4.0 2\n\n")
    failed = tool.call("<code>print(1 / 0)</code>")
    assert failed.parsed and failed.error and "ZeroDivisionError: division by zero" in failed.observation
    assert failed.observation.startswith("Code execution result: Traceback")
    silent = tool.call("<code>x = 1</code>")
    assert silent.error and silent.observation == "Code execution result: \n"  # ran, printed nothing: an error
    blocked = tool.call("<code>import subprocess</code>")  # sandbox_type none: GEM's refusal and its words
    assert blocked.error and blocked.observation == f"Code execution result: {BLOCKED}\n"
    last = PythonCodeTool(PythonCodeArgs(keep_error_last_line=True, timeout=1))
    assert last.call("<code>1 / 0</code>").observation == "Code execution result: ZeroDivisionError: division by zero\n"
    slow = last.call("<code>while True: pass</code>")
    assert slow.error and slow.observation == "Code execution result: Execution timed out after 1 seconds.\n"
    last.close()


@dataclass
class Answers:
    """A one-question environment: a ``\\boxed{42}`` answer ends it with reward 1, any other response with 0."""

    closed: bool = False
    instructions: str = "Answer in \\boxed{}."

    def reset(self, seed: int) -> str:
        return "What is 6 x 7?"

    def step(self, action_text: str) -> StepResult:
        right = "\\boxed{42}" in action_text
        return StepResult("done", float(right), True, False, {"action_is_valid": True, "success": right})

    def render(self, mode: str = "text") -> str:
        return "done"

    def close(self) -> None:
        self.closed = True


@needs_sandbox
def test_the_wrapper_counts_calls_pays_tool_rewards_and_hands_answers_to_the_environment():
    inner = Answers()
    env = ToolEnv(inner, parse_tool_wrapper(WRAPPER, "custom_envs.t.tool_wrapper"))
    assert env.reset(0) == f"What is 6 x 7?\n{ROLL_PYTHON_INSTRUCTION}"
    first = env.step("<code>print(6 * 7)</code>")
    assert (first.observation, first.reward, first.terminated) == ("Code execution result: 42\n\n", 0.6, False)
    assert first.info == {"action_is_valid": True, "success": False, "action": "python_code", "use_tool": True,
                          "tool_use_counter": 1, "tool_success_counter": 1}  # fmt: skip
    second = env.step("<code>print(1 / 0)</code>")  # the second and last call: an error, the note
    assert second.reward == pytest.approx(0.1) and second.observation.endswith(MAX_USES_NOTE)
    third = env.step("<code>print(1)</code> \\boxed{42}")  # past max_tool_uses: the environment's
    assert (third.reward, third.terminated, third.info["success"]) == (1.0, True, True)
    assert third.info["use_tool"] and (third.info["tool_use_counter"], third.info["tool_success_counter"]) == (2, 1)
    env.reset(1)  # a new episode counts from 0
    assert env.step("\\boxed{41}").info["tool_use_counter"] == 0
    env.close()
    assert inner.closed


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({**WRAPPER, "wrapper": {}}, r"unknown key\(s\) \['custom_envs\.t\.tool_wrapper\.wrapper'\]"),
        ({"tool_configs": []}, r"custom_envs\.t\.tool_wrapper\.tool_configs must list the tools"),
        ({"tool_configs": [{"tool_id": "search"}]}, r"tool_configs\[0\]\.tool_id='search': ROLL's search tool calls"),
        ({"tool_configs": [{"tool_id": "shell"}]}, r"tool_configs\[0\]\.tool_id='shell' is not a tool"),
        ({"tool_configs": [{"tool_id": "python_code", "tool_args": {"timeout": 0}}]},
         r"tool_configs\[0\]\.tool_args\.timeout=0\.0: give the seconds"),
        ({"tool_configs": [{"tool_id": "python_code", "tool_args": {"sandbox": "none"}}]},
         r"unknown key\(s\) \['custom_envs\.t\.tool_wrapper\.tool_configs\[0\]\.tool_args\.sandbox'\]"),
        ({"wrapper_args": {"max_tool_uses": -1}, "tool_configs": [{"tool_id": "python_code"}]},
         r"wrapper_args\.max_tool_uses=-1"),
    ],
)  # fmt: skip
def test_bad_tool_wrappers_name_the_key(section, message):
    with pytest.raises(WorkerConfigError, match=message):
        parse_tool_wrapper(section, "custom_envs.t.tool_wrapper")


class ScriptedTurns:
    """actor_infer's one call (world size 1): turn 1 writes code, turn 2 the boxed answer; the tiny random model
    never writes either. Records each context it was given."""

    world_size = 1

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.contexts = tokenizer, []

    def call(self, method: str, batch: RolloutBatch, args, dispatch: str) -> RolloutBatch:
        self.contexts.append(
            self.tokenizer.decode(batch.batch["input_ids"][0][batch.batch["attention_mask"][0].bool()])
        )
        text = "<code>print(41 + 1)</code>" if len(self.contexts) == 1 else "\\boxed{42}"
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        rows = len(batch)
        return RolloutBatch.from_dict({
            "responses": torch.tensor([ids] * rows), "response_mask": torch.ones(rows, len(ids), dtype=torch.long),
            "rollout_log_probs": torch.zeros(rows, len(ids)),
        })  # fmt: skip


@needs_sandbox
def test_an_episode_of_rolls_python_code_math_tag_gets_the_result_as_a_tool_message(tmp_path):
    raw = load_config(require_shared(roll_target_files("qwen3_agentic_gem/gem_math_dapo.yaml")[0]))
    root = make_setup(tmp_path)
    (tmp_path / "math.jsonl").write_text(json.dumps({"prompt": "What is 41 + 1?", "solution": "42"}) + "\n")
    tag = "dapo_17k_with_python_code"
    spec = raw["custom_envs"][tag]
    spec["env_config"]["dataset_name"] = str(tmp_path / "math.jsonl")
    raw.update(pretrain=str(root / "model"), num_gpus_per_node=1, rollout_batch_size=1, sequence_length=2000,
               max_tokens_per_step=64, output_dir=str(tmp_path / "out"), val_env_manager=None)  # fmt: skip
    raw["train_env_manager"].update(tags=[tag], num_env_groups=1, group_size=1, num_groups_partition=[1])
    for role in ("actor_train", "actor_infer", "reference"):
        raw[role]["device_mapping"] = [0]
    raw["actor_train"]["training_args"].update(per_device_train_batch_size=1, gradient_accumulation_steps=1)
    config = AgenticConfig.from_dict(raw)
    assert config.custom_envs[tag].tool_wrapper["wrapper_args"]["max_tool_uses"] == 1
    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    manager = EnvManager(config, config.train_env_manager, "train")
    runner = TrajectoryRunner(manager, tokenizer, config.base.actor_infer.generating_args, config.sequence_length)
    infer = ScriptedTurns(tokenizer)
    try:
        (episode,) = runner.run(infer, step=0)
        batch = runner.to_batch([episode])
    finally:
        manager.close()
    assert ROLL_PYTHON_INSTRUCTION in infer.contexts[0]
    # the tool's result reaches the second turn as a tool message (the template's tool role), not the agent template;
    # the file allows one call (max_tool_uses: 1), so GEM's note follows it
    result = f"Code execution result: 42\n\n{MAX_USES_NOTE}"
    expected = tokenizer.apply_chat_template([{"role": "tool", "content": result}],
                                             tokenize=False, add_generation_prompt=True)  # fmt: skip
    assert infer.contexts[1].endswith(expected.replace(tokenizer.bos_token or "\0", ""))
    assert episode.rewards == [0.0, 1.0] and episode.success and episode.tool_counts == (1, 1)
    metrics = episode_metrics(batch, "env")
    assert metrics[f"env/{tag}/tool_use_counter"] == 1.0 and metrics[f"env/{tag}/tool_success_counter"] == 1.0


def test_tool_wrappers_are_refused_where_tool_turns_are_not_built():
    raw = load_config(require_shared(roll_target_files("qwen3_agentic_gem/gem_math_dapo.yaml")[0]))
    tag = "dapo_17k_with_python_code"
    raw["train_env_manager"]["tags"] = [tag]
    raw["custom_envs"][tag]["env_manager_cls"] = "roll.pipeline.agentic.env_manager.step_env_manager.StepEnvManager"
    with pytest.raises(WorkerConfigError, match=rf"custom_envs\.{tag}\.tool_wrapper: tool calls are built for Traj"):
        AgenticConfig.from_dict(raw)
