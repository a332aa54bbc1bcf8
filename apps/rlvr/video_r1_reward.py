"""Video-R1's reward (ROLL's ``VideoR1RewardWorker``): an accuracy reward by question type plus a format reward.

A record names its question type in the ``reward_model`` column (ROLL's), its answer in ``ground_truth`` (or
``answer``). The answer graded is the first ``<answer>...</answer>`` of the response (else the whole response), and
of the ground truth likewise:

- ``multiple choice``: the last ``\\boxed{...}`` of each, if any; right when the first characters agree (after
  stripping spaces and dots);
- ``free-form``: the mean F-measure of ROUGE-1, ROUGE-2 and ROUGE-L (Porter stemming, ``rouge-score``), in [0, 1];
- ``numerical``: right when both or neither have a decimal point (or comma), and they agree to two decimals;
- ``OCR``: 1 - word error rate, clipped to [0, 1];
- ``regression``: 1 - relative difference, clipped to [0, 1] (0 for an answer that is not a number: ROLL raises a
  TypeError there).

The format reward is 1 when the whole response is ``<think>...</think> <answer>...</answer>``. The reward (and the
score) is their sum, 0 to 2, as ROLL's ``overall``; the step's metrics log the mean of each over the section's
responses as ``<section>/acc_reward``, ``<section>/fmt_reward`` and ``<section>/overall`` (ROLL's reward metrics under
its domain). A question type outside the five is an error naming the record's
value (ROLL scores it 0, which hides a typo in the data).
"""

from __future__ import annotations

import re
from typing import Any

from apps.rlvr.config import RewardSpec
from apps.rlvr.rewards import REWARD_FUNCTIONS, Grade, ground_truth

ANSWER = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)
BOXED = re.compile(r"\\boxed{(.*?)}")
FORMAT = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", re.DOTALL)
QUESTION_TYPES = ("multiple choice", "free-form", "numerical", "OCR", "regression")


def tagged_answer(text: str) -> str:
    """The first ``<answer>`` block's content, stripped; else the whole text."""
    match = ANSWER.search(text)
    return match.group(1).strip() if match else text


def boxed(text: str) -> str:
    """The last ``\\boxed{...}`` content (no nested braces); else the whole text."""
    found = BOXED.findall(text)
    return str(found[-1]) if found else text


def number(text: str) -> float | None:
    """``text`` as a number, commas dropped; None when it is not one."""
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def word_error_rate(reference: str, hypothesis: str) -> float:
    """Word-level Levenshtein distance over the reference's word count (at least 1)."""
    ref, hyp = reference.split(), hypothesis.split()
    row = list(range(len(hyp) + 1))
    for i, word in enumerate(ref, start=1):
        previous, row[0] = row[0], i
        for j, other in enumerate(hyp, start=1):
            previous, row[j] = row[j], previous if word == other else 1 + min(previous, row[j], row[j - 1])
    return row[len(hyp)] / max(1, len(ref))


def rouge_mean(reference: str, hypothesis: str) -> float:
    """Mean F-measure of ROUGE-1, ROUGE-2 and ROUGE-L with Porter stemming."""
    from rouge_score import rouge_scorer

    scores = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True).score(reference, hypothesis)
    return float(sum(score.fmeasure for score in scores.values())) / 3


def accuracy(response: str, truth: str, question_type: str) -> float:
    """The accuracy reward of one response (see the module)."""
    out, gold = tagged_answer(response), tagged_answer(truth)
    if question_type == "multiple choice":
        return 1.0 if boxed(out).strip().strip(".")[:1] == boxed(gold).strip().strip(".")[:1] else 0.0
    if question_type == "free-form":
        return max(0.0, min(1.0, rouge_mean(gold, out)))
    if question_type == "OCR":
        return max(0.0, min(1.0, 1.0 - word_error_rate(gold, out)))
    expected, got = number(gold), number(out)
    if expected is None or got is None:
        return 0.0
    if question_type == "numerical":
        if ("." in gold or "," in gold) != ("." in out or "," in out):
            return 0.0
        return 1.0 if round(expected, 2) == round(got, 2) else 0.0
    relative = (abs(got - expected) + 1e-9) / (abs(expected) + 1e-9)  # regression
    return 1.0 - min(1.0, max(0.0, relative))


@REWARD_FUNCTIONS.register("video_r1", "VideoR1RewardWorker")
def video_r1_reward(response: str, record: dict[str, Any], spec: RewardSpec) -> Grade:
    """Accuracy by the record's question type plus the format reward, 0 to 2, with ROLL's parts ``acc_reward``,
    ``fmt_reward`` and ``overall`` (logged as ``<section>/acc_reward`` ...; see the module)."""
    question_type = record.get("reward_model")
    if question_type not in QUESTION_TYPES:
        raise ValueError(
            f"the Video-R1 reward grades by the record's reward_model column, one of {list(QUESTION_TYPES)}; this "
            f"record has reward_model={question_type!r} (columns: {sorted(record)}). Fix the data."
        )
    fmt = 1.0 if FORMAT.fullmatch(response) else 0.0
    acc = accuracy(response, ground_truth(record), str(question_type))
    return Grade(acc + fmt, acc + fmt, {"acc_reward": acc, "fmt_reward": fmt, "overall": acc + fmt})
