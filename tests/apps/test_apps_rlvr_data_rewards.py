"""RLVR data loading, chat formatting, the resumable sampler, and verifiable rewards."""

from __future__ import annotations

import dataclasses
import json

import pytest

from apps.common.sampler_state import SamplerState
from apps.rlvr.config import RewardConfig
from apps.rlvr.data import (
    DataError,
    PromptSampler,
    chat_messages,
    encode_prompts,
    load_records,
    prompt_text,
    read_records,
)
from apps.rlvr.rewards import REWARD_FUNCTIONS, Grade, RewardRouter, extract_answer


def test_json_jsonl_and_csv_give_the_same_records(tmp_path):
    rows = [
        {"prompt": "1+1=", "ground_truth": "2", "tag": "math"},
        {"prompt": "2+3=", "ground_truth": "5", "tag": "math"},
    ]
    (tmp_path / "a.json").write_text(json.dumps(rows))
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    (tmp_path / "a.csv").write_text("prompt,ground_truth,tag\n1+1=,2,math\n2+3=,5,math\n")
    for name in ("a.json", "a.jsonl", "a.csv"):
        assert read_records(tmp_path / name) == rows, name
    both = load_records([str(tmp_path / "a.json"), str(tmp_path / "a.csv")], prompt_key="prompt", messages_key=None)
    assert len(both) == 4


@pytest.mark.parametrize(
    ("content", "kwargs", "message"),
    [
        ('{"prompt": "x"}\n{bad', {"prompt_key": "prompt", "messages_key": None}, r"a\.jsonl:2: not valid JSON"),
        ('{"question": "x"}\n', {"prompt_key": "prompt", "messages_key": None}, r"row 0 has no column 'prompt'"),
        ('{"prompt": "x"}\n', {"prompt_key": "prompt", "messages_key": "messages"}, r"set exactly one of"),
        ("", {"prompt_key": "prompt", "messages_key": None}, r"holds no rows"),
    ],
)
def test_bad_data_names_the_file_row_and_key(tmp_path, content, kwargs, message):
    (tmp_path / "a.jsonl").write_text(content)
    with pytest.raises(DataError, match=message):
        load_records(str(tmp_path / "a.jsonl"), **kwargs)
    with pytest.raises(DataError, match=r"does not exist"):
        read_records(tmp_path / "missing.jsonl")


def test_messages_may_be_a_list_or_its_json_text():
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1="}]
    for value in (conversation, json.dumps(conversation)):
        assert chat_messages({"messages": value}, prompt_key=None, messages_key="messages") == conversation
    assert chat_messages({"q": "hi"}, prompt_key="q", messages_key=None) == [{"role": "user", "content": "hi"}]
    with pytest.raises(DataError, match=r"not JSON"):
        chat_messages({"messages": "[oops"}, prompt_key=None, messages_key="messages")


def test_prompts_are_chat_formatted_left_padded_and_left_truncated(tmp_path):
    from transformers import AutoTokenizer

    from rl_engines.tiny_model import build_tiny_tokenizer

    build_tiny_tokenizer(tmp_path, [f"{a}+{b}={a + b}" for a in range(20) for b in range(20)], vocab_size=256)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    texts = [prompt_text([{"role": "user", "content": q}], tokenizer, "native") for q in ("1+1=", "12+13+14=")]
    assert texts[0].endswith("<|im_start|>assistant\n")
    encoded = encode_prompts(texts, tokenizer, prompt_length=1000)
    ids, mask = encoded["input_ids"], encoded["attention_mask"]
    assert ids.shape[0] == 2 and bool(mask[:, -1].all())  # left padding: every row ends with a real token
    assert tokenizer.decode(ids[0][mask[0].bool()]) == texts[0]
    cut = encode_prompts(texts, tokenizer, prompt_length=5)
    assert cut["input_ids"].shape[1] == 5 and tokenizer.decode(cut["input_ids"][1]).endswith("tant\n")  # the tail
    with pytest.raises(DataError, match=r"template='alpaca' is not supported"):
        prompt_text([{"role": "user", "content": "x"}], tokenizer, "alpaca")


