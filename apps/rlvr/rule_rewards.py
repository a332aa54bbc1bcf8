"""ROLL's rule rewards beyond math: multiple choice (``CrossThinkQARuleRewardWorker``) and instruction following
(``GeneralRuleRewardWorker``, the checks in ``apps.rlvr.ifeval``).

Both grade the text after the response's last ``</think>`` and, as ROLL, add a repetition penalty to the reward: the
fraction of repeated word 3-grams times -0.5, on the whole response. The score (ROLL's ``scores``) says whether the
answer is right; the reward (ROLL's ``response_level_rewards``) is what the policy is trained on.
"""

from __future__ import annotations

import re
from typing import Any

from apps.rlvr import ifeval
from apps.rlvr.config import RewardConfig, RewardSpec
from apps.rlvr.rewards import REWARD_FUNCTIONS, Grade, ground_truth

REPETITION_NGRAM, REPETITION_MAX_PENALTY = 3, -0.5

# CrossThinkQA's reward by reward_type for (answer right, answer in \boxed{}): ROLL's table.
CHOICE_REWARDS = {
    "loose": {(True, True): 1.0, (True, False): 1.0, (False, True): -1.0, (False, False): -1.0},
    "soft": {(True, True): 1.0, (True, False): 0.5, (False, True): -0.5, (False, False): -1.0},
    "strict": {(True, True): 1.0, (True, False): -1.0, (False, True): -1.0, (False, False): -1.0},
}
BOXED = re.compile(r"\\boxed\{([^}]+)\}")


def after_thinking(text: str, end_think: str = "</think>") -> str:
    """The text after the last ``</think>`` (leading newlines dropped), or all of it when there is none."""
    at = text.rfind(end_think)
    return text if at < 0 else text[at + len(end_think) :].lstrip("\n")


def repetition_penalty(text: str, ngram: int = REPETITION_NGRAM, max_penalty: float = REPETITION_MAX_PENALTY) -> float:
    """``max_penalty`` times the fraction of repeated word n-grams (0 for fewer than ``ngram`` words)."""
    words = text.lower().split()
    grams = list(zip(*(words[i:] for i in range(ngram))))
    if not grams:
        return 0.0
    return (1 - len(set(grams)) / len(grams)) * max_penalty


def choice_answer(text: str) -> tuple[str, bool]:
    """The answer part of a multiple-choice response and whether it was boxed: the last ``\\boxed{...}``, else
    what follows the last "answer is", else the whole text."""
    boxed = BOXED.findall(text)
    if boxed:
        return boxed[-1], True
    at = text.lower().rfind("answer is")
    return (text if at < 0 else text[at + len("answer is") :]), False


def chosen_letter(answer: str) -> str | None:
    """The first capital letter of the answer part (the option it names), or None."""
    return next((char for char in answer if char.isupper()), None)


def check_choice_section(name: str, section: RewardConfig) -> None:
    """Pre-flight: the multiple-choice reward needs its reward_type."""
    if section.spec.reward_type not in CHOICE_REWARDS:
        raise ValueError(
            f"rewards.{name}.reward_type={section.spec.reward_type!r}: the multiple-choice reward (ROLL's "
            f"CrossThinkQA) needs one of {sorted(CHOICE_REWARDS)}."
        )


@REWARD_FUNCTIONS.register("crossthinkqa", "CrossThinkQARuleRewardWorker", "multiple_choice")
def multiple_choice_reward(response: str, record: dict[str, Any], spec: RewardSpec) -> Grade:
    """Multiple choice graded by its letter: right when the first capital letter of the answer part is the ground
    truth's first character. The reward follows ``reward_type`` (loose / soft / strict: how much a right answer
    outside ``\\boxed{}`` and a boxed wrong one earn), plus the repetition penalty; the score is 1 when that table's
    reward is positive."""
    table = CHOICE_REWARDS.get(spec.reward_type or "")
    if table is None:
        raise ValueError(
            f"the multiple-choice reward needs reward_type loose, soft or strict (ROLL's CrossThinkQA), got "
            f"{spec.reward_type!r}; set rewards.<name>.reward_type."
        )
    truth = ground_truth(record).strip()
    answer, boxed = choice_answer(after_thinking(response))
    right = bool(truth) and chosen_letter(answer) == truth[0]
    value = table[(right, boxed)]
    return Grade(1.0 if value > 0 else 0.0, value + repetition_penalty(response))


@REWARD_FUNCTIONS.register("ifeval", "GeneralRuleRewardWorker", "instruction_following")
def instruction_following_reward(response: str, record: dict[str, Any], spec: RewardSpec) -> Grade:
    """1 when the response (after thinking) follows the instruction its ground truth names (``apps.rlvr.ifeval``),
    else 0; the reward adds the repetition penalty."""
    followed = 1.0 if ifeval.follows(after_thinking(response), record.get("ground_truth", "")) else 0.0
    return Grade(followed, followed + repetition_penalty(response))


multiple_choice_reward.check_section = check_choice_section  # type: ignore[attr-defined]


def check_instruction_section(name: str, section: RewardConfig) -> None:
    """Pre-flight: the response-language check needs langdetect."""
    try:
        import langdetect  # noqa: F401
    except ImportError:
        raise ValueError(
            f"rewards.{name}: the instruction-following reward needs the langdetect package (its "
            "validate_response_language check); pip install langdetect==1.0.9."
        ) from None


instruction_following_reward.check_section = check_instruction_section  # type: ignore[attr-defined]
