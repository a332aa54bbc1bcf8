"""The rule rewards of ROLL's other domains: multiple choice (CrossThinkQA) and instruction following (IFEval-style
checks), each on real cases, with the score / reward split of ROLL's ``scores`` and ``response_level_rewards``."""

from __future__ import annotations

import json

import pytest

from apps.rlvr import ifeval
from apps.rlvr.config import RewardConfig, RewardSpec
from apps.rlvr.rewards import REWARD_FUNCTIONS, Grade, RewardRouter
from apps.rlvr.rule_rewards import after_thinking, repetition_penalty

CHOICE = REWARD_FUNCTIONS.get("CrossThinkQARuleRewardWorker")
IFEVAL = REWARD_FUNCTIONS.get("GeneralRuleRewardWorker")


def choice(response: str, truth: str = "B", reward_type: str = "soft") -> Grade:
    return CHOICE(response, {"ground_truth": truth}, RewardSpec(reward_type=reward_type))


@pytest.mark.parametrize(
    ("response", "reward_type", "grade"),
    [
        ("<think>It is not A.</think>\nSo the answer is \\boxed{B}.", "soft", Grade(1.0, 1.0)),
        ("The answer is (B) because of the heat.", "soft", Grade(1.0, 0.5)),  # right, not boxed
        ("The answer is (B) because of the heat.", "loose", Grade(1.0, 1.0)),
        ("The answer is (B) because of the heat.", "strict", Grade(0.0, -1.0)),
        ("\\boxed{C}", "soft", Grade(0.0, -0.5)),  # boxed, wrong
        ("\\boxed{C}", "loose", Grade(0.0, -1.0)),
        ("I think the answer is c.", "soft", Grade(0.0, -1.0)),  # no capital letter: no option named
        ("<think>\\boxed{B}</think> Final: \\boxed{D}", "soft", Grade(0.0, -0.5)),  # only after the thinking counts
        ("\\boxed{A} no wait \\boxed{B}", "strict", Grade(1.0, 1.0)),  # the last box
    ],
)
def test_multiple_choice_follows_rolls_reward_table(response, reward_type, grade):
    assert choice(response, reward_type=reward_type) == grade


def test_multiple_choice_needs_a_reward_type():
    with pytest.raises(ValueError, match=r"reward_type loose, soft or strict.*rewards\.<name>\.reward_type"):
        choice("\\boxed{B}", reward_type=None)


def test_the_repetition_penalty_is_the_reward_s_not_the_score_s():
    repeated = "\\boxed{B} " + "so so so so so so"
    # 3-grams of "\boxed{b} so so so so so so": 5, of which 2 distinct -> (1 - 2/5) * -0.5
    assert repetition_penalty(repeated) == pytest.approx(-0.3)
    assert choice(repeated) == Grade(1.0, pytest.approx(0.7))
    assert repetition_penalty("two words") == 0.0 and repetition_penalty("a b c d") == 0.0
    assert after_thinking("<think>x</think>\n\nanswer") == "answer" and after_thinking("plain") == "plain"


def gt(func_name: str, **args) -> str:
    """A ground truth as the RLVR-IFEval data writes it: every argument key present, most of them null."""
    row = {"func_name": func_name, "N": None, "quantifier": None, "end_phrase": None, "keyword_list": None,
           "word": None, "forbidden_words": None, "letter": None, "i": None, "first_word": None,
           "postscript_marker": None, "options": None, "section_splitter": None, "original_prompt": None}  # fmt: skip
    row.update(args)
    return json.dumps(row)


