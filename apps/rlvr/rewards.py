"""Verifiable rewards: one registry of reward functions, chosen per ``rewards.<name>`` section, routed by tag.

A reward function maps ``(response_text, record, spec)`` to a float. The section's ``worker_cls`` picks it by its
last component (ROLL's ``...MathRuleRewardWorker``), else the section's name (``math_rule``); users add their own
with ``@REWARD_FUNCTIONS.register("my_reward")``. Each sample goes to the reward whose ``tag_included`` lists the
record's ``tag`` (a section without tags takes every sample no other section claims).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from apps.rlvr.config import RewardConfig, RewardSpec
from rl_core.registry import Registry

RewardFn = Callable[[str, dict[str, Any], RewardSpec], float]
REWARD_FUNCTIONS: Registry[RewardFn] = Registry("reward function", "rewards.<name>.worker_cls")

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)


def extract_answer(response: str) -> str:
    """The text to grade: the last ``<answer>...</answer>`` when present, else the whole response."""
    tagged = ANSWER_TAG.findall(response)
    return tagged[-1].strip() if tagged else response


def _ground_truth(record: dict[str, Any]) -> str:
    for key in ("ground_truth", "answer", "label"):
        if key in record and record[key] is not None:
            return str(record[key])
    raise KeyError(
        f"the record has no ground_truth / answer / label column to grade against; columns: {sorted(record)}"
    )


@REWARD_FUNCTIONS.register("math_rule", "MathRuleRewardWorker")
def math_rule_reward(response: str, record: dict[str, Any], spec: RewardSpec) -> float:
    """1.0 when the answer is mathematically equal to the ground truth (``math-verify``), else 0.0.

    Handles ``\\boxed{}``, LaTeX and plain expressions (1/2 == 0.5 == \\frac{1}{2}).
    """
    from math_verify import parse, verify

    gold = parse(_ground_truth(record))
    if not gold:
        gold = parse(f"${_ground_truth(record)}$")
    answer = parse(extract_answer(response))
    return 1.0 if gold and answer and verify(gold, answer) else 0.0


@REWARD_FUNCTIONS.register("exact_match", "ExactMatchRewardWorker")
def exact_match_reward(response: str, record: dict[str, Any], spec: RewardSpec) -> float:
    """1.0 when the extracted answer equals the ground truth after stripping whitespace, else 0.0."""
    return 1.0 if extract_answer(response).strip() == _ground_truth(record).strip() else 0.0


@REWARD_FUNCTIONS.register("format", "FormatRewardWorker")
def format_reward(response: str, record: dict[str, Any], spec: RewardSpec) -> float:
    """1.0 when the response contains exactly one ``<answer>...</answer>`` block, else 0.0 (a rule reward)."""
    return 1.0 if len(ANSWER_TAG.findall(response)) == 1 else 0.0


def reward_function(name: str, section: RewardConfig) -> RewardFn:
    """The function a section asks for: by worker_cls's last component, else by the section name."""
    wanted = section.spec.worker_cls.rsplit(".", 1)[-1] if section.spec.worker_cls else name
    if wanted not in REWARD_FUNCTIONS:
        raise ValueError(
            f"rewards.{name}: no reward function {wanted!r} (from worker_cls={section.spec.worker_cls!r}); "
            f"registered: {REWARD_FUNCTIONS.names()}. Register one with @REWARD_FUNCTIONS.register({wanted!r})."
        )
    return REWARD_FUNCTIONS.get(wanted)


class RewardRouter:
    """Scores samples with the reward section their tag belongs to, adding the response-length penalty."""

    def __init__(self, sections: dict[str, RewardConfig]) -> None:
        if not sections:
            raise ValueError("no reward sections configured")
        self.sections = sections
        self.functions = {name: reward_function(name, section) for name, section in sections.items()}
        self.by_tag: dict[str, str] = {}
        for name, section in sections.items():
            for tag in section.spec.tag_included:
                if tag in self.by_tag:
                    raise ValueError(f"tag {tag!r} is in tag_included of both rewards.{self.by_tag[tag]} and "
                                     f"rewards.{name}; each tag may go to one reward.")  # fmt: skip
                self.by_tag[tag] = name
        untagged = [name for name, section in sections.items() if not section.spec.tag_included]
        self.default = untagged[0] if untagged else None

    def section_for(self, record: dict[str, Any]) -> str:
        """The reward section name for a record (by its ``tag``)."""
        tag = record.get("tag")
        if tag in self.by_tag:
            return self.by_tag[str(tag)]
        if self.default is not None:
            return self.default
        raise ValueError(
            f"no reward takes tag {tag!r}: add it to some rewards.<name>.tag_included, or add a reward section "
            "without tag_included to take every other sample."
        )

    def score(self, response: str, record: dict[str, Any], response_tokens: int) -> float:
        """The reward of one response."""
        name = self.section_for(record)
        spec = self.sections[name].spec
        reward = self.functions[name](response, record, spec)
        return reward - spec.response_length_penalty_coef * response_tokens
