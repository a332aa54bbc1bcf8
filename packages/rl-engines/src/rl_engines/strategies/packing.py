"""Sequence packing: a micro-batch's samples as one row without padding, and the balanced partitions that form them.

A packed micro-batch (:func:`pack`) concatenates each sample's real tokens (its prompt without left padding, its
response without right padding) into one row ``[1, T]``; position ids restart at 0 for every sample, which is how
transformers recognises packed sequences when no attention mask is given (eager / sdpa build a block-diagonal causal
mask, flash-attention-2 runs its varlen kernel), so attention never crosses a sample boundary. The model's outputs
at the rows that predict response tokens go back to the batch's ``[B, R]`` layout with :meth:`PackedBatch.scatter`.
A vision-language micro-batch packs too (:func:`packed_visual_inputs`): its pictures in sample order and each token's
multimodal RoPE position as the model computes it for the padded rows.

``pack(batch, per_sample=True)`` lays the same tokens out one sample per row instead (ROLL's dynamic-batching
layout): each row holds its sample's real tokens from column 0 (with their own positions), padded on the right to
the longest sample (rounded up; the padding's positions are its column numbers). The padding comes after every real
token, so causal attention keeps it out of the real tokens' outputs without a mask; the model gets the rows'
padding mask where something else would see the padding (:func:`needs_padding_mask`). A dynamic-batching pass is
then as wide as its longest sample, not its longest prompt plus its longest response.

:func:`balanced_partitions` is the Karmarkar-Karp largest-differencing heuristic ROLL uses (``load_balance``) to cut
a mini-batch into micro-batches of similar work, by ROLL's workload model (:func:`rl_core.seqlen_balance.workload`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from rl_core.batch import RolloutBatch
from rl_core.seqlen_balance import largest_differencing
from rl_engines.strategies.model_io import (
    is_varlen,
    position_ids_from_mask,
    response_length,
    response_log_probs,
    unwrapped,
)
from rl_engines.strategies.moe import expert_count, text_config
from rl_engines.vision import ROPE_INPUTS, is_visual, token_types, visual_inputs, vl_config


@dataclass(frozen=True)
class PackedBatch:
    """A micro-batch packed into one row, or one row per sample (``per_sample``). ``input_ids`` / ``position_ids``
    ``[rows, T]``; ``segments [rows, T]`` is the sample each token belongs to (-1 for the fill that rounds ``T``
    up). ``rows [N]`` are the packed positions (flat indices into ``[rows * T]``) whose outputs predict a response
    token, ``targets [N]`` those tokens, ``samples [N]`` / ``columns [N]`` where they sit in the ``[B, R]`` layout
    (``shape``)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    segments: torch.Tensor
    rows: torch.Tensor
    targets: torch.Tensor
    samples: torch.Tensor
    columns: torch.Tensor
    shape: tuple[int, int]

    @property
    def tokens(self) -> int:
        """``T``: the length of each packed row (fill included)."""
        return int(self.input_ids.shape[1])

    @property
    def real(self) -> torch.Tensor:
        """``[rows, T]`` True at the samples' tokens, False at the fill (the padding mask of the packed rows)."""
        return self.segments >= 0

    def predicting(self, outputs: torch.Tensor) -> torch.Tensor:
        """``outputs [rows, >= T, ...]`` of the packed rows -> ``[N, ...]``: those that predict the response tokens
        (indexed in place: a non-contiguous ``outputs`` is not copied)."""
        rows = self.rows.to(outputs.device)
        return outputs[rows // self.tokens, rows % self.tokens]

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """``values [N]`` (one per response token) into ``[B, R]``; 0 where a sample has no response token."""
        out = torch.zeros(self.shape, dtype=values.dtype, device=values.device)
        out[self.samples.to(values.device), self.columns.to(values.device)] = values
        return out


def block_causal_mask(segments: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """``segments [B, S]`` (the sample of each token) -> ``[B, S, S]``, True where a query may attend to a key:
    causal, within its own sample, and fewer than ``window`` positions back when a (sliding) window is given."""
    index = torch.arange(segments.shape[1], device=segments.device)
    distance = index.unsqueeze(1) - index.unsqueeze(0)  # query - key
    allowed = (distance >= 0) & (segments.unsqueeze(2) == segments.unsqueeze(1))
    if window is not None:
        allowed &= distance < window
    return allowed


def aligned_width(longest: int, round_to: int, width: int) -> int:
    """The row width of a row-per-sample pass: its longest sample rounded up to a multiple of ``round_to``, at most
    the batch's ``width``."""
    return min(-(-longest // round_to) * round_to, width)


def pack(batch: RolloutBatch, round_to: int = 1, *, per_sample: bool = False) -> PackedBatch:
    """Pack ``batch`` (prompts left-padded, responses right-padded, see model_io) into one row, filled up to a
    multiple of ``round_to`` with a separate run of padding tokens; ``per_sample``: one row per sample, each filled
    up to the longest sample rounded up to ``round_to`` (not past the batch's width), the fill's positions its column
    numbers. Raises when a sample has no prompt token (the first response token would have no position to be
    predicted from) or its position ids do not start at 0 (see :func:`can_pack`)."""
    mask = batch.batch["attention_mask"].to(torch.bool)
    ids = batch.batch["input_ids"]
    total, width = mask.shape[1], response_length(batch)
    refusal = _pack_refusal(batch)
    if refusal is not None:
        raise ValueError(refusal)
    prompt_lengths = mask[:, : total - width].sum(dim=1)
    response_lengths = mask[:, total - width :].sum(dim=1)
    positions = batch.batch["position_ids"] if "position_ids" in batch else position_ids_from_mask(mask)
    flat_ids, flat_positions = ids[mask], positions[mask]
    lengths = prompt_lengths + response_lengths
    starts = lengths.cumsum(0) - lengths
    columns = torch.arange(width).expand(len(lengths), width)
    valid = columns < response_lengths.unsqueeze(1)
    index = torch.arange(len(lengths)).unsqueeze(1)
    samples = index.expand_as(columns)
    if per_sample:
        row_length = aligned_width(int(lengths.max()), round_to, total)
        real = torch.arange(row_length).unsqueeze(0) < lengths.unsqueeze(1)
        starts = torch.arange(len(lengths)) * row_length  # each sample at the start of its own row
        input_ids = ids.new_zeros(real.shape).masked_scatter(real, flat_ids)
        position_ids = torch.arange(row_length, dtype=flat_positions.dtype).repeat(len(lengths), 1)
        position_ids = position_ids.masked_scatter(real, flat_positions)
        segments = torch.where(real, index, -1)
    else:
        fill = -len(flat_ids) % round_to
        input_ids = torch.cat([flat_ids, flat_ids.new_zeros(fill)]).unsqueeze(0)
        position_ids = torch.cat([flat_positions, torch.arange(fill, dtype=flat_positions.dtype)]).unsqueeze(0)
        segments = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        segments = torch.cat([segments, segments.new_full((fill,), -1)]).unsqueeze(0)
    rows = ((starts + prompt_lengths - 1).unsqueeze(1) + columns)[valid]
    return PackedBatch(input_ids=input_ids, position_ids=position_ids, segments=segments, rows=rows,
                       targets=input_ids.flatten()[rows + 1], samples=samples[valid], columns=columns[valid],
                       shape=(len(lengths), width))  # fmt: skip


def can_pack(batch: RolloutBatch) -> bool:
    """Whether :func:`pack` takes ``batch``: every sample has a prompt token, and its position ids (when given)
    are ``[B, T]`` and start at 0."""
    return _pack_refusal(batch) is None


def _pack_refusal(batch: RolloutBatch) -> str | None:
    """Why :func:`pack` cannot take ``batch``, or None."""
    mask = batch.batch["attention_mask"].to(torch.bool)
    if not bool(mask[:, : mask.shape[1] - response_length(batch)].any(dim=1).all()):
        return "sequence packing needs at least one prompt token per sample; a sample has none"
    if "position_ids" not in batch:
        return None
    positions = batch.batch["position_ids"]
    if positions.dim() != 2:
        return f"sequence packing needs [batch, length] position ids; these have shape {tuple(positions.shape)}"
    first = mask.long().argmax(dim=1)  # each sample's first real token
    if not bool((positions.gather(1, first.unsqueeze(1)) == 0).all()):
        return "sequence packing needs position ids that start at 0 for every sample"
    return None


def packed_visual_inputs(
    model: nn.Module, batch: RolloutBatch, packed: PackedBatch, device: torch.device
) -> dict[str, torch.Tensor]:
    """A vision-language micro-batch packed: its pictures' and videos' inputs in sample order (the packed row's pads
    run in the same order), the packed row's token types, and ``position_ids [4, 1, T]``: the packed text positions
    (restarting for every sample: the block-diagonal mask) over the model's multimodal RoPE positions of each real
    token, computed by the model's own ``get_rope_index`` on the padded rows, as an unpacked forward computes them
    (the fill that rounds ``T`` up counts on from 0 in all four)."""
    hf = unwrapped(model)
    visual = visual_inputs(batch, device, hf)  # mm_token_type_ids of the padded rows, for their positions
    mask = batch.batch["attention_mask"].to(device).bool()
    grids = {key: visual[key] for key in ROPE_INPUTS if key in visual}
    rope, _ = hf.model.get_rope_index(batch.batch["input_ids"].to(device), visual["mm_token_type_ids"],
                                      attention_mask=mask.long(), **grids)  # fmt: skip
    fill = packed.tokens - int(mask.sum())
    rope = torch.cat([rope[:, mask], torch.arange(fill, device=device).expand(3, fill)], dim=1)  # [3, T]
    text = packed.position_ids.to(device)  # [1, T]
    visual["mm_token_type_ids"] = token_types(packed.input_ids, vl_config(hf)).to(device)
    return {**visual, "position_ids": torch.cat([text, rope.to(text.dtype)]).unsqueeze(1)}


def balanced_partitions(weights: Sequence[int], parts: int) -> list[list[int]]:
    """Indices of ``weights`` cut into ``parts`` non-empty groups of near-equal sums (Karmarkar-Karp largest
    differencing: repeatedly merge the two partial solutions with the largest spread, the heaviest group of one
    with the lightest of the other). Each group lists its indices ascending; groups come heaviest first."""
    if not 1 <= parts <= len(weights):
        raise ValueError(f"cannot cut {len(weights)} samples into {parts} non-empty micro-batches")
    states = [[(int(weight), [index])] + [(0, []) for _ in range(parts - 1)] for index, weight in enumerate(weights)]
    return _fill_empty(largest_differencing(states), weights)


def _fill_empty(groups: list[list[int]], weights: Sequence[int]) -> list[list[int]]:
    """Move the lightest sample of the most populated group into each empty group (equal weights can leave one)."""
    for group in groups:
        if not group:
            donor = max(groups, key=len)
            lightest = min(donor, key=lambda i: weights[i])
            donor.remove(lightest)
            group.append(lightest)
    return groups


def needs_padding_mask(model: nn.Module) -> bool:
    """Whether a row-per-sample pass must hand ``model`` its padding mask: a mixture-of-experts router's
    load-balancing loss would count the padding, and a flash-attention kernel skips only masked padding. A dense
    model on sdpa or eager attention gets none: causal attention keeps the padding out of every real token's output,
    and the mask would only cost (measured on CPU, the bench_packing model: 8% of a forward, sdpa then running with
    a materialised mask instead of its causal kernel)."""
    hf = unwrapped(getattr(model, "module", model))  # a DeepSpeed engine holds the model as ``module``
    config = getattr(hf, "config", None)
    if config is None:
        return True
    return is_varlen(getattr(config, "_attn_implementation", None)) or expert_count(text_config(hf)) > 0


def packed_outputs(
    model: nn.Module, batch: RolloutBatch, device: torch.device, *, value_head: bool, temperature: float,
    with_entropy: bool, round_to: int = 1, per_sample: bool = False,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """:func:`~rl_engines.strategies.model_io.forward_outputs` of ``batch`` run packed (``per_sample``: a row per
    sample, see :func:`pack`): ``values`` of a value-head model, else ``log_probs`` (and ``entropy``), ``[B, R]``
    each on ``device``, 0 past each sample's response."""
    if per_sample and is_visual(batch):
        raise ValueError("a vision-language batch packs into one row only (its pictures' positions follow it)")
    packed = pack(batch, round_to, per_sample=per_sample)
    inputs = {"input_ids": packed.input_ids.to(device), "position_ids": packed.position_ids.to(device)}
    if per_sample and needs_padding_mask(model):  # right padding: see the module docstring
        inputs["attention_mask"] = packed.real.long().to(device)
    if is_visual(batch):
        inputs.update(packed_visual_inputs(model, batch, packed, device))
    out = model(**inputs, use_cache=False)
    rows = packed.predicting(out.logits)  # [N, V]: the outputs that predict the response tokens
    if value_head:
        return {"values": packed.scatter(rows[:, 0].float())}
    log_probs, entropy = response_log_probs(rows.unsqueeze(0), packed.targets.to(device).unsqueeze(0),
                                            temperature=temperature, with_entropy=with_entropy)  # fmt: skip
    outputs = {"log_probs": packed.scatter(log_probs[0])}
    if entropy is not None:
        outputs["entropy"] = packed.scatter(entropy[0])
    return outputs
