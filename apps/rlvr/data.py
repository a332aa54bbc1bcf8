"""RLVR prompt data: json / jsonl / csv / parquet files with a ``prompt`` or ``messages`` column, the chat template,
and a resumable, seeded sampler.

A record keeps every column of its file (``ground_truth``, ``tag``, ``id`` ...); rewards read them. ``messages`` may
be a list of ``{"role", "content"}`` dicts or its JSON text (ROLL's files store either).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from apps.common.sampler_state import SamplerState

# ROLL names its own templates; a tokenizer's chat template serves all of them here ("native" = the tokenizer's).
KNOWN_TEMPLATES = ("native", "qwen2_5", "qwen2", "qwen3", "chatml", "llama3", "default")
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ROLL's ``chatml`` template: every turn as ``<|im_start|>role``, content, ``<|im_end|>`` and nothing else (no
default system turn, whatever the tokenizer's own template adds)."""
TEMPLATE_OPTIONS: dict[str, dict[str, Any]] = {"qwen3": {"enable_thinking": True}, "chatml": {"chat_template": CHATML}}
"""ROLL's templates that are not the tokenizer's own as it is (``roll/datasets/chat_template.py``): ``qwen3`` turns
thinking on, ``chatml`` is a fixed template; the other names apply the tokenizer's template."""


class DataError(ValueError):
    """A data file or record cannot be used; the message names the file, the row and the key."""


Layout = Callable[[dict[str, Any], str, str], dict[str, Any]]
"""A row, the prompt / messages column to fill and where the row is (for errors) -> the record."""


def record_layout(data_args: dict[str, Any], section: str) -> Layout | None:
    """The record encoding ``data_args.custom_data_kwargs_func`` names (None when unset): ROLL's Video-R1 function
    (apps.rlvr.video_data); any other function is an error naming it."""
    name = data_args.get("custom_data_kwargs_func")
    if name is None:
        return None
    from apps.rlvr.video_data import VIDEO_R1, video_r1_record

    if name != VIDEO_R1:
        raise DataError(
            f"{section}.data_args.custom_data_kwargs_func={name!r}: the RLVR pipeline reads ROLL's {VIDEO_R1!r} "
            "layout only; give the records in the prompt / messages layout instead."
        )
    if data_args.get("prompt") is not None:
        raise DataError(
            f"{section}.data_args.custom_data_kwargs_func={name!r} writes the chat into the messages column (ROLL's "
            "video_r1.yaml: messages: prompt); set data_args.messages, not prompt."
        )
    return video_r1_record


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """All rows of a .json (a list), .jsonl or .csv file, as dicts."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {path} does not exist; check data_args.file_name (paths are relative to the cwd).")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        rows = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if line.strip():
                rows.append(_json_row(line, path, number))
        return rows
    if suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, list) or not all(isinstance(row, dict) for row in data):
            raise DataError(f"{path}: a .json data file must hold a list of objects (one per prompt).")
        return data
    if suffix == ".csv":
        with open(path, newline="", encoding="utf-8") as handle:
            return [dict(row) for row in csv.DictReader(handle)]
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return list(pq.read_table(path).to_pylist())
    raise DataError(f"{path}: unsupported data format {suffix!r}; use .json, .jsonl, .csv or .parquet.")


def _json_row(line: str, path: Path, number: int) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{number}: not valid JSON ({err.msg}).") from None
    if not isinstance(row, dict):
        raise DataError(f"{path}:{number}: each line must be a JSON object, got {type(row).__name__}.")
    return row


def load_records(
    files: str | Sequence[str], *, prompt_key: str | None, messages_key: str | None, layout: Layout | None = None
) -> list[dict[str, Any]]:
    """Records of every file, each checked to have the prompt column (``data_args.prompt`` xor ``.messages``) after
    ``layout`` (a ROLL data function's encoding, :func:`record_layout`) made it."""
    if (prompt_key is None) == (messages_key is None):
        raise DataError(
            "set exactly one of data_args.prompt (a text column) and data_args.messages (a chat column); "
            f"got prompt={prompt_key!r}, messages={messages_key!r}."
        )
    key = str(prompt_key or messages_key)
    records: list[dict[str, Any]] = []
    for file in [files] if isinstance(files, str) else files:
        for index, row in enumerate(read_records(file)):
            if layout is not None:
                row = layout(row, key, f"{file}: row {index}")
            if key not in row:
                raise DataError(f"{file}: row {index} has no column {key!r} (data_args); columns: {sorted(row)}.")
            records.append(_answer_columns(row))
    if not records:
        raise DataError(f"data_args.file_name {files!r} holds no rows.")
    return records


def _answer_columns(record: dict[str, Any]) -> dict[str, Any]:
    """``ground_truth`` from ``reward_model.ground_truth`` and ``tag`` from ``data_source`` where a record has only
    those (the One-RL-to-See-Them-All / verl layout, which ROLL's VLM data encoding maps so); others unchanged."""
    out = dict(record)
    reward_model = record.get("reward_model")
    if "ground_truth" not in out and isinstance(reward_model, dict) and "ground_truth" in reward_model:
        out["ground_truth"] = reward_model["ground_truth"]
    if "tag" not in out and "data_source" in out:
        out["tag"] = out["data_source"]
    return out


def chat_messages(record: dict[str, Any], *, prompt_key: str | None, messages_key: str | None) -> list[dict[str, str]]:
    """The record's conversation: its messages column, or its prompt as one user turn."""
    if prompt_key is not None:
        return [{"role": "user", "content": str(record[prompt_key])}]
    messages = record[str(messages_key)]
    if isinstance(messages, str):
        try:
            messages = json.loads(messages)
        except json.JSONDecodeError:
            raise DataError(
                f"messages column {messages_key!r} holds text that is not JSON: {messages[:80]!r}"
            ) from None
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "content" in m for m in messages):
        raise DataError(f"messages column {messages_key!r} must be a list of {{role, content}} objects.")
    return messages


