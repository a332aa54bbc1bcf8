"""LLM as judge (ROLL's LLMJudgeRewardWorker): the judge model runs as its own role (rewards.<name>, hf_infer on its
own device slot), sees the question, the response and the reference in its prompt template, and its yes / no is the
score. The judge here is a tiny local model built to echo the last token of its prompt, so its verdict is forced by
the prompt: whatever the template puts last decides it."""

from __future__ import annotations

import json

import pytest
import torch

from apps.rlvr import judge as judge_module
from apps.rlvr.config import RewardConfig
from apps.rlvr.judge import question_of, verdict
from apps.rlvr.rewards import Grade, RewardRouter, check_reward_sections
from rl_engines.placement import ClusterSpec
from rl_engines.roles import Roles
from rl_engines.tiny_model import build_tiny_causal_lm, build_tiny_tokenizer

JUDGE_CLS = "roll.pipeline.rlvr.rewards.llm_judge_reward_worker.LLMJudgeRewardWorker"
ECHO_REFERENCE = "Question: {question} Answer: {response} Reference: {reference}"
ECHO_RESPONSE = "Question: {question} Reference: {reference} Answer: {response}"


def echo_judge(folder):
    """A tiny Qwen2 whose layers add nothing to the residual stream: with tied embeddings its greedy next token is
    the last input token (each embedding is closest to itself), so it answers by repeating its prompt's end."""
    corpus = [f"Question: {q} Answer: {a} Reference: {r}" for q in ("2+2=", "capital?") for a in ("yes", "no")
              for r in ("yes", "no")] * 20  # fmt: skip
    build_tiny_tokenizer(folder, corpus, vocab_size=300)
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # the prompt ends the input
    tokenizer.save_pretrained(str(folder))
    build_tiny_causal_lm(folder, vocab_size=len(tokenizer))
    model = Qwen2ForCausalLM.from_pretrained(str(folder))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(str(folder))
    return folder


def section(model, template="echo_reference", **extra):
    values = {"worker_cls": JUDGE_CLS, "judge_prompt": template, "judge_model_type": "inference",
              "tag_included": ["RLVR"], "device_mapping": [1], "infer_batch_size": 2,
              "model_args": {"model_name_or_path": str(model), "dtype": "fp32"},
              "strategy_args": {"strategy_name": "hf_infer"}, "data_args": {"template": "qwen2_5"},
              "generating_args": {"max_new_tokens": 3, "temperature": 0.0, "num_return_sequences": 1}}  # fmt: skip
    values.update(extra)
    return RewardConfig.from_dict(values, "rewards.llm_judge")


@pytest.fixture(scope="module")
def templates():
    added = {"echo_reference": ECHO_REFERENCE, "echo_response": ECHO_RESPONSE}
    judge_module.JUDGE_PROMPTS.update(added)
    yield
    for name in added:
        judge_module.JUDGE_PROMPTS.pop(name)


@pytest.fixture(scope="module")
def judged(tmp_path_factory, ray_session, templates):
    """A judge role on its own CPU slot, started as the RLVR pipeline starts it (router.role_sections() with Roles),
    attached; and the model it runs."""
    model = echo_judge(tmp_path_factory.mktemp("judge"))
    router = RewardRouter({"llm_judge": section(model), "math": RewardConfig.from_dict(
        {"worker_cls": "x.MathRuleRewardWorker", "tag_included": ["math"]}, "rewards.math")})  # fmt: skip
    assert set(router.role_sections()) == {"rewards.llm_judge"}  # the rule reward needs no model
    with Roles(ClusterSpec(1, 2), router.role_sections(), rpc_timeout=120) as roles:
        router.attach_judges(roles, "prompt", None)
        yield router, roles, model


def test_the_judges_verdict_is_the_score(judged):
    router, roles, model = judged
    records = [{"tag": "RLVR", "prompt": "2+2=", "ground_truth": "yes"},
               {"tag": "RLVR", "prompt": "capital?", "ground_truth": "no"},
               {"tag": "math", "prompt": "2+2=", "ground_truth": "4"},
               {"tag": "RLVR", "prompt": "capital?", "ground_truth": "yes"}]  # fmt: skip
    texts = ["no", "yes", "\\boxed{4}", "no"]
    # the template ends with the reference: the echo says it, so the verdict follows the reference
    assert router.grade_many(texts, records, [1] * 4) == [Grade(1.0, 1.0), Grade(0.0, 0.0), Grade(1.0, 1.0),
                                                          Grade(1.0, 1.0)]  # fmt: skip
    assert router.judges["llm_judge"].answers(["no"], [records[0]])[0].split() == ["yes"] * 3  # 3 new tokens
    # the same role with a template that ends with the response: now the response decides
    by_response = judge_module.Judge("llm_judge", section(model, "echo_response"), roles, "prompt", None)
    assert by_response.grade(["yes", "no"], [records[1], records[0]]) == [1.0, 0.0]


def test_the_judge_prompt_holds_question_response_and_reference(tmp_path, templates):
    model = echo_judge(tmp_path / "judge")
    judge = judge_module.Judge("llm_judge", section(model), None, None, "messages")
    record = {"messages": json.dumps([{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2="}]),
              "ground_truth": "yes"}  # fmt: skip
    assert judge.prompts(["no"], [record]) == ["Question: 2+2= Answer: no Reference: yes"]


def test_verdicts_and_questions_read_as_rolls():
    assert [verdict(a) for a in ("YES", "Yes, it matches.", "NO", "no", "maybe")] == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert question_of({"prompt": "What is 2+2?"}, "prompt", None) == "What is 2+2?"


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"judge_model_type": "api"}, r"judge_model_type='api'.*ROLL's 'api' judge is not built"),
        ({"judge_prompt": "nope"}, r"judge_prompt='nope' is not a known judge prompt; known: \[.*Qwen2\.5-7B-Instr"),
        ({"device_mapping": None}, r"rewards\.llm_judge\.device_mapping is empty"),
    ],
)
def test_preflight_refuses_a_judge_it_cannot_run(tmp_path, change, error):
    values = {"worker_cls": JUDGE_CLS, "judge_prompt": "Qwen2.5-7B-Instruct-RLVR-prompt",
              "judge_model_type": "inference", "device_mapping": [1],
              "model_args": {"model_name_or_path": str(tmp_path)}, **change}  # fmt: skip
    with pytest.raises(ValueError, match=error):
        check_reward_sections({"llm_judge": RewardConfig.from_dict(values, "rewards.llm_judge")})


def test_a_judge_section_is_never_graded_without_its_role(tmp_path):
    values = {"worker_cls": JUDGE_CLS, "judge_prompt": "Qwen2.5-7B-Instruct-RLVR-prompt", "world_size": 2,
              "judge_model_type": "inference", "device_mapping": [1]}  # fmt: skip
    router = RewardRouter({"llm_judge": RewardConfig.from_dict(values, "rewards.llm_judge")})
    assert router.worker_counts == {}  # its workers are its device_mapping, not CPU reward actors
    with pytest.raises(RuntimeError, match=r"rewards\.llm_judge is graded by a model running as the role"):
        router.grade_many(["x"], [{"ground_truth": "x"}], [1])
