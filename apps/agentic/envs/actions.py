"""Reading the action out of a model response (ROLL's ``action_pattern``).

The pattern is searched with ``re.DOTALL``; its LAST group is the answer (so the think variant
``<think>(.*?)</think>\\s*<answer>(.*?)</answer>`` yields the answer, not the thoughts). The stripped answer must
name one of the environment's actions, case-insensitively (``" UP "`` -> ``Up``), or give its number (actions are
numbered from 1 in the order the environment lists them).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from apps.agentic.envs.env_config import EnvConfigError

ANSWER_PATTERN = r"<answer>(.*?)</answer>"
"""ROLL's default ``action_pattern``."""
THINK_ANSWER_PATTERN = r"<think>(.*?)</think>\s*<answer>(.*?)</answer>"
"""ROLL's ``think_action_pattern``: reasoning first, then the answer."""


@dataclass(frozen=True)
class ActionParser:
    """Maps a response to one of ``actions`` (or None)."""

    pattern: re.Pattern[str]
    """Compiled ``action_pattern``; its last group holds the answer."""
    actions: tuple[str, ...]
    """Action names; number ``i`` (1-based) means ``actions[i - 1]``."""

    @classmethod
    def build(cls, action_pattern: str, actions: Sequence[str]) -> ActionParser:
        """Compile ``action_pattern``; raises naming ``env_config.action_pattern`` when it is unusable."""
        try:
            pattern = re.compile(action_pattern, re.DOTALL)
        except re.error as err:
            raise EnvConfigError(
                f"env_config.action_pattern={action_pattern!r} is not a valid regular expression ({err})."
            ) from None
        if pattern.groups < 1:
            raise EnvConfigError(
                f"env_config.action_pattern={action_pattern!r} has no group; put the answer in one, "
                f"e.g. {ANSWER_PATTERN!r}."
            )
        return cls(pattern, tuple(actions))

    def parse(self, response: str) -> str | None:
        """The action named in ``response``, or None when the pattern does not match or names no action."""
        match = self.pattern.search(response)
        if match is None or match.group(self.pattern.groups) is None:
            return None
        answer = match.group(self.pattern.groups).strip()
        by_name = {name.casefold(): name for name in self.actions}
        if answer.casefold() in by_name:
            return by_name[answer.casefold()]
        if answer.isdecimal() and 1 <= int(answer) <= len(self.actions):
            return self.actions[int(answer) - 1]
        return None

    def describe_actions(self) -> str:
        """``Up (1), Down (2), ...`` for instructions."""
        return ", ".join(f"{name} ({number})" for number, name in enumerate(self.actions, start=1))

    def describe_format(self) -> str:
        """One sentence telling the model how to write its answer under this pattern."""
        source = self.pattern.pattern
        if "<think>" in source and "<answer>" in source:
            return (
                "First reason inside <think> </think>, then give exactly one action inside <answer> </answer>, "
                f"e.g. <think>...</think><answer>{self.actions[0]}</answer>."
            )
        if "<answer>" in source:
            return f"Give exactly one action inside <answer> </answer>, e.g. <answer>{self.actions[0]}</answer>."
        return f"Your response must match the regular expression {source!r}; its last group is the action."