def prompt_text(messages: list[dict[str, str]], tokenizer: Any, template: str) -> str:
    """The chat-formatted prompt, ending where the assistant's answer starts."""
    if template not in KNOWN_TEMPLATES:
        raise DataError(f"data_args.template={template!r} is not supported; use 'native' (the tokenizer's template).")
    options = TEMPLATE_OPTIONS.get(template, {})
    if "chat_template" not in options and not getattr(tokenizer, "chat_template", None):
        raise DataError("the tokenizer has no chat_template; data_args.template needs one (save it with the model).")
    return str(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **options))


def encode_prompts(
    texts: Sequence[str], tokenizer: Any, prompt_length: int, special_tokens: bool = False
) -> dict[str, torch.Tensor]:
    """Token ids ``[B, P]`` left-padded to the longest prompt, keeping the last ``prompt_length`` tokens of each;
    ``special_tokens``: the tokenizer adds its own (a BOS) to text that is not chat-formatted."""
    ids = [tokenizer(text, add_special_tokens=special_tokens)["input_ids"][-prompt_length:] for text in texts]
    return left_padded(ids, tokenizer)


def left_padded(ids: Sequence[Sequence[int]], tokenizer: Any) -> dict[str, torch.Tensor]:
    """``input_ids`` / ``attention_mask`` ``[B, P]``: each row's tokens at the right, the tokenizer's pad (else its
    EOS) to their left."""
    width = max(len(row) for row in ids)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    input_ids = torch.full((len(ids), width), int(pad), dtype=torch.long)
    attention_mask = torch.zeros((len(ids), width), dtype=torch.long)
    for row, tokens in enumerate(ids):
        if tokens:
            input_ids[row, width - len(tokens) :] = torch.tensor(list(tokens), dtype=torch.long)
            attention_mask[row, width - len(tokens) :] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


class PromptSampler:
    """Batches of record indices, reshuffled each epoch with ``seed + epoch`` (so a resumed run sees the same order)."""

    def __init__(self, size: int, seed: int, state: SamplerState | None = None) -> None:
        if size < 1:
            raise DataError("the prompt set is empty")
        self.size, self.seed = size, seed
        self.state = state or SamplerState()

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng(self.seed + epoch).permutation(self.size)

    def draw(self, count: int) -> tuple[list[int], list[str]]:
        """``count`` indices and a group id for each: the epoch it was drawn in, then the index (a batch that
        crosses into the next epoch can hold a record twice, as two groups)."""
        picks = self._picks(count)
        return [index for _, index in picks], [f"{epoch}:{index}" for epoch, index in picks]

    def next_batch(self, batch_size: int) -> list[int]:
        """The next ``batch_size`` indices; crosses into the next epoch (new order) when one runs out."""
        return [index for _, index in self._picks(batch_size)]

    def _picks(self, count: int) -> list[tuple[int, int]]:
        picked: list[tuple[int, int]] = []
        while len(picked) < count:
            epoch, order = self.state.epoch, self._order(self.state.epoch)
            take = min(count - len(picked), self.size - self.state.position)
            picked += [(epoch, int(i)) for i in order[self.state.position : self.state.position + take]]
            self.state.position += take
            if self.state.position == self.size:
                self.state = SamplerState(self.state.epoch + 1, 0)
        return picked
