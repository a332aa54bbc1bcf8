"""The text-environment contract of the agentic pipeline and the ``env_type`` registry.

An environment is gymnasium-like, with text in and text out: ``reset(seed)`` returns the first observation,
``step(response_text)`` parses the model's action out of its response and returns a :class:`StepResult`. A
response whose action cannot be parsed leaves the state unchanged, costs ``format_penalty`` and still counts
toward ``max_steps`` (ROLL's behaviour).

Add an environment by registering a class that names its config dataclass::

    @ENV_TYPES.register("my_env")
    class MyEnv:
        config_cls = MyConfig           # dataclass; the keys allowed under custom_envs.<tag>.env_config
        def __init__(self, config: MyConfig) -> None: ...
        # reset / step / render / instructions / close as in TextEnv
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from apps.agentic.envs.env_config import EnvConfigError, parse_env_config
from rl_core.registry import Registry

Frame = str | npt.NDArray[np.uint8]
"""A rendered frame: text, or an RGB picture ``[H, W, 3]`` uint8."""


@dataclass(frozen=True)
class StepResult:
    """What one ``step`` returns."""

    observation: str
    """The state after the step, as text (the env's ``render("text")``)."""
    reward: float
    """Reward of this step (``format_penalty`` for an unparsable action)."""
    terminated: bool
    """The task ended: success, or failure such as falling into a hole."""
    truncated: bool
    """``max_steps`` steps were taken without the task ending."""
    info: dict[str, Any] = field(default_factory=dict)
    """At least ``action_is_valid`` (bool), ``success`` (bool) and ``action`` (parsed action name or None)."""


@runtime_checkable
class TextEnv(Protocol):
    """A gymnasium-style environment whose observations and actions are text."""

    def reset(self, seed: int) -> str:
        """Start an episode from ``seed`` (same seed -> same initial state); returns the first observation."""
        ...

    def step(self, action_text: str) -> StepResult:
        """Parse the action out of the model's response and apply it."""
        ...

    def render(self, mode: str = "text") -> Frame:
        """The current state: ``"text"`` (the observation) or ``"rgb_array"`` (``[H, W, 3]`` uint8)."""
        ...

    @property
    def instructions(self) -> str:
        """Game rules, symbols, valid actions and the answer format, for the model's first prompt."""
        ...

    def close(self) -> None:
        """Release resources."""
        ...


class EnvClass(Protocol):
    """What ``ENV_TYPES`` holds: a class (or factory) built from its config dataclass."""

    @property
    def config_cls(self) -> type[Any]:
        """The dataclass whose fields are the valid ``env_config`` keys."""
        ...

    def __call__(self, config: Any) -> TextEnv: ...


ENV_TYPES: Registry[EnvClass] = Registry("environment type", "custom_envs.<tag>.env_type")


def resolve_env_class(env_type: str) -> EnvClass:
    """The class of ``env_type``: a registered one, else one of GEM's own (``family:name``, through gem-llm: see
    :mod:`apps.agentic.envs.gem_env`). Raises ``ValueError`` (``EnvConfigError`` for GEM ids) saying why not."""
    from apps.agentic.envs.gem_env import gem_env_class, is_gem_id

    if env_type not in ENV_TYPES and is_gem_id(env_type):
        return gem_env_class(env_type)
    return ENV_TYPES.get(env_type)


def make_env(env_type: str, env_config: Mapping[str, Any] | None = None) -> TextEnv:
    """A new environment of ``env_type`` (:func:`resolve_env_class`), configured by ``env_config`` (validated: every
    error names ``env_config.<key>``). Raises ``ValueError`` naming the registered types for an unknown ``env_type``."""
    env_class = resolve_env_class(env_type)
    config_cls = getattr(env_class, "config_cls", None)
    if not (isinstance(config_cls, type) and dataclasses.is_dataclass(config_cls)):
        raise TypeError(
            f"environment type {env_type!r} ({env_class!r}) must have a class attribute config_cls naming the "
            "dataclass of its env_config keys"
        )
    return env_class(parse_env_config(config_cls, env_config, env_type))


def invalid_action_result(observation: str, format_penalty: float, truncated: bool) -> StepResult:
    """The result of a response without a valid action: state unchanged, reward ``format_penalty`` (what the
    environment gives such a step: Sokoban adds its step reward), not terminated."""
    info = {"action_is_valid": False, "action_is_effective": False, "success": False, "action": None}
    return StepResult(observation, float(format_penalty), terminated=False, truncated=truncated, info=info)


RENDER_MODES = ("text", "rgb_array")


def check_common_fields(max_steps: int, format_penalty: float, render_mode: str = "text") -> None:
    """Range checks shared by the built-in configs."""
    if render_mode not in RENDER_MODES:
        raise EnvConfigError(f"env_config.render_mode={render_mode!r}: use one of {list(RENDER_MODES)}.")
    if max_steps < 1:
        raise EnvConfigError(f"env_config.max_steps must be >= 1, got {max_steps}.")
    if format_penalty > 0:
        raise EnvConfigError(
            f"env_config.format_penalty must be <= 0 (a penalty for unparsable answers), got {format_penalty}."
        )
