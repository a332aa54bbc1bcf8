"""``env_type: roll_math``: one math question per episode, answered in one turn (ROLL's GEM MathEnv).

``reset(seed)`` draws a record of the dataset by the seed (the episodes of one env group share it) and shows its
``question_key`` field; ``step(response)`` grades the last ``\\boxed{...}`` of the response against the record's
``answer_key`` field with ``math-verify`` (``1/2`` == ``0.5`` == ``\\frac{1}{2}``): reward 1 when equal, else 0; a
response without ``\\boxed{}`` is an invalid action (reward 0). Either way the episode ends (one turn).

``dataset_name`` is a local ``.jsonl`` (one JSON record per line) or ``.json`` (a list of records) file. ROLL loads
a HuggingFace Hub dataset by that name; this machine cannot reach the Hub, so a name that is not a local file is
refused naming it (download it elsewhere, e.g. ``datasets.load_dataset(name, split="train").to_json(path)``, and
point ``dataset_name`` at the file). Grading runs with math-verify's signal timeouts off (environments step on
threads); answers longer than ``MAX_ANSWER_CHARS`` are graded wrong unread.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar

from apps.agentic.envs.base import ENV_TYPES, Frame, StepResult
from apps.agentic.envs.env_config import EnvConfigError

MAX_ANSWER_CHARS = 512


@dataclass(frozen=True)
class MathEnvConfig:
    """``env_config`` of ``env_type: roll_math`` (ROLL's MathEnv keys)."""

    dataset_name: str = ""
    """A local .jsonl / .json file of records (a HuggingFace Hub name cannot be downloaded here)."""
    question_key: str = "problem"
    """The record field shown as the question."""
    answer_key: str = "answer"
    """The record field holding the reference answer."""
    max_steps: int | None = None
    """ROLL's tool-wrapped math tags repeat the tag's max_steps here; ROLL's MathEnv takes any extra key and reads
    none of them, so this changes nothing either (the tag's ``max_steps`` bounds the episode)."""

    def __post_init__(self) -> None:
        check_local_dataset(self.dataset_name)


def check_local_dataset(dataset_name: str) -> None:
    """``env_config.dataset_name`` must be a local .jsonl / .json file (ROLL reads a Hub name; this machine cannot)."""
    path = Path(dataset_name)
    if not dataset_name or not path.is_file():
        raise EnvConfigError(
            f"env_config.dataset_name={dataset_name!r} is not a local file. ROLL loads it from the HuggingFace Hub, "
            "which this machine cannot reach: download it elsewhere (e.g. datasets.load_dataset(name, "
            "split='train').to_json('data.jsonl')) and set dataset_name to the .jsonl / .json file."
        )
    if path.suffix not in (".jsonl", ".json"):
        raise EnvConfigError(
            f"env_config.dataset_name={dataset_name!r}: read are .jsonl (a record per line) and .json (a list of "
            "records) files."
        )


def load_records(path: str, question_key: str, answer_key: str) -> tuple[tuple[str, str], ...]:
    """(question, answer) of every record of a .jsonl / .json file, the answer as text."""
    return tuple((question, str(answer)) for question, answer in read_records(path, question_key, answer_key))


@lru_cache(maxsize=8)
def read_records(path: str, question_key: str, answer_key: str) -> tuple[tuple[str, Any], ...]:
    """(question, answer as stored) of every record of a .jsonl / .json file (read once per process)."""
    text = Path(path).read_text(encoding="utf-8")
    try:
        rows = json.loads(text) if path.endswith(".json") else [json.loads(line) for line in text.splitlines() if line]
    except json.JSONDecodeError as err:
        raise EnvConfigError(f"env_config.dataset_name={path!r} is not valid JSON ({err}).") from None
    if not rows:
        raise EnvConfigError(f"env_config.dataset_name={path!r} holds no records.")
    missing = [i for i, row in enumerate(rows) if question_key not in row or answer_key not in row]
    if missing:
        raise EnvConfigError(
            f"env_config.dataset_name={path!r}: record {missing[0]} has no {question_key!r} / {answer_key!r} field "
            f"(its fields: {sorted(rows[missing[0]])}); set env_config.question_key / answer_key."
        )
    return tuple((str(row[question_key]), row[answer_key]) for row in rows)


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for index in range(begin - 1, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return text[begin:index]
    return None


def same_answer(answer: str, reference: str) -> bool:
    """math-verify's equivalence of two LaTeX / plain answers (signal timeouts off: we run on threads)."""
    from math_verify import parse, verify

    if len(answer) > MAX_ANSWER_CHARS:
        return False
    gold = parse(f"${reference}$", parsing_timeout=None) or parse(reference, parsing_timeout=None)
    guess = parse(f"${answer}$", parsing_timeout=None)
    return bool(gold and guess and verify(gold, guess, timeout_seconds=None))


class QuestionEnv:
    """What the one-question environments (``roll_math``, ``roll_qa``) share: the question is their frame, and they
    have no instructions apart from it."""

    question: str = ""

    def render(self, mode: str = "text") -> Frame:
        """The question (a text environment draws no picture: ``rgb_array`` gives the text too)."""
        return self.question

    @property
    def instructions(self) -> str:
        """None: the question and the template say what to do (ROLL: an empty env_instruction)."""
        return ""

    def close(self) -> None:
        """Nothing to release."""


@ENV_TYPES.register("roll_math")
class MathEnv(QuestionEnv):
    """One question per episode from a local dataset; one answer, graded."""

    config_cls: ClassVar[type[MathEnvConfig]] = MathEnvConfig

    def __init__(self, config: MathEnvConfig | None = None) -> None:
        if config is None:
            raise EnvConfigError("env_type roll_math needs env_config.dataset_name (a local .jsonl / .json file).")
        self.config = config
        self.records = load_records(config.dataset_name, config.question_key, config.answer_key)
        self.question, self.answer = "", ""

    def reset(self, seed: int) -> str:
        self.question, self.answer = self.records[random.Random(seed).randrange(len(self.records))]
        return self.question

    def step(self, action_text: str) -> StepResult:
        boxed = last_boxed(action_text)
        return graded_answer(boxed, boxed is not None and same_answer(boxed, self.answer))


def graded_answer(answer: str | None, correct: bool) -> StepResult:
    """The one step of a question episode: reward 1 when ``correct``; no ``answer`` found is an invalid action."""
    info: dict[str, Any] = {"action_is_valid": answer is not None, "action_is_effective": answer is not None,
                            "success": correct, "action": answer}  # fmt: skip
    return StepResult("", 1.0 if correct else 0.0, terminated=True, truncated=False, info=info)
