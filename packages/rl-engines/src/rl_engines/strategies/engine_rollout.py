"""What the external inference engines (vLLM, SGLang) share: token lists in, hf_infer's rollout layout out.

Engines take unpadded token-id lists and answer one generated token list (with the sampled tokens' log-probs)
per request. These helpers turn a left-padded prompt batch into such lists, derive one seed per sample, and build
exactly the batch ``hf_infer`` builds (:mod:`rl_engines.strategies.generation`): the same EOS and stop-string
rules decide each response's length and finish reason, so the strategies agree on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rl_core.batch import RolloutBatch
from rl_engines.config import GeneratingArgs
from rl_engines.strategies.generation import _rollout_batch, _stop_string_end
from rl_engines.strategies.model_io import response_length


@dataclass
class EngineModel:
    """What an engine adapter exposes as ``strategy.model``: the engine and the generation config it reads.

    EOS ids are read from ``generation_config`` at every generate call, as hf_infer reads its model's, so changing
    ``strategy.model.generation_config.eos_token_id`` changes where responses end.
    """

    engine: Any
    """``vllm.LLM`` or ``sglang.Engine``."""
    generation_config: Any
    """``transformers.GenerationConfig`` of the model folder."""


def load_generation_config(path: str) -> Any:
    """``generation_config.json`` of the model folder, else one derived from its ``config.json``."""
    from transformers import AutoConfig, GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path)
    except OSError:
        return GenerationConfig.from_model_config(AutoConfig.from_pretrained(path))


@dataclass(frozen=True)
class EngineSample:
    """One finished request of an engine."""

    token_ids: list[int]
    """Generated ids in order; at most ``max_new_tokens``."""
    log_probs: list[float]
    """``log_softmax(logits / temperature)`` at each generated token (one per id)."""
    stopped_by_string: bool = False
    """The engine ended the request at a stop string (its rule may cut later than hf_infer's; see finish)."""


def unpadded_prompts(batch: RolloutBatch) -> list[list[int]]:
    """The real tokens of each left-padded prompt row (``input_ids`` where ``attention_mask`` is 1)."""
    input_ids, mask = batch.batch["input_ids"], batch.batch["attention_mask"]
    if bool((mask[:, -1] == 0).any()):
        raise ValueError(
            "prompts must be left-padded (attention_mask[:, -1] is 0 for some rows): decoder-only generation "
            "continues from the last column. Tokenize with padding_side='left'."
        )
    return [row[keep.bool()].tolist() for row, keep in zip(input_ids, mask)]


def sample_seeds(seed: int | None, rank: int, num_prompts: int, n: int) -> list[int | None]:
    """One seed per sample, prompt-major (the ``n`` samples of a prompt adjacent); all None without a seed.

    Each seed comes from ``(seed + rank, prompt index, sample index)`` through numpy's SeedSequence, so the samples
    of a prompt differ, data-parallel workers (``RANK``) differ as in hf_infer, and a call repeats exactly.
    """
    if seed is None:
        return [None] * (num_prompts * n)
    base = (seed + rank) % 2**63
    return [
        int(np.random.SeedSequence([base, prompt, sample]).generate_state(1)[0])
        for prompt in range(num_prompts)
        for sample in range(n)
    ]


def build_rollout(
    batch: RolloutBatch,
    samples: list[EngineSample],
    args: GeneratingArgs,
    *,
    eos: list[int],
    pad_id: int,
    tokenizer: object,
) -> RolloutBatch:
    """The rollout layout of :func:`rl_engines.strategies.generation.sample_responses` from engine samples.

    ``samples`` are prompt-major (``len(batch) * num_return_sequences``). Each response runs through its first EOS
    (``"stop"``), else through hf_infer's first stop-string end (``"stop"``), else through what the engine made
    (``"stop"`` when the engine cut at a stop string, ``"length"`` otherwise).
    """
    n, width = args.num_return_sequences, args.max_new_tokens
    rows = len(batch) * n
    if len(samples) != rows:
        raise RuntimeError(f"the engine answered {len(samples)} samples for {len(batch)} prompts x {n}")
    prompts = batch.batch["input_ids"].repeat_interleave(n, dim=0)
    generated = torch.full((rows, width), pad_id, dtype=torch.long)  # [B*n, max_new_tokens]
    log_probs = torch.zeros((rows, width), dtype=torch.float32)
    lengths, reasons = [], []
    for row, sample in enumerate(samples):
        ids = sample.token_ids[:width]
        generated[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        log_probs[row, : len(ids)] = torch.tensor(sample.log_probs[: len(ids)], dtype=torch.float32)
        length, reason = _finish(ids, sample.stopped_by_string, prompts[row], eos, tokenizer, args)
        lengths.append(length)
        reasons.append(reason)
    return _rollout_batch(batch, generated, log_probs, lengths, reasons, pad_id, args)


def _finish(
    ids: list[int], by_string: bool, prompt: torch.Tensor, eos: list[int], tokenizer: object, args: GeneratingArgs
) -> tuple[int, str]:
    """(length, finish reason) of one response under hf_infer's rules."""
    stops = set(eos)
    for index, token in enumerate(ids):
        if token in stops:
            return index + 1, "stop"
    end = _stop_string_end(prompt, torch.tensor(ids, dtype=torch.long), tokenizer, args.stop_strings)
    if end is not None:
        return end, "stop"
    return len(ids), "stop" if by_string else "length"


def scoring_sequences(batch: RolloutBatch) -> tuple[list[list[int]], list[int]]:
    """Per row: the unpadded prompt followed by the attended response tokens, and how many response tokens.

    The response tokens are ``responses[row, :L]`` with ``L`` the attended (``attention_mask``) response columns,
    which must be a prefix of the row (right padding), as the rollout layout has them.
    """
    width = response_length(batch)
    mask = batch.batch["attention_mask"].bool()
    prompt_width = mask.shape[1] - width
    sequences, lengths = [], []
    for row in range(len(batch)):
        response_mask = mask[row, prompt_width:]
        length = int(response_mask.sum())
        if not bool(response_mask[:length].all()):
            raise ValueError(
                f"row {row}: the attended response tokens are not a prefix of the response (attention_mask has a "
                "hole); engine scoring needs right-padded responses."
            )
        prompt = batch.batch["input_ids"][row, :prompt_width][mask[row, :prompt_width]]
        sequences.append(prompt.tolist() + batch.batch["responses"][row, :length].tolist())
        lengths.append(length)
    return sequences, lengths


def log_probs_tensor(values: list[list[float]], width: int) -> torch.Tensor:
    """Right-pad per-row log-prob lists with zeros into ``[B, width]`` float32."""
    out = torch.zeros((len(values), width), dtype=torch.float32)
    for row, row_values in enumerate(values):
        out[row, : len(row_values)] = torch.tensor(row_values, dtype=torch.float32)
    return out
