"""``env_type: roll_qa``: one question per episode, answered in one turn (ROLL's QaEnv on GEM's, as ROLL's
``traj_envs_gem_qa.yaml`` configures HotpotQA).

The question is shown inside GEM's QA prompt (reason in ``<think>``, answer in ``<answer>``); the answer is the last
``<answer>...</answer>`` of the response (the last ``\\boxed{...}`` with ``extract_boxed``), graded by GEM's exact
match after SQuAD normalisation (lower case, no punctuation or articles) against the record's answer or any of its
answers (a list): reward 1 or 0, and no answer is an invalid action. Either way the episode ends.

Questions are picked as GEM and ROLL pick them: the records in the order of a permutation seeded by
``env_config.seed`` (what ``datasets.Dataset.shuffle(seed)`` does), then the index ``randint(0, n - 1)`` of a
generator seeded by the episode's reset seed. ``dataset_name`` is a local ``.jsonl`` / ``.json`` file (ROLL reads a
Hub dataset, which this machine cannot reach; a Hub name is refused naming how to fetch it); ``split`` names the Hub
split the file was exported from, and is not read (a file is one split). Grading uses gem-llm's own functions, so
gem-llm must be installed (requirements-dev.txt pins ROLL's version).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import cache
from typing import Any, ClassVar

import numpy as np

from apps.agentic.envs.base import ENV_TYPES, StepResult
from apps.agentic.envs.env_config import EnvConfigError
from apps.agentic.envs.math_env import QuestionEnv, check_local_dataset, graded_answer, read_records
from apps.common.plots import quiet_matplotlib

QA_PROMPT = (
    "For any question, always reason through your thought process using:\n"
    "<think> your reasoning here </think>\n"
    "Then, provide your final answer using:\n"
    "<answer> your answer here </answer>\n\n"
    "Question: {question}\n"
)
"""GEM's QA prompt around every question (gem.envs.qa_env.apply_prompt, which ROLL's QaEnv applies)."""


@dataclass(frozen=True)
class QaEnvConfig:
    """``env_config`` of ``env_type: roll_qa`` (ROLL's QaEnv keys)."""

    dataset_name: str = ""
    """A local .jsonl / .json file of records (a HuggingFace Hub name cannot be downloaded here)."""
    split: str | None = None
    """The Hub split the file was exported from (ROLL picks it from the Hub dataset; a file is one split)."""
    question_key: str = "question"
    """The record field holding the question."""
    answer_key: str = "answer"
    """The record field holding the answer: a string, a number, or a list of accepted answers."""
    seed: int = 0
    """Seed of the question order (GEM shuffles the dataset with it; an env manager sets the env group's)."""
    extract_boxed: bool = False
    """Read the answer from the last ``\\boxed{}`` instead of the last ``<answer>`` tags."""

    def __post_init__(self) -> None:
        check_local_dataset(self.dataset_name)


@cache
def _gem_grading() -> tuple[Any, Any, Any]:
    quiet_matplotlib()  # importing gem imports reasoning-gym, which imports matplotlib: its caches go to the temp dir
    try:
        from gem.utils.parsing import extract_last_boxed_answer, extract_last_tagged_answer
        from gem.utils.qa_em import em_check
    except ImportError:
        raise EnvConfigError(
            "env_type roll_qa grades with gem-llm's exact match, and gem-llm is not installed: "
            "pip install gem-llm==0.0.4 (ROLL's version)."
        ) from None
    return extract_last_tagged_answer, extract_last_boxed_answer, em_check


def accepted_answers(answer: Any, where: str) -> list[str]:
    """GEM's reading of a record's answer: one (text or number) or several (a list)."""
    if isinstance(answer, (str, int, float)) and not isinstance(answer, bool):
        return [str(answer)]
    if isinstance(answer, list):
        return [str(item) for item in answer]
    raise EnvConfigError(f"{where}: the answer {answer!r} is neither a string, a number nor a list of them.")


@ENV_TYPES.register("roll_qa")
class QaEnv(QuestionEnv):
    """One question per episode from a local dataset; one answer, graded by exact match."""

    config_cls: ClassVar[type[QaEnvConfig]] = QaEnvConfig

    def __init__(self, config: QaEnvConfig | None = None) -> None:
        if config is None:
            raise EnvConfigError("env_type roll_qa needs env_config.dataset_name (a local .jsonl / .json file).")
        self.config = config
        self.tagged, self.boxed, self.exact_match = _gem_grading()
        self.records = read_records(config.dataset_name, config.question_key, config.answer_key)
        self.order = np.random.default_rng(config.seed).permutation(len(self.records))
        self.question, self.answers = "", [""]

    def reset(self, seed: int) -> str:
        index = int(self.order[random.Random(seed).randint(0, len(self.records) - 1)])
        question, answer = self.records[index]
        self.answers = accepted_answers(answer, f"env_config.dataset_name={self.config.dataset_name!r}, record {index}")
        self.question = QA_PROMPT.format(question=question)
        return self.question

    def step(self, action_text: str) -> StepResult:
        answer = (self.boxed if self.config.extract_boxed else self.tagged)(action_text)
        return graded_answer(answer, answer is not None and bool(self.exact_match(answer, self.answers)))
