"""Multi-turn token bookkeeping: contexts are the template's rendering, token for token, and only sampled tokens
are trained."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from apps.agentic.chat import ChatTemplateError, TurnFormatter
from rl_engines.tiny_model import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tok")
    build_tiny_tokenizer(folder, ["<answer>Up</answer> obs one two grid P _ O G"], vocab_size=300)
    return AutoTokenizer.from_pretrained(str(folder))


def render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    return str(tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False))


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_context_equals_the_rendered_conversation(tokenizer: Any) -> None:
    chat = TurnFormatter(tokenizer, "sys")
    first = chat.first_prompt("obs one")
    assert tokenizer.decode(first) == render(tokenizer, [{"role": "system", "content": "sys"},
                                                         {"role": "user", "content": "obs one"}], True)  # fmt: skip
    response = [*encode(tokenizer, "<answer>Up</answer>"), tokenizer.eos_token_id]  # finished with <|im_end|>
    following = chat.continuation("<|im_end|>", "obs two")
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "obs one"},
                {"role": "assistant", "content": "<answer>Up</answer>"},
                {"role": "user", "content": "obs two"}]  # fmt: skip
    assert tokenizer.decode(first + response + following) == render(tokenizer, messages, True)
    assert following[0] != tokenizer.eos_token_id  # the model's own <|im_end|> is not repeated


def test_truncated_response_is_closed_by_the_template(tokenizer: Any) -> None:
    chat = TurnFormatter(tokenizer, "sys")
    following = chat.continuation("", "obs two")  # a response cut at max_tokens_per_step has no end-of-turn token
    assert following[0] == tokenizer.eos_token_id
    assert tokenizer.decode(following).startswith("<|im_end|>\n<|im_start|>user\nobs two")


def test_non_append_only_template_is_refused(tokenizer: Any) -> None:
    original = tokenizer.chat_template
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"
    try:
        with pytest.raises(ChatTemplateError, match="append-only"):
            TurnFormatter(tokenizer, "sys")
    finally:
        tokenizer.chat_template = original


def test_episode_samples_mask_only_sampled_tokens(tokenizer: Any) -> None:
    from apps.agentic.rollout import Episode, episodes_to_batch

    slot: Any = type("Slot", (), {"tag": "T", "group": 0, "index": 0})()
    long = Episode(slot, seed=3, round_index=0, prompt_ids=[5, 6, 7], tokens=[10, 11, 2, 20, 21, 12, 2],
                   mask=[True, True, True, False, False, True, True], log_probs=[-1, -2, -3, 0, 0, -4, -5],
                   rewards=[0.0, 1.0], valid_actions=2, success=True, finish="stop")  # fmt: skip
    short = Episode(slot, seed=3, round_index=0, prompt_ids=[5, 6], tokens=[13], mask=[True], log_probs=[-0.5],
                    rewards=[-0.1], finish="length")  # fmt: skip
    batch = episodes_to_batch([long, short], pad_id=0)
    assert batch.batch["prompts"].tolist() == [[5, 6, 7], [0, 5, 6]]  # left-padded
    assert batch.batch["responses"][1].tolist() == [13, 0, 0, 0, 0, 0, 0]  # right-padded
    assert batch.batch["response_mask"].tolist() == [[True, True, True, False, False, True, True],
                                                     [True, False, False, False, False, False, False]]  # fmt: skip
    assert batch.batch["attention_mask"].tolist() == [[1] * 10, [0, 1, 1, 1, 0, 0, 0, 0, 0, 0]]
    assert batch.batch["position_ids"][1, 1:4].tolist() == [0, 1, 2]
    torch.testing.assert_close(batch.batch["rollout_log_probs"][0], torch.tensor([-1.0, -2, -3, 0, 0, -4, -5]))
    torch.testing.assert_close(batch.batch["scores"], torch.tensor([1.0, -0.1]))
    assert list(batch.non_tensor_batch["finish_reasons"]) == ["stop", "length"]
    assert list(batch.non_tensor_batch["num_turns"]) == [2, 1]
