"""Prompt batches for generation and verifiable scores of generated batches; shared by training and validation."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from apps.rlvr.data import DataError, chat_messages, encode_prompts, prompt_text
from apps.rlvr.rewards import RewardRouter
from apps.rlvr.video_data import VIDEO_KEY, VideoOptions
from apps.rlvr.vl_data import QUESTION_TEMPLATE, graded_records, vl_prompt_batch
from rl_core.batch import RolloutBatch
from rl_engines.vision import VISUAL_KEY

MIN_PROMPT_TOKENS = 5
"""ROLL's ``preprocess_dataset`` keeps prompts of more than this many tokens (and at most ``prompt_length``)."""


@dataclass
class PromptSource:
    """Records plus how to turn them into chat prompts."""

    records: list[dict[str, Any]]
    tokenizer: Any
    template: str
    prompt_key: str | None
    messages_key: str | None
    prompt_length: int
    image_processor: Any = None
    """A vision-language model's image processor (:mod:`apps.rlvr.vl_data`); None for a text model."""
    model_type: str | None = None
    """The policy's model type (a vision-language model's rewards read it)."""
    videos: VideoOptions | None = None
    """How the records' videos are sampled (``data_args.video_*``)."""
    tag_templates: dict[str, str] = field(default_factory=dict)
    """ROLL's ``tag_to_template``: the template of a chat whose ``tag`` column is a key, over :attr:`template`."""

    def batch(self, indices: Sequence[int], uids: Sequence[str]) -> RolloutBatch:
        """Left-padded prompts ``[B, P]`` with ``record_index`` and ``prompt_uid`` per sample (and, for a
        vision-language model, each sample's images as the model's visual inputs)."""
        records = [self.records[i] for i in indices]
        texts = self.texts(records)
        columns: dict[str, Any] = {"record_index": list(indices), "prompt_uid": list(uids)}
        if self.image_processor is None:
            if any(record.get(VIDEO_KEY) for record in records):
                raise DataError(f"a record has a {VIDEO_KEY!r} column and the policy is a text model; use a "
                                "vision-language model (Qwen2-VL / Qwen2.5-VL / Qwen3-VL) for video data.")  # fmt: skip
            encoded = encode_prompts(texts, self.tokenizer, self.prompt_length, special_tokens=self.raw)
            return RolloutBatch.from_dict(encoded, columns)
        prompts = vl_prompt_batch(texts, records, self.tokenizer, self.image_processor, self.prompt_length,
                                  self.videos, self.model_type)  # fmt: skip
        return RolloutBatch(prompts.batch, {**prompts.non_tensor_batch, **columns})

    def within_prompt_length(self, what: str) -> tuple[PromptSource, str | None]:
        """These prompts less the ones ROLL's ``preprocess_dataset`` drops: more than ``prompt_length`` tokens, or 5
        or fewer (a text model's chat-formatted prompt; a vision-language model's are kept: ROLL's VL pipeline has
        rules of its own). Returns the source and a log line when any is dropped; raises naming ``prompt_length``
        when none is left. ``what`` names the data in both."""
        if self.image_processor is not None or not self.records:
            return self, None
        texts = self.texts(self.records)
        lengths = [len(ids) for ids in self.tokenizer(texts, add_special_tokens=self.raw)["input_ids"]]
        kept = [r for r, n in zip(self.records, lengths, strict=True) if MIN_PROMPT_TOKENS < n <= self.prompt_length]
        if not kept:
            raise DataError(f"every {what} prompt has more than prompt_length={self.prompt_length} tokens or "
                            f"{MIN_PROMPT_TOKENS} or fewer (the longest {max(lengths)}); ROLL drops those. Raise "
                            "prompt_length.")  # fmt: skip
        if len(kept) == len(self.records):
            return self, None
        line = (
            f"[rlvr] {len(self.records) - len(kept)} of {len(self.records)} {what} prompts dropped, as ROLL drops "
            f"them: more than prompt_length={self.prompt_length} tokens or {MIN_PROMPT_TOKENS} or fewer."
        )
        return replace(self, records=kept), line

    @property
    def raw(self) -> bool:
        """A text model's ``prompt`` column goes to the tokenizer as it is, special tokens added, as ROLL's RLVR
        ``encode_function`` takes it: the data holds the formatted prompt, and ``data_args.template`` applies to a
        ``messages`` column only. (A vision-language model's prompt goes into ROLL's VL question template.)"""
        return self.prompt_key is not None and self.image_processor is None

    def texts(self, records: Sequence[dict[str, Any]]) -> list[str]:
        """What the tokenizer encodes for each record: its prompt as it is (:attr:`raw`), else its conversation
        through the chat template."""
        if self.raw:
            return [str(record[str(self.prompt_key)]) for record in records]
        return [prompt_text(self._messages(record), self.tokenizer, self._template(record)) for record in records]

    def _template(self, record: dict[str, Any]) -> str:
        """The record's tag's template for a text model (ROLL's VLM pipeline reads no ``tag_to_template``)."""
        tag = record.get("tag")
        if tag is None or self.image_processor is not None:
            return self.template
        return self.tag_templates.get(str(tag), self.template)

    def _messages(self, record: dict[str, Any]) -> list[dict[str, str]]:
        messages = chat_messages(record, prompt_key=self.prompt_key, messages_key=self.messages_key)
        if self.image_processor is not None and self.prompt_key is not None:  # ROLL's VLM question template
            messages = [{"role": "user", "content": QUESTION_TEMPLATE.format(Question=messages[0]["content"])}]
        return messages

    def grade(self, rollout: RolloutBatch, router: RewardRouter, step: int = 0, max_steps: int = 0) -> None:
        """Grade every generated response: decoded here, graded by ``router.grade_many`` at once, into the batch's
        ``scores`` ``[B]`` (how right) and ``response_level_rewards`` ``[B]`` (what the policy is trained on)."""
        lengths = [int(length) for length in rollout.batch["response_mask"].sum(dim=-1).tolist()]  # [B]
        texts = self.response_texts(rollout)
        records = self.records_of(rollout)
        if self.image_processor is not None:
            visual = list(rollout.non_tensor_batch.get(VISUAL_KEY, [{}] * len(records)))
            records = graded_records(records, visual, self.image_processor, self.model_type, step, max_steps)
        grades = router.grade_many(texts, records, lengths)
        rollout.batch["scores"] = torch.tensor([g.score for g in grades], dtype=torch.float32)
        rollout.batch["response_level_rewards"] = torch.tensor([g.reward for g in grades], dtype=torch.float32)

    def records_of(self, rollout: RolloutBatch) -> list[dict[str, Any]]:
        """The data record of each sample."""
        return [self.records[int(index)] for index in rollout.non_tensor_batch["record_index"]]

    def response_texts(self, rollout: RolloutBatch) -> list[str]:
        """Each sample's response decoded, special tokens skipped (what the rewards grade)."""
        responses, mask = rollout.batch["responses"], rollout.batch["response_mask"]  # [B, R]
        lengths = [int(length) for length in mask.sum(dim=-1).tolist()]
        return [
            str(self.tokenizer.decode(responses[row, :length].tolist(), skip_special_tokens=True))
            for row, length in enumerate(lengths)
        ]

    def column(self, rollout: RolloutBatch, key: str) -> np.ndarray:
        """Each sample's record value of ``key`` (a data column such as ``difficulty``); names the key if absent."""
        values = []
        for index in rollout.non_tensor_batch["record_index"]:
            record = self.records[int(index)]
            if key not in record:
                raise KeyError(f"data record {int(index)} has no {key!r} column (columns: {sorted(record)}).")
            values.append(record[key])
        return np.asarray(values, dtype=object)
