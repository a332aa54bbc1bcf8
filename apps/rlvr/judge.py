"""LLM as judge (ROLL's ``LLMJudgeRewardWorker``): a judge model, run by an rl-engines inference strategy as its own
role ``rewards.<name>`` on the section's ``device_mapping``, says whether a response's final answer matches the
reference; score and reward 1 for a yes, 0 otherwise.

For each sample the judge gets one user turn: the ``judge_prompt`` template (``JUDGE_PROMPTS``) filled with the
question (the record's prompt, or the last user turn of its messages), the response and the reference (the record's
``ground_truth``), in the judge tokenizer's chat template (``data_args.template``). It generates with the section's
``generating_args`` on ``infer_batch_size``-sample chunks over its workers; the verdict is ROLL's: "yes" anywhere in
the answer (any case) is a yes, anything else a no. ``judge_model_type: inference`` is the kind built here; ROLL's
``api`` kind (an OpenAI-compatible endpoint) is refused at pre-flight.
"""

from __future__ import annotations

from typing import Any

from apps.rlvr.config import RewardConfig, RewardSpec
from apps.rlvr.data import chat_messages, encode_prompts, prompt_text
from apps.rlvr.rewards import REWARD_FUNCTIONS, ground_truth
from rl_core.batch import RolloutBatch

JUDGE_PROMPTS: dict[str, str] = {
    # The judge of ROLL's RLVR examples (virtuoussy/Qwen2.5-7B-Instruct-RLVR) answers YES or NO to this question.
    "Qwen2.5-7B-Instruct-RLVR-prompt": (
        "Given a problem, decide whether the final answer of the (possibly incomplete) solution below matches the "
        "reference answer. The reference may be a single option letter, a number, an expression, or a list of "
        "answers; it may be in any language, and your judgement must not depend on the language.\n\n"
        "Compare the final output of the solution with the reference answer. Answer YES only if they match "
        "exactly; answer NO if they do not, or if the solution is unclear, incomplete or ambiguous. Reply with "
        "YES or NO and nothing else.\n\n"
        "Question:\n{question}\n\n"
        "Solution (final step):\n{response}\n\n"
        "Reference answer:\n{reference}\n\n"
        "Output:\n"
    ),
}
"""Judge prompt templates by ``judge_prompt`` name, with ``{question}``, ``{response}`` and ``{reference}``; add
your own under a new name."""


def verdict(answer: str) -> float:
    """ROLL's reading of a judge's answer: 1.0 when it says yes (anywhere, any case), else 0.0."""
    return 1.0 if "yes" in answer.lower() else 0.0


def question_of(record: dict[str, Any], prompt_key: str | None, messages_key: str | None) -> str:
    """The question a judge sees: the record's prompt, or the content of its last user turn."""
    turns = chat_messages(record, prompt_key=prompt_key, messages_key=messages_key)
    users = [turn for turn in turns if turn.get("role") == "user"] or turns
    return str(users[-1]["content"])


def check_section(name: str, section: RewardConfig) -> None:
    """Pre-flight: an inference-model judge with a known prompt template and devices of its own."""
    key, spec = f"rewards.{name}", section.spec
    if spec.judge_model_type != "inference":
        raise ValueError(
            f"{key}.judge_model_type={spec.judge_model_type!r}: the judge runs as a local model "
            f"('inference', on {key}.device_mapping with its strategy_args); ROLL's 'api' judge is not built."
        )
    if spec.judge_prompt not in JUDGE_PROMPTS:
        raise ValueError(
            f"{key}.judge_prompt={spec.judge_prompt!r} is not a known judge prompt; known: {sorted(JUDGE_PROMPTS)}. "
            "Add yours to apps.rlvr.judge.JUDGE_PROMPTS."
        )
    if not section.worker.device_mapping:
        raise ValueError(f"{key}.device_mapping is empty: the judge model runs as its own role; give it devices.")
    if not section.worker.model_args.model_name_or_path:
        raise ValueError(f"{key}.model_args.model_name_or_path is not set: name the judge model.")


class Judge:
    """The judge of one reward section, on the started role ``rewards.<name>`` of ``roles``."""

    def __init__(self, name: str, section: RewardConfig, roles: Any, prompt_key: str | None,
                 messages_key: str | None) -> None:  # fmt: skip
        from transformers import AutoTokenizer

        self.role = f"rewards.{name}"
        self.section, self.roles = section, roles
        self.prompt_key, self.messages_key = prompt_key, messages_key
        self.template = JUDGE_PROMPTS[str(section.spec.judge_prompt)]
        self.tokenizer = AutoTokenizer.from_pretrained(str(section.worker.model_args.model_name_or_path))
        self.data_template = str(section.worker.data_args.get("template", "native"))

    def prompts(self, texts: list[str], records: list[dict[str, Any]]) -> list[str]:
        """The judge's chat-formatted prompt for every (response, record)."""
        return [
            prompt_text([{"role": "user", "content": self.template.format(
                question=question_of(record, self.prompt_key, self.messages_key),
                response=text, reference=ground_truth(record),
            )}], self.tokenizer, self.data_template)
            for text, record in zip(texts, records)
        ]  # fmt: skip

    def answers(self, texts: list[str], records: list[dict[str, Any]]) -> list[str]:
        """The judge's answer for every (response, record), in order."""
        if not texts:
            return []
        prompts = self.prompts(texts, records)
        group = self.roles[self.role]
        self.roles.activate(self.role)
        # Generation is split in equal shares over the judge's workers: pad with copies of the last prompt.
        padded = prompts + [prompts[-1]] * (-len(prompts) % group.world_size)
        longest = max(len(self.tokenizer(p, add_special_tokens=False)["input_ids"]) for p in padded)
        batch = RolloutBatch.from_dict(encode_prompts(padded, self.tokenizer, longest), {})
        generating = self.section.worker.generating_args
        out = group.call("generate", batch, generating, dispatch="dp_split")
        responses, mask = out.batch["responses"], out.batch["response_mask"]
        per_prompt = max(1, len(out) // len(padded))  # num_return_sequences copies each: the first one counts
        return [
            str(self.tokenizer.decode(responses[row * per_prompt][mask[row * per_prompt].bool()].tolist(),
                                      skip_special_tokens=True))
            for row in range(len(texts))
        ]  # fmt: skip

    def grade(self, texts: list[str], records: list[dict[str, Any]]) -> list[float]:
        """Every response's verdict, 1.0 or 0.0."""
        return [verdict(answer) for answer in self.answers(texts, records)]


@REWARD_FUNCTIONS.register("llm_judge", "LLMJudgeRewardWorker")
def llm_judge_reward(response: str, record: dict[str, Any], spec: RewardSpec) -> float:
    """Graded by the section's ``Judge`` (``RewardRouter.attach_judges``), never by this function."""
    raise RuntimeError(
        "an LLM-judge section is graded by its judge role (rewards.<name>), which the RLVR pipeline starts; "
        "outside it, build a Judge on started Roles and attach it with RewardRouter.attach_judges."
    )


llm_judge_reward.check_section = check_section  # type: ignore[attr-defined]
llm_judge_reward.needs_role = True  # type: ignore[attr-defined]