def test_sampler_covers_each_epoch_once_and_resumes_exactly():
    sampler = PromptSampler(size=10, seed=3)
    first_epoch = sampler.next_batch(4) + sampler.next_batch(4) + sampler.next_batch(2)
    assert sorted(first_epoch) == list(range(10))
    state = SamplerState(sampler.state.epoch, sampler.state.position)
    expected = [sampler.next_batch(3) for _ in range(5)]
    resumed = PromptSampler(size=10, seed=3, state=state)
    assert [resumed.next_batch(3) for _ in range(5)] == expected
    assert PromptSampler(size=10, seed=4).next_batch(10) != first_epoch


@pytest.mark.parametrize(
    ("response", "truth", "reward"),
    [
        ("so the answer is \\boxed{4}", "4", 1.0),
        ("<answer>0.5</answer>", "\\frac{1}{2}", 1.0),
        ("<answer>13</answer>", "12", 0.0),
        ("I think <answer>1/2</answer>", "0.5", 1.0),
        ("no answer here", "7", 0.0),
    ],
)
def test_math_rule_uses_math_verify(response, truth, reward):
    assert REWARD_FUNCTIONS.get("MathRuleRewardWorker")(response, {"ground_truth": truth}, None) == reward


def test_router_picks_the_reward_by_tag_and_applies_the_length_penalty():
    sections = {  # no section is named math_rule (ROLL's default domain): other tags go to the untagged one
        "math": RewardConfig.from_dict(
            {"worker_cls": "roll.pipeline.rlvr.rewards.math_rule_reward_worker.MathRuleRewardWorker",
             "tag_included": ["gsm8k"], "response_length_penalty_coef": 0.01}, "rewards.math"),
        "exact": RewardConfig.from_dict({"worker_cls": "x.ExactMatchRewardWorker"}, "rewards.exact"),
    }  # fmt: skip
    router = RewardRouter(sections)
    # the penalty comes off the reward the policy is trained on; the score (right or wrong) stays 1
    right = router.grade("<answer>4</answer>", {"tag": "gsm8k", "ground_truth": "4.0"}, 10)
    assert right == Grade(1.0, pytest.approx(0.9))
    assert router.grade("<answer>4.0</answer>", {"tag": "other", "ground_truth": "4"}, 10) == Grade(0.0, 0.0)  # exact
    assert extract_answer("a <answer>1</answer> b <answer>2</answer>") == "2"
    with pytest.raises(ValueError, match=r"rewards\.ground: no reward function .GroundingRewardWorker."):
        RewardRouter({"ground": RewardConfig.from_dict({"worker_cls": "a.GroundingRewardWorker"}, "rewards.ground")})


def test_prompts_longer_than_prompt_length_or_of_five_tokens_or_fewer_are_dropped_as_roll(tmp_path):
    """ROLL's preprocess_dataset keeps 5 < len(input_ids) <= prompt_length; prompts had been cut from the left (a
    long chat prompt lost its system and user headers) and kept."""
    from transformers import AutoTokenizer

    from apps.rlvr.rollout import PromptSource
    from rl_engines.tiny_model import build_tiny_tokenizer

    build_tiny_tokenizer(tmp_path, [f"{a}+{b}={a + b}" for a in range(20) for b in range(20)], vocab_size=256)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    questions = ["1+1=", " ".join(["12+13="] * 40), "2+2="]
    records = [{"messages": [{"role": "user", "content": q}]} for q in questions]
    lengths = [len(tokenizer(prompt_text(r["messages"], tokenizer, "native"), add_special_tokens=False)["input_ids"])
               for r in records]  # fmt: skip
    limit = max(lengths[0], lengths[2])
    assert lengths[1] > limit > 5
    source = PromptSource(records, tokenizer, "native", None, "messages", limit)
    kept, line = source.within_prompt_length("training")
    assert [r["messages"][0]["content"] for r in kept.records] == ["1+1=", "2+2="]
    assert line is not None and "1 of 3 training prompts dropped" in line
    assert len(source.records) == 3  # the source is left as it was
    unchanged, none = PromptSource(records, tokenizer, "native", None, "messages", 10_000).within_prompt_length("x")
    assert none is None and len(unchanged.records) == 3
    with pytest.raises(DataError, match=r"every validation prompt has more than prompt_length=5 tokens or 5 or fewer"):
        PromptSource(records, tokenizer, "native", None, "messages", 5).within_prompt_length("validation")


