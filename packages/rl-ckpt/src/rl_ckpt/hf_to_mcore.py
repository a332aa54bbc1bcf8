"""HuggingFace -> Megatron-core per-rank checkpoint at a chosen TP x PP (for starting megatron_train from HF).

Streams one rank file at a time: a rank's tensors are planned as views of the HF files (its rows / columns) and
concatenations of them (fused QKV, gate/up), never built in memory: the rank file is written with the bytes
``torch.save`` would write, each tensor's bytes read from the HF files straight into the write buffers.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rl_ckpt.disk_space import output_folder
from rl_ckpt.errors import CheckpointError
from rl_ckpt.experts import split_fused
from rl_ckpt.families import FAMILIES
from rl_ckpt.hf_io import HFCheckpoint
from rl_ckpt.layout import fuse_qkv_parts, padded_vocab_size
from rl_ckpt.mcore_io import RankLayout, iteration_dir_name, save_rank, write_tracker
from rl_ckpt.mcore_merge import check_moe_layout
from rl_ckpt.sources import Source, cat
from rl_ckpt.spec import VISION_MODULE, ModelSpec, mcore_args, spec_from_hf_config, vl_text_name
from rl_ckpt.staged_file import StagingBuffers
from rl_ckpt.stream_io import FileReader


def stage_bounds(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """[start, stop) global layer range of each PP stage: layers split evenly, as megatron does by default."""
    if num_layers % pp:
        raise CheckpointError(f"--pp {pp} does not divide num_hidden_layers={num_layers}; pick a divisor")
    per = num_layers // pp
    return [(s * per, (s + 1) * per) for s in range(pp)]


def check_parallel_sizes(spec: ModelSpec, tp: int, pp: int, vp: int = 1) -> None:
    """Megatron's own divisibility rules for TP, PP and the virtual pipeline, named by the option and config key
    that break them."""
    if tp < 1 or pp < 1 or vp < 1:
        raise CheckpointError(f"--tp {tp} / --pp {pp} / --vp {vp}: each must be >= 1")
    if vp > 1 and pp < 2:
        raise CheckpointError(
            f"--vp {vp} needs --pp >= 2: a virtual pipeline interleaves the model chunks of several pipeline stages "
            "(Megatron's interleaved schedule); set --pp or drop --vp"
        )
    if vp > 1 and spec.num_layers % (pp * vp):
        raise CheckpointError(
            f"--pp {pp} x --vp {vp} = {pp * vp} virtual stages do not divide num_hidden_layers={spec.num_layers}; "
            "pick sizes whose product divides the layers"
        )
    for key, value in (
        ("num_attention_heads", spec.num_attention_heads),
        ("num_key_value_heads", spec.num_query_groups),
        ("intermediate_size", spec.ffn_hidden_size),
    ):
        if value % tp:
            raise CheckpointError(f"--tp {tp} does not divide {key}={value}; pick a TP size that does")
    stage_bounds(spec.num_layers, pp)


def stage_chunks(
    src: HFCheckpoint, spec: ModelSpec, tp: int, tp_rank: int, stage: int, pp: int, vp: int, padded: int,
    ep_rank: int = 0, ep: int = 1,
) -> list[dict[str, Source]]:  # fmt: skip
    """The model chunks of one rank file: with a virtual pipeline of ``vp`` chunks per stage, chunk c of stage s is
    virtual stage c·pp + s (Megatron's interleaved assignment), its layers numbered from 0; one chunk without."""
    bounds = stage_bounds(spec.num_layers, pp * vp)
    return [rank_to_mcore(src, spec, tp, tp_rank, chunk * pp + stage, bounds, padded, ep_rank, ep)
            for chunk in range(vp)]  # fmt: skip


def _checked(src: HFCheckpoint, name: str, shape: tuple[int, ...]) -> None:
    if src.shape(name) != shape:
        raise CheckpointError(f"tensor {name} in {src.path} has shape {src.shape(name)}, config.json implies {shape}")


def _get(src: HFCheckpoint, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    _checked(src, name, shape)
    return src.lazy(name)


def _block(src: HFCheckpoint, name: str, shape: tuple[int, ...], dim: int, tp: int, rank: int) -> torch.Tensor:
    """TP rank ``rank``'s block of ``name`` along ``dim``: a view of the tensor on disk (only it is read)."""
    _checked(src, name, shape)
    if shape[dim] % tp:
        raise CheckpointError(f"{name}: dimension {dim} of shape {shape} does not divide by TP={tp}")
    size = shape[dim] // tp
    return src.lazy(name).narrow(dim, rank * size, size)


def layer_to_mcore(
    src: HFCheckpoint, spec: ModelSpec, layer: int, tp: int, rank: int, ep_rank: int = 0, ep: int = 1
) -> dict[str, Source]:
    """One HF decoder layer -> TP rank ``rank``'s megatron-core tensors (keys after ``decoder.layers.N.``).

    linear_qkv [g*(r+2)*d/tp, H] (this rank's groups: their q heads, k, v); linear_proj [H, nq*d/tp];
    linear_fc1 [2F/tp, H] (this rank's gate rows on its up rows); linear_fc2 [H, F/tp]; norms [H] (q/k norms [d]).
    A MoE layer: the router, expert-parallel rank ``ep_rank``'s experts as SequentialMLP's local experts, Qwen2-MoE's
    shared expert and its gate; each expert split over the TP ranks as the dense MLP is. Each is a plan (views of
    the HF files, concatenated), read when the rank file is written.
    """
    hf = f"model.layers.{layer}."
    h, d, g, nq, f = (
        spec.hidden_size,
        spec.head_dim,
        spec.num_query_groups,
        spec.num_attention_heads,
        spec.ffn_hidden_size,
    )
    out: dict[str, Source] = {}
    for kind, tail in (("weight", (h,)), ("bias", ())) if spec.qkv_bias else (("weight", (h,)),):
        q, k, v = (
            _block(src, f"{hf}self_attn.{n}_proj.{kind}", (rows, *tail), 0, tp, rank)
            for n, rows in (("q", nq * d), ("k", g * d), ("v", g * d))
        )
        out[f"self_attention.linear_qkv.{kind}"] = fuse_qkv_parts(q, k, v, g // tp)
    out["self_attention.linear_proj.weight"] = _block(src, f"{hf}self_attn.o_proj.weight", (h, nq * d), 1, tp, rank)
    if spec.moe:
        out.update(_moe_layer(src, spec, f"model.layers.{layer}.mlp.", (tp, rank), (ep, ep_rank)))
    else:
        gate = _block(src, f"{hf}mlp.gate_proj.weight", (f, h), 0, tp, rank)
        out["mlp.linear_fc1.weight"] = cat([gate, _block(src, f"{hf}mlp.up_proj.weight", (f, h), 0, tp, rank)], 0)
        out["mlp.linear_fc2.weight"] = _block(src, f"{hf}mlp.down_proj.weight", (h, f), 1, tp, rank)
    for hf_name, mcore_name in FAMILIES.get(spec.model_type).layer_norms.items():
        size = d if "q_norm" in hf_name or "k_norm" in hf_name else h
        out[mcore_name] = _get(src, hf + hf_name, (size,))
    return out


def _moe_layer(
    src: HFCheckpoint, spec: ModelSpec, mlp: str, tp_rank: tuple[int, int], ep_rank: tuple[int, int]
) -> dict[str, Source]:
    """A MoE layer's Megatron tensors on TP rank ``tp_rank = (tp, rank)`` and expert-parallel rank ``ep_rank = (ep,
    rank)``: experts ``[rank * E / ep, (rank + 1) * E / ep)`` as local experts 0.., each (and the shared expert) split
    over the TP ranks as a dense MLP (Megatron's expert tensor parallelism at its default size, TP); the router and
    the shared expert's gate replicated."""
    (tp, rank), (ep, expert_rank) = tp_rank, ep_rank
    h, local = spec.hidden_size, spec.num_experts // ep
    out: dict[str, Source] = {"mlp.router.weight": _get(src, f"{mlp}gate.weight", (spec.num_experts, h))}
    parts = [(f"mlp.experts.local_experts.{j}.", f"{mlp}experts.{expert_rank * local + j}.",
              spec.moe_ffn_hidden_size) for j in range(local)]  # fmt: skip
    if spec.moe_shared_expert_ffn_hidden_size:
        parts.append(("mlp.shared_experts.", f"{mlp}shared_expert.", spec.moe_shared_expert_ffn_hidden_size))
        out["mlp.shared_experts.gate_weight"] = _get(src, f"{mlp}shared_expert_gate.weight", (1, h))
    views = _fused_experts(src, spec, mlp) if spec.fused_experts else {}

    def block(name: str, shape: tuple[int, int], dim: int) -> torch.Tensor:
        if name not in views:
            return _block(src, name, shape, dim, tp, rank)
        size = shape[dim] // tp
        return views[name].narrow(dim, rank * size, size)

    for target, source, size in parts:
        gate, up = (block(f"{source}{p}_proj.weight", (size, h), 0) for p in ("gate", "up"))
        out[f"{target}linear_fc1.weight"] = cat([gate, up], 0)
        out[f"{target}linear_fc2.weight"] = block(f"{source}down_proj.weight", (h, size), 1)
    return out


def _fused_experts(src: HFCheckpoint, spec: ModelSpec, mlp: str) -> dict[str, torch.Tensor]:
    """A layer's experts stored as two stacked tensors (:mod:`rl_ckpt.experts`), as per-expert views."""
    views: dict[str, torch.Tensor] = {}
    for proj in ("gate_up_proj", "down_proj"):
        name = f"{mlp}experts.{proj}"
        if name not in src:
            raise CheckpointError(f"tensor {name} is missing from {src.path} (this model type stacks its experts)")
        stacked = src.lazy(name)
        if stacked.shape[0] != spec.num_experts:
            raise CheckpointError(f"tensor {name} in {src.path} stacks {stacked.shape[0]} experts, config.json says "
                                  f"{spec.num_experts}")  # fmt: skip
        views.update(split_fused(name, stacked, spec.hidden_size, spec.moe_ffn_hidden_size) or ())
    return views


def vocab_block(src: HFCheckpoint, name: str, spec: ModelSpec, padded: int, tp: int, rank: int) -> Source:
    """Rank ``rank``'s rows [Vp/tp, H] of the padded vocabulary matrix; rows past V are zero."""
    _checked(src, name, (spec.vocab_size, spec.hidden_size))
    rows = padded // tp
    start = rank * rows
    real = max(min(start + rows, spec.vocab_size) - start, 0)
    table = src.lazy(name)
    parts: list[Source] = [table[start : start + real]] if real else []
    if rows > real:  # megatron never reads them: the tokenizer has no such ids
        parts.append(torch.zeros((rows - real, spec.hidden_size), dtype=table.dtype))
    return cat(parts, 0)


def rank_to_mcore(
    src: HFCheckpoint, spec: ModelSpec, tp: int, rank: int, stage: int, bounds: list[tuple[int, int]], padded: int,
    ep_rank: int = 0, ep: int = 1,
) -> dict[str, Source]:  # fmt: skip
    """The model state dict of TP rank ``rank`` of PP stage ``stage`` (local layer numbers restart at 0) and, for a
    MoE model, expert-parallel rank ``ep_rank`` of ``ep``, planned."""
    state: dict[str, Source] = {}
    if stage == 0:
        embedding = vocab_block(src, "model.embed_tokens.weight", spec, padded, tp, rank)
        state["embedding.word_embeddings.weight"] = embedding
        state.update(vision_tower(src, spec))
    start, stop = bounds[stage]
    for local, layer in enumerate(range(start, stop)):
        for key, tensor in layer_to_mcore(src, spec, layer, tp, rank, ep_rank, ep).items():
            state[f"decoder.layers.{local}.{key}"] = tensor
    if stage == len(bounds) - 1:
        state["decoder.final_layernorm.weight"] = _get(src, "model.norm.weight", (spec.hidden_size,))
        # Tied + PP > 1: megatron's last stage keeps its own copy of the embedding as output_layer.weight.
        head = "model.embed_tokens.weight" if spec.tied_embeddings else "lm_head.weight"
        if not spec.tied_embeddings or len(bounds) > 1:
            state["output_layer.weight"] = vocab_block(src, head, spec, padded, tp, rank)
    return state


def vision_tower(src: HFCheckpoint, spec: ModelSpec) -> dict[str, Source]:
    """A vision-language model's vision tower as ``vision_model.*`` (the first stage holds it whole, on every TP rank:
    ROLL's mcore_adapter layout); empty for a text model."""
    if not spec.vision:
        return {}
    names = (vl_text_name(name) for name in src.weight_map)
    return {f"{VISION_MODULE}.{name.removeprefix('visual.')}": src.lazy(name) for name in names
            if name.startswith("visual.")}  # fmt: skip


def convert_hf_to_mcore(
    hf_path: Path | str,
    out_path: Path | str,
    tp: int = 1,
    pp: int = 1,
    *,
    ep: int = 1,
    vp: int = 1,
    make_vocab_size_divisible_by: int = 128,
    iteration: int = 1,
) -> RankLayout:
    """Write ``out_path/iter_NNNNNNN/mp_rank_XX[_YYY][_ZZZ]/model_optim_rng.pt`` for a HF model folder (``ep``: a MoE
    model's experts split over that many expert-parallel ranks, as Megatron's ``expert_model_parallel_size``;
    ``vp``: Megatron-LM's ``virtual_pipeline_model_parallel_size``, each stage's file holding ``model0`` ...
    ``model{vp-1}``, as Megatron-LM saves an interleaved pipeline).

    Works one rank file at a time: each rank reads only its rows / columns of the HF files, straight into a few
    16 MiB write buffers, so peak memory does not grow with the model. Each rank file stores ``args`` (a dict with
    megatron's argument names plus ``model_type_hf`` and the HF config).
    """
    src = HFCheckpoint(Path(hf_path))
    spec = spec_from_hf_config(src.config)
    src.read_as(vl_text_name)  # a VL model's language model under its text twin's names
    if ep < 1:
        raise CheckpointError(f"--ep {ep}: must be >= 1")
    check_moe_layout(spec, tp, ep, str(hf_path))
    check_parallel_sizes(spec, tp, pp, vp)
    padded = padded_vocab_size(spec.vocab_size, make_vocab_size_divisible_by, tp)
    args = mcore_args(spec, tp, pp, padded, make_vocab_size_divisible_by)
    args.update(hf_generation_config=src.generation_config(), expert_model_parallel_size=ep)
    if vp > 1:  # Megatron-LM's names (it leaves both None without a virtual pipeline)
        per_chunk = spec.num_layers // (pp * vp)
        args.update(virtual_pipeline_model_parallel_size=vp, num_layers_per_virtual_pipeline_stage=per_chunk)
    out = Path(out_path)
    layout = RankLayout(out / iteration_dir_name(iteration), tp, pp, ep)
    buffers = StagingBuffers()
    with output_folder(out), FileReader() as reader:  # a failed conversion leaves no partial output
        for stage in range(pp):
            for ep_rank in range(ep):
                for tp_rank in range(tp):
                    chunks = stage_chunks(src, spec, tp, tp_rank, stage, pp, vp, padded, ep_rank, ep)
                    path = layout.path(tp_rank, stage, ep_rank)
                    save_rank(path, chunks, args, iteration, buffers=buffers, reader=reader)
                    del chunks
        src.release()
        write_tracker(out, iteration)
    return layout
