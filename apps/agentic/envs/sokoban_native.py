"""``env_type: sokoban_native_env``: Sokoban that keeps its own chat conversation (ROLL's SokobanNativeEnv), for
ROLL's AgentNativeStepEnvManager (``apps.agentic.step_rollout.NativeRunner``).

The environment, not a template, writes the conversation the model reads (``messages``): a system message (the
``system_template`` and the game's instructions), a user message with the first state, then per turn the model's
response as an assistant message and a user message with the new state. Each state is followed by
``observation_suffix`` (default: ROLL's reminder of the answer format and the valid actions). After a response
without a valid action the next user message starts with ROLL's tip to follow the format; ROLL's own code adds that
tip after a *valid* action (an inverted condition), here it follows the invalid one, as its text says.
Rooms, rewards and actions are those of ``sokoban``; the defaults follow ROLL's native env (dim_room (6, 6),
num_boxes 1, search_depth 300, format_penalty -0.1, max_steps 10).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from apps.agentic.envs.base import ENV_TYPES, StepResult
from apps.agentic.envs.sokoban import SokobanConfig, SokobanEnv
from apps.agentic.envs.sokoban_rooms import MOVES

DEFAULT_SYSTEM_TEMPLATE = (
    "You're a helpful assistant. You are a good game player. You are aiming to get high reward in the game."
)
INVALID_TIP = (
    "\n\n<system-reminder>\n(IMPORTANT TIPS: the last action is not valid, your new response *must* strictly adhere "
    "to the format according system-reminder.)</system-reminder>\n\n"
)


def default_suffix() -> str:
    """ROLL's reminder after every state: the answer format and the valid actions."""
    actions = "\nYour available actions are:\n" + ", ".join(MOVES)
    return (
        "\n\n<system-reminder>\nIMPORTANT: Ensure that your response is the format of '<answer> [your answer] "
        f"</answer>',  with no extra text, eg. <answer>Right</answer>.{actions}\n. </system-reminder>\n\n"
        "Decide the next action:\n"
    )


@dataclass(frozen=True)
class SokobanNativeConfig(SokobanConfig):
    """``env_config`` of ``sokoban_native_env``: the ``sokoban`` keys plus the conversation's texts."""

    dim_room: tuple[int, int] = (6, 6)
    num_boxes: int = 1
    max_steps: int = 10
    search_depth: int = 300
    format_penalty: float = -0.1
    system_template: str | None = None
    """First part of the system message (null: ROLL's game-player line); the instructions follow it."""
    observation_suffix: str | None = None
    """Text after every state (null: ROLL's answer-format reminder)."""


@ENV_TYPES.register("sokoban_native_env")
class SokobanNativeEnv(SokobanEnv):
    """A Sokoban episode and the conversation about it (``messages``)."""

    config_cls: ClassVar[type[SokobanNativeConfig]] = SokobanNativeConfig
    keeps_conversation: ClassVar[bool] = True
    """The env writes the model's conversation (AgentNativeStepEnvManager needs such an env)."""

    def __init__(self, config: SokobanNativeConfig | None = None) -> None:
        self.native = config or SokobanNativeConfig()
        super().__init__(self.native)
        self.messages: list[dict[str, str]] = []

    def reset(self, seed: int) -> str:
        observation = super().reset(seed)
        system = self.native.system_template or DEFAULT_SYSTEM_TEMPLATE
        self.messages = [
            {"role": "system", "content": f"{system}\n\n{self.instructions}"},
            {"role": "user", "content": f"Here is the current state:\n{observation}\n\n{self._suffix}"},
        ]
        return observation

    def step(self, action_text: str) -> StepResult:
        result = super().step(action_text)
        user = f"Current state:\n{result.observation}\n\n{self._suffix}"
        if not result.info.get("action_is_valid", False):
            user = INVALID_TIP + user
        self.messages += [{"role": "assistant", "content": action_text}, {"role": "user", "content": user}]
        return result

    @property
    def _suffix(self) -> str:
        return self.native.observation_suffix if self.native.observation_suffix is not None else default_suffix()
