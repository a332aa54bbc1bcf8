"""Sampling with a Megatron model through the ``transformers``-style ``generate`` that generation.py drives.

A reference path for tests and small models: every new token recomputes the whole sequence (no KV cache), so it
is O(L^2) in the response length. ROLL's megatron_infer does not generate at all; use vllm / sglang (or hf_infer)
for actor_infer at scale. The tensor- and pipeline-parallel ranks of a model sample in lockstep: each step runs the
whole pipeline forward, the last stage's logits are broadcast to the other stages, and rank 0's draw to all.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from rl_engines.strategies.megatron_model import MegatronModel
from rl_engines.strategies.megatron_ops import gather_vocab
from rl_engines.strategies.megatron_pipeline import broadcast_from_last, run_schedule


def load_generation_config(model_path: str, hf_config: dict[str, Any]) -> Any:
    """The folder's generation_config.json, else EOS / pad ids from config.json."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_path)
    except OSError:
        eos, pad = hf_config.get("eos_token_id"), hf_config.get("pad_token_id")
        return GenerationConfig(eos_token_id=eos, pad_token_id=pad)  # type: ignore[no-untyped-call]


def logits_processors(config: Any) -> Any:
    """transformers' processors for ``config``, in its order: repetition penalty, temperature, top-k, top-p."""
    from transformers import (
        LogitsProcessorList,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    processors = LogitsProcessorList()
    if config.repetition_penalty not in (None, 1.0):
        processors.append(RepetitionPenaltyLogitsProcessor(config.repetition_penalty))
    if config.do_sample:
        if config.temperature not in (None, 1.0):
            processors.append(TemperatureLogitsWarper(config.temperature))
        if config.top_k:
            processors.append(TopKLogitsWarper(config.top_k))
        if config.top_p not in (None, 1.0):
            processors.append(TopPLogitsWarper(config.top_p))
    return processors


class MegatronGenerator:
    """What ``generation.sample_responses`` needs of a model: ``generation_config`` and ``generate``."""

    def __init__(self, model: MegatronModel, generation_config: Any) -> None:
        self.model = model
        self.generation_config = generation_config

    def _next_logits(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary float32 logits ``[rows, V]`` of the token after ``ids [rows, S]`` (on every stage)."""
        model = self.model
        vocab = model.layout.spec.vocab_size
        logits = torch.empty(ids.shape[0], vocab, dtype=torch.float32, device=ids.device)

        def on_output(index: int, micro: Any, out: torch.Tensor) -> None:  # last stage: [rows, S, Vp/tp]
            logits.copy_(gather_vocab(out[:, -1].float(), vocab, model.tp_group))

        def forward(micro: Any, hidden: torch.Tensor | None, chunk: int) -> torch.Tensor:
            return model.run(micro[0], micro[1], hidden, chunk=chunk)

        run_schedule(model.stage, [(ids, mask)], forward, hidden_shape=lambda micro: model.hidden_shape(micro[0]),
                     dtype=model.dtype, device=ids.device, on_output=on_output, train=False)  # fmt: skip
        return broadcast_from_last(model.stage, {"logits": logits})["logits"]

    def _same_on_all_ranks(self, tokens: torch.Tensor) -> torch.Tensor:
        group = self.model.mp_group
        if group is not None and dist.get_world_size(group) > 1:
            dist.broadcast(tokens, src=dist.get_global_rank(group, 0), group=group)
        return tokens

    @torch.no_grad()
    def generate(self, *, input_ids: torch.Tensor, attention_mask: torch.Tensor, generation_config: Any,
                 **ignored: Any) -> SimpleNamespace:  # fmt: skip
        """``sequences [rows, P + L]`` and raw ``logits`` (L tensors ``[rows, V]``), rows = B x num_return_sequences.

        Stops when every row produced an EOS or after ``max_new_tokens``; stop strings (and the ``tokenizer`` in
        ``ignored``) are applied afterwards by generation.py: the tokens before a stop string are the same draws.
        """
        n = generation_config.num_return_sequences
        ids = input_ids.repeat_interleave(n, dim=0)
        mask = attention_mask.bool().repeat_interleave(n, dim=0)
        eos = torch.tensor(generation_config.eos_token_id, device=ids.device)
        processors = logits_processors(generation_config)
        finished = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
        steps: list[torch.Tensor] = []
        for _ in range(generation_config.max_new_tokens):
            logits = self._next_logits(ids, mask)
            steps.append(logits)
            scores = processors(ids, logits.clone())
            if generation_config.do_sample:
                tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
            else:
                tokens = scores.argmax(dim=-1)
            tokens = self._same_on_all_ranks(tokens.masked_fill(finished, generation_config.pad_token_id))
            ids = torch.cat([ids, tokens.unsqueeze(1)], dim=1)
            mask = torch.cat([mask, torch.ones_like(finished).unsqueeze(1)], dim=1)
            finished |= torch.isin(tokens, eos)
            if bool(finished.all()):
                break
        return SimpleNamespace(sequences=ids, logits=tuple(steps))
