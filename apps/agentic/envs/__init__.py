"""Text environments of the agentic pipeline, chosen by ``custom_envs.<tag>.env_type``.

Built in: ``sokoban``, ``frozen_lake``, ``roll_math`` / ``roll_qa`` (a math / QA question per episode) and
``sokoban_native_env`` (Sokoban keeping its own conversation, for AgentNativeStepEnvManager); GEM's own
``family:name`` ids (games, reasoning-gym) through the gem-llm package (:mod:`apps.agentic.envs.gem_env`, resolved by
``resolve_env_class``).
Add your own with ``@ENV_TYPES.register("my_env")`` on a class that has ``config_cls`` (the dataclass of its
``env_config`` keys) and implements :class:`TextEnv`; ``make_env`` builds any registered type from its ``env_config``
mapping.
"""

from apps.agentic.envs.actions import ANSWER_PATTERN, THINK_ANSWER_PATTERN, ActionParser
from apps.agentic.envs.base import ENV_TYPES, EnvClass, Frame, StepResult, TextEnv, make_env, resolve_env_class
from apps.agentic.envs.env_config import EnvConfigError, parse_env_config
from apps.agentic.envs.frozen_lake import FrozenLakeConfig, FrozenLakeEnv
from apps.agentic.envs.math_env import MathEnv, MathEnvConfig
from apps.agentic.envs.qa_env import QaEnv, QaEnvConfig
from apps.agentic.envs.sokoban import SokobanConfig, SokobanEnv
from apps.agentic.envs.sokoban_native import SokobanNativeConfig, SokobanNativeEnv
from apps.agentic.envs.sokoban_rooms import Room, generate_room, solve

__all__ = [
    "ANSWER_PATTERN",
    "ENV_TYPES",
    "THINK_ANSWER_PATTERN",
    "ActionParser",
    "EnvClass",
    "EnvConfigError",
    "Frame",
    "FrozenLakeConfig",
    "FrozenLakeEnv",
    "MathEnv",
    "MathEnvConfig",
    "QaEnv",
    "QaEnvConfig",
    "Room",
    "SokobanConfig",
    "SokobanEnv",
    "SokobanNativeConfig",
    "SokobanNativeEnv",
    "StepResult",
    "TextEnv",
    "generate_room",
    "make_env",
    "parse_env_config",
    "resolve_env_class",
    "solve",
]
