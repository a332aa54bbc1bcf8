"""roll_qa (ROLL's QaEnv on GEM's): a question per episode from a local dataset inside GEM's QA prompt, the
answer read from its tags and graded by GEM's normalised exact match; ROLL's HotpotQA section runs as configured."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from apps.agentic.envs import EnvConfigError, make_env
from apps.agentic.envs.qa_env import QA_PROMPT

pytest.importorskip("gem.utils.qa_em", reason="roll_qa grades with gem-llm (requirements-dev.txt pins it)")

ROWS = [{"problem": "Which city hosts the Louvre?", "answer": "Paris"},
        {"problem": "Name a primary colour.", "answer": ["red", "blue", "yellow"]},
        {"problem": "How many legs has a spider?", "answer": 8}]  # fmt: skip


@pytest.fixture
def hotpot(tmp_path):
    path = tmp_path / "hotpot.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    # ROLL's traj_envs_gem_qa.yaml HotpotQA env_config, the Hub name swapped for the exported file
    return {"dataset_name": str(path), "split": "train", "question_key": "problem", "answer_key": "answer"}


def test_the_question_is_gems_prompt_and_picked_as_gem_picks_it(hotpot):
    env = make_env("roll_qa", hotpot)
    for seed in range(6):  # GEM: the dataset shuffled with env_config.seed, then randint(0, n - 1) of the reset seed
        expected = ROWS[int(np.random.default_rng(0).permutation(3)[random.Random(seed).randint(0, 2)])]
        assert env.reset(seed) == QA_PROMPT.format(question=expected["problem"])
    assert env.reset(1).startswith("For any question, always reason through your thought process using:\n<think>")
    other = make_env("roll_qa", {**hotpot, "seed": 5})
    assert [other.reset(s) for s in range(12)] != [env.reset(s) for s in range(12)]  # another order


@pytest.mark.parametrize(
    ("problem", "response", "reward", "valid"),
    [
        (0, "<think>museum</think><answer>The Paris.</answer>", 1.0, True),  # normalised: case, article, punctuation
        (0, "<answer>Lyon</answer> then <answer>paris</answer>", 1.0, True),  # the last answer counts
        (0, "Paris", 0.0, False),  # no tags: an invalid action
        (1, "<answer>Blue</answer>", 1.0, True),  # any of a list of answers
        (2, "<answer>8</answer>", 1.0, True),  # a number answer
        (2, "<answer>eight</answer>", 0.0, True),
    ],
)
def test_answers_are_read_from_the_tags_and_graded_by_exact_match(hotpot, problem, response, reward, valid):
    env = make_env("roll_qa", hotpot)
    seed = next(s for s in range(100) if ROWS[problem]["problem"] in env.reset(s))
    env.reset(seed)
    result = env.step(response)
    assert (result.reward, result.info["action_is_valid"], result.terminated) == (reward, valid, True)
    assert result.info["success"] == (reward == 1.0)


def test_extract_boxed_reads_the_last_box(hotpot):
    env = make_env("roll_qa", {**hotpot, "extract_boxed": True})
    seed = next(s for s in range(100) if ROWS[2]["problem"] in env.reset(s))
    env.reset(seed)
    assert env.step("<answer>7</answer> \\boxed{8}").reward == 1.0


def test_a_hub_dataset_or_a_bad_answer_is_refused_naming_it(hotpot, tmp_path):
    with pytest.raises(EnvConfigError, match="'axon-rl/HotpotQA' is not a local file"):
        make_env("roll_qa", {**hotpot, "dataset_name": "axon-rl/HotpotQA"})
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": {"a": 1}}) + "\n")
    env = make_env("roll_qa", {"dataset_name": str(bad)})
    with pytest.raises(EnvConfigError, match=r"record 0: the answer .* is neither a string, a number nor a list"):
        env.reset(0)
