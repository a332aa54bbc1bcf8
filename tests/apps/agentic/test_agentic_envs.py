"""The env contract: ENV_TYPES registration of a user's environment, make_env's errors (env_type, env_config keys
and types), action parsing (case, spaces, numbers, the think pattern, garbage)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest

from apps.agentic.envs import (
    ANSWER_PATTERN,
    ENV_TYPES,
    THINK_ANSWER_PATTERN,
    ActionParser,
    EnvConfigError,
    FrozenLakeEnv,
    SokobanEnv,
    StepResult,
    TextEnv,
    make_env,
)

SOKOBAN_ACTIONS = ("Up", "Down", "Left", "Right")


@dataclass(frozen=True)
class CounterConfig:
    target: int = 3
    """Count to this."""
    label: str | None = None


class CounterEnv:
    """A user environment: answer Inc until the counter reaches ``target``."""

    config_cls: ClassVar[type[CounterConfig]] = CounterConfig

    def __init__(self, config: CounterConfig) -> None:
        self.config, self.count = config, 0
        self.parser = ActionParser.build(ANSWER_PATTERN, ["Inc"])

    def reset(self, seed: int) -> str:
        self.count = seed % 2
        return str(self.count)

    def step(self, action_text: str) -> StepResult:
        valid = self.parser.parse(action_text) is not None
        self.count += int(valid)
        done = self.count >= self.config.target
        info = {"action_is_valid": valid, "success": done, "action": "Inc" if valid else None}
        return StepResult(str(self.count), float(done), done, False, info)

    def render(self, mode: str = "text") -> str:
        return str(self.count)

    @property
    def instructions(self) -> str:
        return "Answer <answer>Inc</answer>."

    def close(self) -> None:
        pass


class NoConfigEnv:
    def __init__(self, config: object) -> None:
        self.config = config


@pytest.fixture(autouse=True)
def user_envs():
    """Register the test environments the way a user would, and take them out again afterwards."""
    ENV_TYPES.register("test_counter")(CounterEnv)
    ENV_TYPES.register("test_no_config")(NoConfigEnv)  # type: ignore[arg-type]
    yield
    for name in ("test_counter", "test_no_config"):
        del ENV_TYPES._items[name], ENV_TYPES._canonical[name]


def test_registered_user_env_is_built_with_its_config():
    env = make_env("test_counter", {"target": 2, "label": "x"})
    assert isinstance(env, CounterEnv) and isinstance(env, TextEnv)
    assert env.config == CounterConfig(target=2, label="x")
    assert env.reset(4) == "0"
    assert not env.step("<answer>inc</answer>").terminated
    assert env.step("<answer>Inc</answer>").terminated


def test_builtin_types_are_registered_and_satisfy_the_protocol():
    assert {"sokoban", "frozen_lake"} <= set(ENV_TYPES.names())
    assert isinstance(make_env("sokoban"), SokobanEnv) and isinstance(make_env("frozen_lake", {}), FrozenLakeEnv)
    assert isinstance(make_env("sokoban"), TextEnv)


def test_registering_a_name_twice_raises():
    with pytest.raises(ValueError, match="registered twice"):
        ENV_TYPES.register("sokoban")(CounterEnv)


def test_unknown_env_type_lists_the_registered_ones():
    with pytest.raises(ValueError, match="unknown environment type 'sokobam'") as err:
        make_env("sokobam", {})
    assert "frozen_lake" in str(err.value) and "sokoban" in str(err.value)


def test_env_class_without_config_cls_is_refused():
    with pytest.raises(TypeError, match="config_cls"):
        make_env("test_no_config", {})


def test_unknown_env_config_key_is_named_with_the_valid_keys():
    with pytest.raises(EnvConfigError, match=r"env_config\.dim_rom ") as err:
        make_env("sokoban", {"dim_rom": [6, 6]})
    assert "dim_room" in str(err.value) and "'sokoban'" in str(err.value)


@pytest.mark.parametrize(
    ("env_type", "env_config", "message"),
    [
        ("sokoban", {"num_boxes": "2"}, r"env_config\.num_boxes must be int, got str"),
        ("sokoban", {"num_boxes": True}, r"env_config\.num_boxes must be int, got bool"),
        ("sokoban", {"dim_room": [6]}, r"env_config\.dim_room must have 2 entries"),
        ("sokoban", {"dim_room": [6, "6"]}, r"env_config\.dim_room\[1\] must be int"),
        ("sokoban", {"grid_vocab": ["wall"]}, r"env_config\.grid_vocab must be dict\[str, str\] \| None"),
        ("frozen_lake", {"p": "high"}, r"env_config\.p must be float"),
        ("frozen_lake", {"map_name": 4}, r"env_config\.map_name must be str \| None"),
        ("test_counter", {"target": 2.5}, r"env_config\.target must be int"),
    ],
)
def test_wrong_types_name_the_key_and_the_expected_type(env_type, env_config, message):
    with pytest.raises(EnvConfigError, match=message):
        make_env(env_type, env_config)


def test_yaml_values_are_converted():
    env = make_env("sokoban", {"dim_room": [7, 8], "format_penalty": -1, "grid_lookup": None})
    assert isinstance(env, SokobanEnv)
    assert env.config.dim_room == (7, 8) and env.config.format_penalty == -1.0
    assert isinstance(env.config.format_penalty, float)


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("<answer>Up</answer>", "Up"),
        ("<answer>up</answer>", "Up"),
        ("I think so. <answer> RIGHT </answer>", "Right"),
        ("<answer>\nleft\n</answer>", "Left"),
        ("<answer>2</answer>", "Down"),
        ("<answer>4</answer>", "Right"),
        ("<answer>0</answer>", None),
        ("<answer>5</answer>", None),
        ("<answer>Upward</answer>", None),
        ("<answer>Up, Left</answer>", None),
        ("Up", None),
        ("<answer>Up", None),
        ("", None),
        ("<think>go Left</think><answer>Down</answer>", "Down"),
        ("<answer>Up</answer> then <answer>Left</answer>", "Up"),
    ],
)
def test_default_pattern(response, expected):
    assert ActionParser.build(ANSWER_PATTERN, SOKOBAN_ACTIONS).parse(response) == expected


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("<think>the box is left\nso I go Left</think>\n<answer>Left</answer>", "Left"),
        ("<think>Up? no.</think> <answer>down</answer>", "Down"),
        ("<answer>Down</answer>", None),
        ("<think>Up</think>", None),
    ],
)
def test_think_pattern_takes_the_last_group(response, expected):
    assert ActionParser.build(THINK_ANSWER_PATTERN, SOKOBAN_ACTIONS).parse(response) == expected


def test_think_pattern_from_env_config_and_instructions():
    env = make_env("frozen_lake", {"action_pattern": THINK_ANSWER_PATTERN, "map_name": "4x4"})
    assert "<think>" in env.instructions
    env.reset(0)
    assert env.step("<answer>Down</answer>").info["action_is_valid"] is False
    result = env.step("<think>down is safe</think><answer>Down</answer>")
    assert result.info["action"] == "Down" and result.info["action_is_valid"]


@pytest.mark.parametrize("pattern", ["<answer>(.*?</answer>", "<answer>.*?</answer>"])
def test_unusable_action_pattern_names_the_key(pattern):
    with pytest.raises(EnvConfigError, match=r"env_config\.action_pattern"):
        make_env("sokoban", {"action_pattern": pattern})
