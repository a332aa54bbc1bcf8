"""Multi-turn conversations kept as the exact tokens the model saw and sampled.

An episode's context grows turn by turn: the first prompt is the chat template of ``[system, user_1]`` with the
generation prompt; after the model's response (its sampled token ids, unchanged), the next user turn is appended as
the tokens the template puts between that assistant message and the next generation prompt. Nothing is ever
re-tokenised, so the training sample is token for token what the inference engine generated from, and only the
sampled tokens carry ``response_mask``.

The between-turn text is found by rendering probe conversations with the tokenizer's own template (any template
that renders earlier messages identically when more are appended works, e.g. ChatML / Qwen / Llama 3).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PROBE = "\u2063probe\u2063"
"""A response text no template changes, to locate where assistant content sits in a rendering."""


class ChatTemplateError(ValueError):
    """The tokenizer's chat template does not render conversations append-only."""


def _render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
    return str(text)


@dataclass
class TurnFormatter:
    """Renders first prompts and between-turn continuations with one tokenizer's chat template."""

    tokenizer: Any
    system: str | None
    """The system message of every conversation; None: none."""
    _after_response: str = field(init=False)

    def __post_init__(self) -> None:
        base = [*self._system(), {"role": "user", "content": "u"}]
        prompt = _render(self.tokenizer, base, True)
        closed = _render(self.tokenizer, [*base, {"role": "assistant", "content": PROBE}], False)
        if not closed.startswith(prompt + PROBE):
            raise ChatTemplateError(
                "the tokenizer's chat template does not render an assistant message as generation prompt + content; "
                "multi-turn samples need an append-only template (ChatML / Qwen / Llama 3 style)."
            )
        self._after_response = closed[len(prompt) + len(PROBE) :]  # e.g. "<|im_end|>\n"
        self._closed_probe = closed
        self._base = base

    def first_prompt(self, user: str) -> list[int]:
        """Token ids of ``[system, user]`` plus the generation prompt."""
        messages = [*self._system(), {"role": "user", "content": user}]
        return self._encode(_render(self.tokenizer, messages, True))

    def _system(self) -> list[dict[str, str]]:
        return [] if self.system is None else [{"role": "system", "content": self.system}]

    def continuation(self, eos_text: str, user: str, role: str = "user") -> list[int]:
        """Tokens that follow a response up to the next generation prompt: the end of the assistant message the
        model did not write itself (the whole closing, e.g. ``<|im_end|>\n``, after a truncated response; without
        the end-of-turn token ``eos_text`` the response ended with, if it did), the new message (``role``: ``user``,
        or ``tool`` for a tool's result) and the generation prompt."""
        messages = [*self._base, {"role": "assistant", "content": PROBE}, {"role": role, "content": user}]
        following = _render(self.tokenizer, messages, True)
        if not following.startswith(self._closed_probe):
            raise ChatTemplateError(
                "the tokenizer's chat template renders earlier messages differently once a user turn follows; "
                "multi-turn samples need an append-only template."
            )
        closing = self._after_response
        if eos_text and closing.startswith(eos_text):
            closing = closing[len(eos_text) :]
        return self._encode(closing + following[len(self._closed_probe) :])

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