FOLLOWED = [
    (gt("verify_keywords", keyword_list=["Paris", "river"]), "The river Seine runs through paris."),
    (gt("verify_keyword_frequency", word="cat", N=2), "A cat saw another cat; cats are not counted."),
    (gt("validate_forbidden_words", forbidden_words=["bad"]), "A badger is not forbidden."),
    (gt("verify_letter_frequency", letter="z", N=3), "zigzag zoo"),
    (gt("validate_response_language", language="en"), "This answer is written entirely in plain English words."),
    (gt("verify_paragraph_count", N=2), "First part.\n* * *\nSecond part."),
    (gt("validate_word_constraint", N=10, quantifier="around"), "one two three four five six seven eight nine"),
    (gt("verify_sentence_constraint", N=2, quantifier="at least"), "It rains. Dr. Smith stays in! Why?"),
    (gt("validate_paragraphs", N=2, first_word="then", i=2), "First.\n\nThen second."),
    (gt("verify_postscript", postscript_marker="P.S."), "Body.\nP.S. see you"),
    (gt("validate_placeholders", N=2), "Send it to [name] at [address]."),
    (gt("verify_bullet_points", N=2), "Points:\n* one\n- two\n***"),
    (gt("validate_title"), "<<A Poem>>\nroses"),
    (gt("validate_choice", options=["My answer is yes.", "My answer is no."]), "My answer is no."),
    (gt("validate_highlighted_sections", N=2), "*first* and **second** but not **"),
    (gt("validate_sections", N=2, section_splitter="SECTION"), "SECTION 1\nintro\nSECTION 2\nend"),
    (gt("validate_json_format"), '```json\n{"a": 1}\n```'),
    (gt("validate_repeat_prompt", original_prompt="Write a poem."), "write a poem. Roses are red."),
    (gt("validate_two_responses"), "Yes.\n******\nNo."),
    (gt("validate_uppercase"), "ALL CAPS, 2 NUMBERS."),
    (gt("validate_lowercase"), "all lower, 2 numbers."),
    (gt("validate_frequency_capital_words", N=2, quantifier="at most"), "NASA and the USA, not Nasa."),
    (gt("validate_end", end_phrase="Is there anything else?"), "Done. Is there anything else?  "),
    (gt("validate_quotation"), '"quoted"'),
    (gt("validate_no_commas"), "no commas here."),
]
NOT_FOLLOWED = [
    (gt("verify_keywords", keyword_list=["Paris", "river"]), "Paris only."),
    (gt("verify_keyword_frequency", word="cat", N=2), "cat dog bird"),  # every word counted would give 3
    (gt("validate_forbidden_words", forbidden_words=["bad"]), "That is Bad."),
    (gt("verify_letter_frequency", letter="z", N=3), "Zigzag zoo"),
    (gt("validate_response_language", language="en"), "Cette réponse est entièrement écrite en français."),
    (gt("verify_paragraph_count", N=2), "First.\n* * *\n\n"),  # the second paragraph is empty
    (gt("validate_word_constraint", N=10, quantifier="at least"), "too short"),
    (gt("verify_sentence_constraint", N=1, quantifier="at most"), "One. Two."),
    (gt("validate_paragraphs", N=2, first_word="then", i=2), "First.\n\nThereafter second."),
    (gt("verify_postscript", postscript_marker="P.S."), "Body. P.S."),
    (gt("validate_placeholders", N=2), "Send it to [name]."),
    (gt("verify_bullet_points", N=2), "* one"),
    (gt("validate_title"), "<<>> no title"),
    (gt("validate_choice", options=["My answer is yes.", "My answer is no."]), "Maybe."),
    (gt("validate_highlighted_sections", N=2), "*one* only"),
    (gt("validate_sections", N=2, section_splitter="SECTION"), "SECTION 1\nonly one"),
    (gt("validate_json_format"), "{'a': 1}"),
    (gt("validate_repeat_prompt", original_prompt="Write a poem."), "Roses are red."),
    (gt("validate_two_responses"), "Same.\n******\nSame."),
    (gt("validate_uppercase"), "Not caps"),
    (gt("validate_lowercase"), "Not lower"),
    (gt("validate_frequency_capital_words", N=2, quantifier="at least"), "only NASA"),
    (gt("validate_end", end_phrase="Is there anything else?"), "Is there anything else? Bye."),
    (gt("validate_quotation"), '"open only'),
    (gt("validate_no_commas"), "a, b"),
]


@pytest.mark.parametrize(("truth", "response"), FOLLOWED, ids=[json.loads(t)["func_name"] for t, _ in FOLLOWED])
def test_each_instruction_check_accepts_a_response_that_follows_it(truth, response):
    assert IFEVAL(response, {"ground_truth": truth}, RewardSpec()) == Grade(1.0, 1.0)


@pytest.mark.parametrize(("truth", "response"), NOT_FOLLOWED, ids=[json.loads(t)["func_name"] for t, _ in NOT_FOLLOWED])
def test_each_instruction_check_rejects_a_response_that_breaks_it(truth, response):
    assert IFEVAL(response, {"ground_truth": truth}, RewardSpec()) == Grade(0.0, 0.0)


def test_every_check_is_exercised_both_ways():
    assert {json.loads(t)["func_name"] for t, _ in FOLLOWED} == set(ifeval.CHECKS)
    assert {json.loads(t)["func_name"] for t, _ in NOT_FOLLOWED} == set(ifeval.CHECKS)


