"""Sampling with ``transformers``' ``generate`` and conversion of its output to the rollout batch layout."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from rl_core.batch import RolloutBatch
from rl_engines.config import GeneratingArgs
from rl_engines.strategies.model_io import position_ids_from_mask, response_log_probs
from rl_engines.vision import placeholder_token_ids, visual_inputs

STOP_CONTEXT_TOKENS = 16
"""Prompt tokens decoded with a response when looking for stop strings that straddle the boundary."""


def _generation_config(model: Any, tokenizer: Any, args: GeneratingArgs) -> Any:
    """A fresh GenerationConfig: nothing inherited from the model's defaults (HF defaults top_k to 50).

    Sampling sets ``top_k`` explicitly (0 = off, so the model's default cannot switch it on). Greedy decoding
    (temperature 0) passes no sampling flag at all: transformers ignores them there (its top-k / top-p / temperature
    processors run only when sampling) and warns "generation flags are not valid and may be ignored: ['top_k']" for
    an explicit ``top_k=0``, so leaving it out changes no token.
    """
    from transformers import GenerationConfig

    eos = eos_token_ids(model, tokenizer)
    pad = pad_token_id(model, tokenizer, eos)
    sample = args.temperature > 0  # a vision-language model never samples its image / video placeholders
    return GenerationConfig(  # type: ignore[no-untyped-call]
        do_sample=sample,
        temperature=args.temperature if sample else None,
        top_p=args.top_p if sample else None,
        top_k=(args.top_k if args.top_k > 0 else 0) if sample else None,
        repetition_penalty=args.repetition_penalty,
        max_new_tokens=args.max_new_tokens,
        num_return_sequences=args.num_return_sequences,
        eos_token_id=eos,
        pad_token_id=pad,
        stop_strings=args.stop_strings or None,
        output_logits=True,
        return_dict_in_generate=True,
        use_cache=True,
        suppress_tokens=placeholder_token_ids(getattr(model, "config", None)) or None,
    )


def eos_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """EOS ids from the model's generation config, falling back to the tokenizer's."""
    found = getattr(model.generation_config, "eos_token_id", None)
    if found is None and tokenizer is not None:
        found = tokenizer.eos_token_id
    if found is None:
        raise ValueError("the model has no eos_token_id (generation_config.json or tokenizer); set one")
    return [int(i) for i in (found if isinstance(found, list) else [found])]


def pad_token_id(model: Any, tokenizer: Any, eos: list[int]) -> int:
    """Pad id: tokenizer's, then the model's, then the first EOS id."""
    for candidate in (getattr(tokenizer, "pad_token_id", None), getattr(model.generation_config, "pad_token_id", None)):
        if candidate is not None:
            return int(candidate)
    return eos[0]


def sample_responses(
    model: Any, tokenizer: Any, batch: RolloutBatch, args: GeneratingArgs, device: torch.device, *, synced: bool = False
) -> RolloutBatch:
    """Generate for one slice of prompts; responses right-padded to ``max_new_tokens``. ``synced``: the model's
    parameters are sharded over the ranks (FSDP), so every rank keeps stepping until all have finished."""
    config = _generation_config(model, tokenizer, args)
    prompts = batch.batch["input_ids"].to(device)
    prompt_mask = batch.batch["attention_mask"].to(device)
    if bool((prompt_mask[:, -1] == 0).any()):
        raise ValueError(
            "prompts must be left-padded (attention_mask[:, -1] is 0 for some rows): decoder-only generation "
            "continues from the last column. Tokenize with padding_side='left'."
        )
    extra: dict[str, Any] = {"tokenizer": tokenizer} if args.stop_strings else {}
    extra.update(visual_inputs(batch, device, model))  # a VL prompt's images (generate repeats them per sample)
    if synced:
        extra["synced_gpus"] = True
    out = model.generate(input_ids=prompts, attention_mask=prompt_mask, generation_config=config, **extra)
    generated = out.sequences[:, prompts.shape[1] :]  # [b*n, L], L <= max_new_tokens
    logits = torch.stack(out.logits, dim=1)  # [b*n, L, V] raw logits, before temperature / top-p / top-k
    log_probs, _ = response_log_probs(logits, generated, temperature=args.temperature or 1.0)
    expanded = prompts.repeat_interleave(args.num_return_sequences, dim=0)
    lengths, reasons = _finish(generated, expanded, tokenizer, args, config)
    return _rollout_batch(batch, generated, log_probs, lengths, reasons, config.pad_token_id, args)


def generate_batch(
    model: Any, tokenizer: Any, batch: RolloutBatch, args: GeneratingArgs, device: torch.device, slice_size: int,
    *, synced: bool = False,
) -> RolloutBatch:  # fmt: skip
    """:func:`sample_responses` over ``slice_size``-prompt slices of ``batch``, with the rank-offset ``args.seed``
    in a forked RNG (data-parallel workers must not draw the same numbers; the caller's stream is untouched)."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        if args.seed is not None:
            torch.manual_seed(args.seed + int(os.environ.get("RANK", "0")))
        parts = [sample_responses(model, tokenizer, micro, args, device, synced=synced)
                 for micro in batch.split(slice_size)]  # fmt: skip
    return RolloutBatch.concat(parts)


def _finish(
    generated: torch.Tensor, prompts: torch.Tensor, tokenizer: Any, args: GeneratingArgs, config: Any
) -> tuple[list[int], list[str]]:
    """Length and finish reason per sequence: through the first EOS, or the first stop string, else all."""
    eos = torch.tensor(config.eos_token_id, device=generated.device)
    is_eos = torch.isin(generated, eos)
    lengths, reasons = [], []
    for row in range(generated.shape[0]):
        hits = torch.nonzero(is_eos[row])
        if len(hits):
            lengths.append(int(hits[0]) + 1)
            reasons.append("stop")
            continue
        stop_at = _stop_string_end(prompts[row], generated[row], tokenizer, args.stop_strings)
        lengths.append(stop_at if stop_at is not None else generated.shape[1])
        reasons.append("stop" if stop_at is not None else "length")
    return lengths, reasons


def _stop_string_end(
    prompt: torch.Tensor, tokens: torch.Tensor, tokenizer: Any, stop_strings: list[str] | None
) -> int | None:
    """Tokens up to the first one after which the text ends with a stop string (transformers' rule: the text
    includes the end of the prompt, so a stop string may straddle the prompt / response boundary)."""
    if not stop_strings or tokenizer is None:
        return None
    tail = prompt[-STOP_CONTEXT_TOKENS:].tolist()
    ids = tokens.tolist()
    for end in range(1, len(ids) + 1):
        text = tokenizer.decode(tail + ids[:end])
        if any(text.endswith(s) for s in stop_strings):
            return end
    return None


def _rollout_batch(
    batch: RolloutBatch,
    generated: torch.Tensor,
    log_probs: torch.Tensor,
    lengths: list[int],
    reasons: list[str],
    pad_id: int,
    args: GeneratingArgs,
) -> RolloutBatch:
    n = args.num_return_sequences
    rows, width = generated.shape[0], args.max_new_tokens
    responses = torch.full((rows, width), pad_id, dtype=torch.long)
    response_mask = torch.zeros((rows, width), dtype=torch.bool)
    rollout_log_probs = torch.zeros((rows, width), dtype=torch.float32)
    for row, length in enumerate(lengths):
        responses[row, :length] = generated[row, :length].cpu()
        response_mask[row, :length] = True
        rollout_log_probs[row, :length] = log_probs[row, :length].cpu()
    prompts = batch.batch["input_ids"].repeat_interleave(n, dim=0)
    prompt_mask = batch.batch["attention_mask"].repeat_interleave(n, dim=0)
    attention_mask = torch.cat([prompt_mask.long(), response_mask.long()], dim=1)
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids_from_mask(attention_mask),
        "response_mask": response_mask,
        "rollout_log_probs": rollout_log_probs,
    }
    others = {key: np.repeat(value, n) for key, value in batch.non_tensor_batch.items()}
    others["finish_reasons"] = np.array(reasons, dtype=object)
    meta = {**batch.meta_info, "temperature": args.temperature or 1.0}
    return RolloutBatch(tensors, others, meta)
