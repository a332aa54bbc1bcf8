"""HuggingFace -> Megatron-core per-rank checkpoint at a chosen TP x PP (for starting megatron_train from HF).

Streams one rank file at a time: a rank's tensors are cut from the memory-mapped HF files (only its rows / columns
are read), fused and copied once, saved, and dropped before the next rank is built.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rl_ckpt.errors import CheckpointError
from rl_ckpt.families import FAMILIES
from rl_ckpt.hf_io import HFCheckpoint
from rl_ckpt.layout import compact, fuse_qkv, padded_vocab_size
from rl_ckpt.mcore_io import RankLayout, iteration_dir_name, save_rank, write_tracker
from rl_ckpt.spec import ModelSpec, mcore_args, spec_from_hf_config


def stage_bounds(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """[start, stop) global layer range of each PP stage: layers split evenly, as megatron does by default."""
    if num_layers % pp:
        raise CheckpointError(f"--pp {pp} does not divide num_hidden_layers={num_layers}; pick a divisor")
    per = num_layers // pp
    return [(s * per, (s + 1) * per) for s in range(pp)]


def check_parallel_sizes(spec: ModelSpec, tp: int, pp: int) -> None:
    """Megatron's own divisibility rules for TP, named by the config key that breaks them."""
    if tp < 1 or pp < 1:
        raise CheckpointError(f"--tp {tp} / --pp {pp}: both must be >= 1")
    for key, value in (
        ("num_attention_heads", spec.num_attention_heads),
        ("num_key_value_heads", spec.num_query_groups),
        ("intermediate_size", spec.ffn_hidden_size),
    ):
        if value % tp:
            raise CheckpointError(f"--tp {tp} does not divide {key}={value}; pick a TP size that does")
    stage_bounds(spec.num_layers, pp)


def _checked(src: HFCheckpoint, name: str, shape: tuple[int, ...]) -> None:
    if src.shape(name) != shape:
        raise CheckpointError(f"tensor {name} in {src.path} has shape {src.shape(name)}, config.json implies {shape}")


