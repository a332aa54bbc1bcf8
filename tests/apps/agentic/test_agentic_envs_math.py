"""roll_math (ROLL's GEM MathEnv): a question per episode from a local dataset, one graded answer."""

from __future__ import annotations

import json

import pytest

from apps.agentic.envs import EnvConfigError, make_env
from apps.agentic.envs.math_env import last_boxed, same_answer


@pytest.fixture
def dataset(tmp_path):
    path = tmp_path / "math.jsonl"
    rows = [{"prompt": f"What is {a} / 2?", "solution": f"\\frac{{{a}}}{{2}}"} for a in range(1, 6)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_the_last_boxed_answer_with_nested_braces():
    assert last_boxed("first \\boxed{1} then \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert last_boxed("no box") is None and last_boxed("\\boxed{unclosed") is None


def test_answers_are_compared_as_math():
    assert same_answer("0.5", "\\frac{1}{2}") and same_answer("1/2", "0.5")
    assert not same_answer("0.4", "\\frac{1}{2}")
    assert not same_answer("1" * 600, "1" * 600)  # too long to read: graded wrong


def test_an_episode_is_one_question_and_one_graded_turn(dataset):
    env = make_env("roll_math", {"dataset_name": str(dataset), "question_key": "prompt", "answer_key": "solution"})
    question = env.reset(7)
    assert question == env.reset(7) and question.startswith("What is ")  # the seed picks the record
    assert len({env.reset(seed) for seed in range(40)}) == 5  # every record is reachable
    a = int(env.reset(7).split()[2])
    right = env.step(f"so it is \\boxed{{{a / 2}}}")
    assert right.reward == 1.0 and right.terminated and right.info["success"] and right.info["action_is_valid"]
    env.reset(7)
    wrong = env.step(f"\\boxed{{{a + 1}}}")
    assert wrong.reward == 0.0 and wrong.terminated and not wrong.info["success"]
    env.reset(7)
    unboxed = env.step(f"{a / 2}")
    assert unboxed.reward == 0.0 and unboxed.terminated and not unboxed.info["action_is_valid"]


def test_a_hub_dataset_or_a_missing_field_is_refused_naming_it(dataset):
    with pytest.raises(EnvConfigError, match="'open-r1/DAPO-Math-17k-Processed' is not a local file"):
        make_env("roll_math", {"dataset_name": "open-r1/DAPO-Math-17k-Processed"})
    with pytest.raises(EnvConfigError, match="has no 'problem' / 'answer' field"):
        make_env("roll_math", {"dataset_name": str(dataset)})
