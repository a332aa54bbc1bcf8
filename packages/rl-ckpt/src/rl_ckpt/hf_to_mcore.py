"""HuggingFace -> Megatron-core per-rank checkpoint at a chosen TP x PP (for starting megatron_train from HF)."""

from __future__ import annotations

from pathlib import Path

import torch

from rl_ckpt.errors import CheckpointError
from rl_ckpt.families import FAMILIES
from rl_ckpt.hf_io import HFCheckpoint
from rl_ckpt.layout import fuse_fc1, fuse_qkv, pad_rows, padded_vocab_size, split
from rl_ckpt.mcore_io import RankLayout, iteration_dir_name, save_rank, write_tracker
from rl_ckpt.spec import ModelSpec, mcore_args, spec_from_hf_config

Shards = dict[str, list[torch.Tensor]]  # mcore key -> one tensor per TP rank


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


def _get(src: HFCheckpoint, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    t = src.get(name)
    if tuple(t.shape) != shape:
        raise CheckpointError(f"tensor {name} in {src.path} has shape {tuple(t.shape)}, config.json implies {shape}")
    return t


def layer_to_mcore(src: HFCheckpoint, spec: ModelSpec, layer: int, tp: int) -> Shards:
    """One HF decoder layer -> megatron-core tensors (keys after ``decoder.layers.N.``), one per TP rank.

    linear_qkv [g*(r+2)*d/tp, H] per rank; linear_proj [H, nq*d/tp]; linear_fc1 [2F/tp, H]; linear_fc2 [H, F/tp];
    norms [H] (q/k norms [d]) replicated.
    """
    hf = f"model.layers.{layer}."
    h, d, g, nq, f = (
        spec.hidden_size,
        spec.head_dim,
        spec.num_query_groups,
        spec.num_attention_heads,
        spec.ffn_hidden_size,
    )
    out: Shards = {}
    for kind, tail in (("weight", (h,)), ("bias", ())) if spec.qkv_bias else (("weight", (h,)),):
        q = _get(src, f"{hf}self_attn.q_proj.{kind}", (nq * d, *tail))
        k = _get(src, f"{hf}self_attn.k_proj.{kind}", (g * d, *tail))
        v = _get(src, f"{hf}self_attn.v_proj.{kind}", (g * d, *tail))
        out[f"self_attention.linear_qkv.{kind}"] = split(fuse_qkv(q, k, v, g), tp, 0, f"{hf}qkv")
    out["self_attention.linear_proj.weight"] = split(_get(src, f"{hf}self_attn.o_proj.weight", (h, nq * d)), tp, 1, "o")
    gate = _get(src, f"{hf}mlp.gate_proj.weight", (f, h))
    out["mlp.linear_fc1.weight"] = fuse_fc1(gate, _get(src, f"{hf}mlp.up_proj.weight", (f, h)), tp)
    out["mlp.linear_fc2.weight"] = split(_get(src, f"{hf}mlp.down_proj.weight", (h, f)), tp, 1, "down_proj")
    for hf_name, mcore_name in FAMILIES.get(spec.model_type).layer_norms.items():
        size = d if "q_norm" in hf_name or "k_norm" in hf_name else h
        out[mcore_name] = [_get(src, hf + hf_name, (size,))] * tp
    return out


def stage_to_mcore(
    src: HFCheckpoint, spec: ModelSpec, tp: int, stage: int, bounds: list[tuple[int, int]], padded_vocab: int
) -> list[dict[str, torch.Tensor]]:
    """The model state dicts of one PP stage's TP ranks (local layer numbers restart at 0 on every stage)."""
    ranks: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]

    def put(key: str, shards: list[torch.Tensor]) -> None:
        for rank, shard in zip(ranks, shards):
            rank[key] = shard

    vocab_shape = (spec.vocab_size, spec.hidden_size)
    if stage == 0:
        emb = pad_rows(_get(src, "model.embed_tokens.weight", vocab_shape), padded_vocab)
        put("embedding.word_embeddings.weight", split(emb, tp, 0, "embed_tokens"))
    start, stop = bounds[stage]
    for local, layer in enumerate(range(start, stop)):
        for key, shards in layer_to_mcore(src, spec, layer, tp).items():
            put(f"decoder.layers.{local}.{key}", shards)
    if stage == len(bounds) - 1:
        put("decoder.final_layernorm.weight", [_get(src, "model.norm.weight", (spec.hidden_size,))] * tp)
        # Tied + PP > 1: megatron's last stage keeps its own copy of the embedding as output_layer.weight.
        head = "model.embed_tokens.weight" if spec.tied_embeddings else "lm_head.weight"
        if not spec.tied_embeddings or len(bounds) > 1:
            put("output_layer.weight", split(pad_rows(_get(src, head, vocab_shape), padded_vocab), tp, 0, head))
    return ranks


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

    Works one PP stage at a time: peak memory is about one stage's tensors (all its TP shards). Each rank file
    stores ``args`` (a dict with megatron's argument names plus ``model_type_hf`` and the HF config).
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
        ranks = stage_to_mcore(src, spec, tp, stage, bounds, padded)
        for tp_rank, model in enumerate(ranks):
            save_rank(layout.path(tp_rank, stage), model, args, iteration)
        del ranks
    write_tracker(out, iteration)
    return layout