def test_instructions_are_checked_after_the_thinking_and_bad_ground_truths_score_zero():
    truth = {"func_name": "validate_lowercase"}  # a dict works as well as its JSON
    assert IFEVAL("<think>Let Me Think</think>\nall lower", {"ground_truth": truth}, RewardSpec()).score == 1.0
    assert IFEVAL("All lower", {"ground_truth": truth}, RewardSpec()).score == 0.0
    # wrong argument types are not followed; an unknown check is not followed, with a warning naming it (as ROLL)
    assert IFEVAL("x", {"ground_truth": gt("verify_letter_frequency", letter="xy", N=1)}, RewardSpec()).score == 0.0
    with pytest.warns(UserWarning, match="names no known func_name"):
        assert IFEVAL("x", {"ground_truth": gt("validate_haiku")}, RewardSpec()) == Grade(0.0, 0.0)


def test_the_router_routes_domains_by_tag_to_rolls_worker_classes():
    worker = "roll.pipeline.rlvr.rewards.{}"
    sections = {
        "crossthinkqa": {"worker_cls": worker.format("crossthinkqa_rule_reward_worker.CrossThinkQARuleRewardWorker"),
                         "reward_type": "soft", "tag_included": ["crossthinkqa"]},
        "ifeval": {"worker_cls": worker.format("ifeval_rule_reward_worker.GeneralRuleRewardWorker"),
                   "reward_type": "soft", "tag_included": ["ifeval"], "response_length_penalty_coef": 0.01},
        "math_rule": {"worker_cls": worker.format("math_rule_reward_worker.MathRuleRewardWorker")},
    }  # fmt: skip
    router = RewardRouter({name: RewardConfig.from_dict(v, f"rewards.{name}") for name, v in sections.items()})
    texts = ["The answer is B.", "all lower", "\\boxed{2}"]
    records = [{"tag": "crossthinkqa", "ground_truth": "B"},
               {"tag": "ifeval", "ground_truth": gt("validate_lowercase")},
               {"tag": "gsm8k", "ground_truth": "2"}]  # fmt: skip
    assert router.grade_many(texts, records, [4, 3, 5]) == [Grade(1.0, 0.5), Grade(1.0, pytest.approx(0.97)),
                                                            Grade(1.0, 1.0)]  # fmt: skip


def test_advantages_follow_the_rewards_and_the_score_metric_follows_the_scores():
    """GRPO on one group: a right-but-unboxed answer (score 1, soft reward 0.5) against a boxed right one (1, 1)
    and a wrong one (0, -1): the advantages rank by reward, critic/score/mean is the mean score."""
    import torch

    from apps.common.algorithm import AlgorithmSettings, TargetBuilder
    from apps.rlvr.config import RLVRConfig
    from rl_core.batch import RolloutBatch

    config = RLVRConfig.from_dict({"adv_estimator": "grpo", "rewards": {"crossthinkqa": {"reward_type": "soft"}}})
    settings = AlgorithmSettings.from_config(config)
    batch = RolloutBatch.from_dict({"response_mask": torch.ones(3, 2), "old_log_probs": torch.zeros(3, 2)}, {})
    rewards, scores = torch.tensor([0.5, 1.0, -1.0]), torch.tensor([1.0, 1.0, 0.0])
    metrics = TargetBuilder(settings, config)(batch, rewards, ["p", "p", "p"], scores=scores)
    advantages = batch.batch["advantages"][:, 0]
    assert advantages[1] > advantages[0] > advantages[2]
    assert metrics["critic/score/mean"] == pytest.approx(2 / 3)
    assert metrics["critic/rewards/mean"] == pytest.approx(float(rewards.mean()))


def test_validation_reports_rolls_val_correct_per_tag_beside_the_mean_scores():
    from apps.rlvr.validation import validation_metrics

    records = [{"tag": "mc"}, {"tag": "mc"}, {"tag": "gsm8k"}, {}]
    section_for = lambda record: "math" if record.get("tag") == "gsm8k" else "mc"  # noqa: E731
    metrics = validation_metrics([1.0, 0.5, 1.0, 0.0], records, section_for)
    assert metrics["val/score/mean"] == pytest.approx(0.625) and metrics["val/score/mc"] == pytest.approx(0.5)
    assert metrics["val_correct/all/mean"] == 0.5  # only a score of 1 is correct, as ROLL counts it
    assert (metrics["val_correct/mc/mean"], metrics["val_correct/gsm8k/mean"]) == (0.5, 1.0)
