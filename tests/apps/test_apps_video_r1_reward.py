"""ROLL's VideoR1RewardWorker (Video-R1's reward): accuracy by the record's question type plus the format reward, on
real cases of each type, found by its ROLL class path."""

from __future__ import annotations

import pytest

from apps.rlvr.config import RewardConfig, RewardSpec
from apps.rlvr.rewards import REWARD_FUNCTIONS, RewardRouter, part_metrics
from apps.rlvr.video_r1_reward import accuracy, word_error_rate

REWARD = REWARD_FUNCTIONS.get("VideoR1RewardWorker")  # ROLL's worker_cls ...video_r1_reward_worker.VideoR1RewardWorker
assert REWARD_FUNCTIONS.get("video_r1") is REWARD


def reward(response: str, truth: str, question_type: str) -> float:
    return REWARD(response, {"ground_truth": truth, "reward_model": question_type}, RewardSpec()).reward


@pytest.mark.parametrize(
    ("response", "truth", "question_type", "expected"),
    [
        # multiple choice: the boxed letter of each side's <answer>, first characters compared
        ("<think>The clip shows a dog.</think> <answer>\\boxed{B}</answer>", "<answer>B</answer>", "multiple choice",
         2.0),
        ("<think>hmm</think><answer>C. a cat</answer>", "<answer>B</answer>", "multiple choice", 1.0),  # format only
        ("The answer is B", "B", "multiple choice", 0.0),  # no tags: the whole response, "T" vs "B"
        # numerical: decimals must agree in kind, values to two places
        ("<think>count</think> <answer>3</answer>", "<answer>3</answer>", "numerical", 2.0),
        ("<think>count</think> <answer>3.0</answer>", "<answer>3</answer>", "numerical", 1.0),
        ("<think>x</think> <answer>1,234.5</answer>", "1234.50", "numerical", 2.0),
        ("<think>x</think> <answer>about 3</answer>", "3", "numerical", 1.0),  # not a number
        # regression: 1 - relative difference
        ("<think>x</think> <answer>90</answer>", "100", "regression", 1.9),
        ("<think>x</think> <answer>many</answer>", "100", "regression", 1.0),  # ROLL raises here; 0 accuracy
        # OCR: 1 - word error rate
        ("<think>x</think> <answer>STOP AHEAD now</answer>", "STOP AHEAD", "OCR", 1.5),
        # free-form: mean ROUGE-1/2/L F-measure (stemmed: "cats running" ~ "cat runs")
        ("<think>x</think> <answer>the cat is sleeping</answer>", "the cat is sleeping", "free-form", 2.0),
    ],
)  # fmt: skip
def test_each_question_type_is_graded_as_video_r1_grades_it(response, truth, question_type, expected):
    assert reward(response, truth, question_type) == pytest.approx(expected, abs=1e-9)


def test_free_form_answers_earn_their_rouge_overlap():
    score = accuracy("<answer>a cat runs fast</answer>", "the cats are running fast", "free-form")
    assert score == pytest.approx((0.6666666666666666 + 0.2857142857142857 + 0.6666666666666666) / 3)


def test_the_word_error_rate_counts_substitutions_insertions_and_deletions():
    assert word_error_rate("a b c d", "a x c d e") == 0.5  # one substitution, one insertion over 4 words
    assert word_error_rate("a b c", "") == 1.0 and word_error_rate("", "x") == 1.0


def test_an_unknown_question_type_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"reward_model='multiple-choice'.*Fix the data"):
        reward("<answer>B</answer>", "B", "multiple-choice")
    with pytest.raises(ValueError, match=r"reward_model=None"):
        REWARD("<answer>B</answer>", {"ground_truth": "B"}, RewardSpec())


def test_rolls_acc_reward_and_fmt_reward_are_logged_per_section_as_means():
    """ROLL's worker reports acc_reward, fmt_reward and overall per response (its meta_info metrics), reduced to
    their means under the domain: here ``<section>/acc_reward`` ..., from the router's grades of one step; a
    section without parts (math_rule) logs none."""
    video = {"worker_cls": "roll.pipeline.rlvr.rewards.video_r1_reward_worker.VideoR1RewardWorker",
             "tag_included": ["video"]}  # fmt: skip
    router = RewardRouter({"videor1": RewardConfig.from_dict(video, "rewards.videor1"),
                           "math_rule": RewardConfig.from_dict({}, "rewards.math_rule")})  # fmt: skip
    texts = ["<think>a dog</think> <answer>B</answer>", "<answer>C</answer>", "<think>x</think> <answer>3</answer>",
             "<answer>2</answer>"]  # fmt: skip
    records = [{"tag": "video", "ground_truth": "B", "reward_model": "multiple choice"},
               {"tag": "video", "ground_truth": "B", "reward_model": "multiple choice"},
               {"tag": "video", "ground_truth": "4", "reward_model": "numerical"},
               {"tag": "math", "ground_truth": "2"}]  # fmt: skip
    grades = router.grade_many(texts, records, [4, 4, 4, 4])
    assert [g.reward for g in grades] == [2.0, 0.0, 1.0, 1.0]
    assert part_metrics(router.graded) == {"videor1/acc_reward": 1 / 3, "videor1/fmt_reward": 2 / 3,
                                           "videor1/overall": 1.0}  # fmt: skip