def _get(src: HFCheckpoint, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    _checked(src, name, shape)
    return src.get(name)


def _block(src: HFCheckpoint, name: str, shape: tuple[int, ...], dim: int, tp: int, rank: int) -> torch.Tensor:
    """TP rank ``rank``'s block of ``name`` along ``dim``: a view of the memory-mapped file (only it is read)."""
    _checked(src, name, shape)
    if shape[dim] % tp:
        raise CheckpointError(f"{name}: dimension {dim} of shape {shape} does not divide by TP={tp}")
    size = shape[dim] // tp
    start, stop = rank * size, (rank + 1) * size
    return src.get_rows(name, start, stop) if dim == 0 else src.get_columns(name, start, stop)


def layer_to_mcore(src: HFCheckpoint, spec: ModelSpec, layer: int, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """One HF decoder layer -> TP rank ``rank``'s megatron-core tensors (keys after ``decoder.layers.N.``).

    linear_qkv [g*(r+2)*d/tp, H] (this rank's groups: their q heads, k, v); linear_proj [H, nq*d/tp];
    linear_fc1 [2F/tp, H] (this rank's gate rows on its up rows); linear_fc2 [H, F/tp]; norms [H] (q/k norms [d]).
    Each is one fresh compact tensor, copied once from the rank's rows / columns of the HF file.
    """
    hf = f"model.layers.{layer}."
    h, d, g, nq, f = (
        spec.hidden_size,
        spec.head_dim,
        spec.num_query_groups,
        spec.num_attention_heads,
        spec.ffn_hidden_size,
    )
    out: dict[str, torch.Tensor] = {}
    for kind, tail in (("weight", (h,)), ("bias", ())) if spec.qkv_bias else (("weight", (h,)),):
        q, k, v = (
            _block(src, f"{hf}self_attn.{n}_proj.{kind}", (rows, *tail), 0, tp, rank)
            for n, rows in (("q", nq * d), ("k", g * d), ("v", g * d))
        )
        out[f"self_attention.linear_qkv.{kind}"] = fuse_qkv(q, k, v, g // tp)
    o_proj = _block(src, f"{hf}self_attn.o_proj.weight", (h, nq * d), 1, tp, rank)
    out["self_attention.linear_proj.weight"] = compact(o_proj)
    gate = _block(src, f"{hf}mlp.gate_proj.weight", (f, h), 0, tp, rank)
    out["mlp.linear_fc1.weight"] = torch.cat([gate, _block(src, f"{hf}mlp.up_proj.weight", (f, h), 0, tp, rank)])
    out["mlp.linear_fc2.weight"] = compact(_block(src, f"{hf}mlp.down_proj.weight", (h, f), 1, tp, rank))
    for hf_name, mcore_name in FAMILIES.get(spec.model_type).layer_norms.items():
        size = d if "q_norm" in hf_name or "k_norm" in hf_name else h
        out[mcore_name] = _get(src, hf + hf_name, (size,))
    return out


def vocab_block(src: HFCheckpoint, name: str, spec: ModelSpec, padded: int, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s rows [Vp/tp, H] of the padded vocabulary matrix; rows past V are zero."""
    _checked(src, name, (spec.vocab_size, spec.hidden_size))
    rows = padded // tp
    start = rank * rows
    stop = min(start + rows, spec.vocab_size)
    first = src.get_rows(name, 0, 0)
    out = torch.empty((rows, spec.hidden_size), dtype=first.dtype)
    real = max(stop - start, 0)
    if real:
        out[:real] = src.get_rows(name, start, stop)
    out[real:] = 0  # megatron never reads them: the tokenizer has no such ids
    return out


def rank_to_mcore(
    src: HFCheckpoint, spec: ModelSpec, tp: int, rank: int, stage: int, bounds: list[tuple[int, int]], padded: int
) -> dict[str, torch.Tensor]:
    """The model state dict of TP rank ``rank`` of PP stage ``stage`` (local layer numbers restart at 0)."""
    state: dict[str, torch.Tensor] = {}
    if stage == 0:
        embedding = vocab_block(src, "model.embed_tokens.weight", spec, padded, tp, rank)
        state["embedding.word_embeddings.weight"] = embedding
    start, stop = bounds[stage]
    for local, layer in enumerate(range(start, stop)):
        for key, tensor in layer_to_mcore(src, spec, layer, tp, rank).items():
            state[f"decoder.layers.{local}.{key}"] = tensor
    if stage == len(bounds) - 1:
        state["decoder.final_layernorm.weight"] = _get(src, "model.norm.weight", (spec.hidden_size,))
        # Tied + PP > 1: megatron's last stage keeps its own copy of the embedding as output_layer.weight.
        head = "model.embed_tokens.weight" if spec.tied_embeddings else "lm_head.weight"
        if not spec.tied_embeddings or len(bounds) > 1:
            state["output_layer.weight"] = vocab_block(src, head, spec, padded, tp, rank)
    return state


def convert_hf_to_mcore(
    hf_path: Path | str,
    out_path: Path | str,
    tp: int = 1,
    pp: int = 1,
    *,
    make_vocab_size_divisible_by: int = 128,
    iteration: int = 1,
) -> RankLayout:
    """Write ``out_path/iter_NNNNNNN/mp_rank_XX[_YYY]/model_optim_rng.pt`` for a HF model folder.

    Works one rank file at a time: each rank reads only its rows / columns of the memory-mapped HF files, so peak
    memory is about one rank file. Each rank file stores ``args`` (a dict with megatron's argument names plus
    ``model_type_hf`` and the HF config).
    """
    src = HFCheckpoint(Path(hf_path))
    spec = spec_from_hf_config(src.config)
    check_parallel_sizes(spec, tp, pp)
    padded = padded_vocab_size(spec.vocab_size, make_vocab_size_divisible_by, tp)
    args = mcore_args(spec, tp, pp, padded, make_vocab_size_divisible_by)
    args["hf_generation_config"] = src.generation_config()
    out = Path(out_path)
    layout = RankLayout(out / iteration_dir_name(iteration), tp, pp)
    bounds = stage_bounds(spec.num_layers, pp)
    for stage in range(pp):
        for tp_rank in range(tp):
            state = rank_to_mcore(src, spec, tp, tp_rank, stage, bounds, padded)
            save_rank(layout.path(tp_rank, stage), state, args, iteration)
            del state
            src.release()
    write_tracker(out, iteration)
    return layout