def test_a_prompt_column_is_tokenized_as_it_is_and_a_messages_column_through_the_template_as_roll(tmp_path):
    """ROLL's RLVR encode_function: the messages column goes through data_args.template, the prompt column to the
    tokenizer as it is (special tokens added: the text is the formatted prompt); preprocess_dataset's length rule
    counts those same tokens, so a short raw prompt is dropped where its templated chat is kept."""
    from transformers import AutoTokenizer

    from apps.rlvr.rollout import PromptSource
    from rl_engines.tiny_model import build_tiny_tokenizer

    build_tiny_tokenizer(tmp_path, [f"{a}+{b}={a + b}" for a in range(20) for b in range(20)], vocab_size=256)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    formatted = prompt_text([{"role": "user", "content": "12+13="}], tokenizer, "native")
    as_chat = PromptSource([{"messages": [{"role": "user", "content": "12+13="}]}], tokenizer, "native", None,
                           "messages", 64)  # fmt: skip
    as_text = PromptSource([{"prompt": formatted}, {"prompt": "1+1="}], tokenizer, "native", "prompt", None, 64)
    chat_ids, text_ids = (
        as_chat.batch([0], ["a"]).batch["input_ids"][0],
        as_text.batch([0], ["b"]).batch["input_ids"][0],
    )
    assert text_ids.tolist() == tokenizer(formatted)["input_ids"]  # no second template around the formatted text
    assert chat_ids.tolist() == tokenizer(formatted, add_special_tokens=False)["input_ids"]
    kept, line = as_text.within_prompt_length("training")
    assert [r["prompt"] for r in kept.records] == [formatted] and line is not None  # "1+1=": 5 tokens or fewer


def test_tag_to_template_formats_each_tags_chats_with_its_own_template_as_roll(tmp_path):
    """ROLL's tag_to_template: a chat whose tag is a key takes that template, any other the data_args.template."""
    from transformers import AutoTokenizer

    from apps.rlvr.rollout import PromptSource
    from rl_engines.tiny_model import build_tiny_tokenizer

    build_tiny_tokenizer(tmp_path, ["1+1=2"], vocab_size=256)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    tokenizer.chat_template = (  # a default system turn, which ROLL's chatml leaves out
        "<|im_start|>system\nYou are a helper.<|im_end|>\n{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
    )
    chat = [{"role": "user", "content": "1+1="}]
    records = [{"tag": "code", "messages": chat}, {"tag": "math", "messages": chat}, {"messages": chat}]
    source = PromptSource(records, tokenizer, "native", None, "messages", 64, tag_templates={"code": "chatml"})
    native, chatml = prompt_text(chat, tokenizer, "native"), prompt_text(chat, tokenizer, "chatml")
    assert native != chatml
    assert source.texts(records) == [chatml, native, native]
    vision = dataclasses.replace(source, image_processor=object())  # ROLL's VLM pipeline reads no tag_to_template
    assert vision.texts(records) == [native] * 3


def test_rolls_chatml_and_qwen3_templates(tmp_path):
    """ROLL's chatml is a fixed template (no default system turn, whatever the tokenizer's own adds) and its qwen3
    turns thinking on; both had applied the tokenizer's template as it is."""
    from transformers import AutoTokenizer

    from rl_engines.tiny_model import build_tiny_tokenizer

    build_tiny_tokenizer(tmp_path, ["1+1=2"], vocab_size=256)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    tokenizer.chat_template = (  # a Qwen-like template: a default system turn, thinking off unless asked
        "<|im_start|>system\nYou are a helper.<|im_end|>\n{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
        "{% if not enable_thinking is defined or not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    )
    turn = [{"role": "user", "content": "1+1="}]
    assert prompt_text(turn, tokenizer, "chatml") == "<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n"
    assert prompt_text(turn, tokenizer, "native").startswith("<|im_start|>system\nYou are a helper.")
    assert prompt_text(turn, tokenizer, "native").endswith("<think>\n\n</think>\n\n")
    assert prompt_text(turn, tokenizer, "qwen3").endswith("<|im_start|>assistant\n")  # thinking on
