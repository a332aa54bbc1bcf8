"""Megatron-core per-rank checkpoint (any TP x PP) -> HuggingFace folder, streamed one PP stage at a time."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from rl_ckpt.errors import CheckpointError
from rl_ckpt.families import FAMILIES
from rl_ckpt.hf_io import (
    ShardedSafetensorsWriter,
    copy_tokenizer,
    parse_size,
    vocab_size_from_tokenizer,
    write_generation_config,
    write_hf_config,
)
from rl_ckpt.layout import split_fc1, split_qkv
from rl_ckpt.mcore_io import RankLayout, check_layout_against_args, discover_layout, load_rank, resolve_iteration_dir
from rl_ckpt.spec import ModelSpec, arg, spec_from_mcore_args

_LAYER_KEY = re.compile(r"decoder\.layers\.(\d+)\.")


@dataclass(frozen=True)
class McoreCheckpoint:
    """An opened Megatron checkpoint: where its rank files are, its args, and the model it holds."""

    layout: RankLayout
    args: object
    spec: ModelSpec
    trust_checkpoint: bool = False


def open_mcore_checkpoint(
    path: Path | str,
    *,
    vocab_size: int | None = None,
    model_type: str | None = None,
    tokenizer_path: Path | str | None = None,
    trust_checkpoint: bool = False,
) -> McoreCheckpoint:
    """Find the rank files (TP / PP from the folder names), read the args of rank 0, detect the model."""
    layout = discover_layout(resolve_iteration_dir(Path(path)))
    args, _ = load_rank(layout.path(0, 0), trust_checkpoint)
    if args is None:
        raise CheckpointError(f"{layout.path(0, 0)} has no 'args'; pass --model_type and the sizes are unknown")
    check_layout_against_args(layout, args)
    if vocab_size is None and tokenizer_path is not None and not arg(args, "vocab_size"):
        vocab_size = vocab_size_from_tokenizer(Path(tokenizer_path))
    spec = spec_from_mcore_args(args, vocab_size, model_type)
    return McoreCheckpoint(layout, args, spec, trust_checkpoint)


class StageShards:
    """The model state dicts of one PP stage's TP ranks, with merging that checks shapes across ranks."""

    def __init__(self, states: list[dict[str, torch.Tensor]], paths: list[Path]) -> None:
        self.states = states
        self.paths = paths

    def shards(self, key: str) -> list[torch.Tensor]:
        """One tensor per TP rank; raises naming the rank file that lacks ``key`` or disagrees in shape."""
        for state, path in zip(self.states, self.paths):
            if key not in state:
                raise CheckpointError(f"tensor {key} is missing from rank file {path}")
        out = [state[key] for state in self.states]
        for t, path in zip(out[1:], self.paths[1:]):
            if t.shape != out[0].shape:
                raise CheckpointError(
                    f"tensor {key} has shape {tuple(out[0].shape)} in {self.paths[0]} but {tuple(t.shape)} in "
                    f"{path}; the rank files come from different models or one is corrupt"
                )
        return out

    def cat(self, key: str, dim: int) -> torch.Tensor:
        """TP shards of ``key`` concatenated along ``dim`` (the only shard itself when TP = 1)."""
        shards = self.shards(key)
        return shards[0] if len(shards) == 1 else torch.cat(shards, dim=dim)

    def num_layers(self) -> int:
        """Number of decoder layers on this stage (local numbering 0..n-1)."""
        found = {int(m.group(1)) for key in self.states[0] if (m := _LAYER_KEY.match(key))}
        if found != set(range(len(found))):
            raise CheckpointError(f"{self.paths[0]}: local layer numbers {sorted(found)} are not 0..n-1")
        return len(found)

    def check(self, t: torch.Tensor, shape: tuple[int, ...], key: str) -> torch.Tensor:
        """``t`` when it has ``shape``; else raise naming the tensor, the rank files and the args."""
        if tuple(t.shape) != shape:
            raise CheckpointError(
                f"tensor {key} from {', '.join(map(str, self.paths))} merges to shape {tuple(t.shape)} but the "
                f"args imply {shape}; the file is corrupt or the args (or --model_type / --vocab_size) are wrong"
            )
        return t


def layer_to_hf(stage: StageShards, spec: ModelSpec, local: int, layer: int) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors of global layer ``layer`` from local layer ``local`` of ``stage``.

    linear_qkv [g*(r+2)*d, H] -> q [nq*d, H], k, v [g*d, H]; linear_fc1 shards [2F/tp, H] -> gate, up [F, H].
    """
    mc, hf = f"decoder.layers.{local}.", f"model.layers.{layer}.self_attn."
    h, d, g, nq, f = (
        spec.hidden_size,
        spec.head_dim,
        spec.num_query_groups,
        spec.num_attention_heads,
        spec.ffn_hidden_size,
    )
    rows = (nq + 2 * g) * d
    for kind, tail in (("weight", (h,)), ("bias", ())) if spec.qkv_bias else (("weight", (h,)),):
        key = f"{mc}self_attention.linear_qkv.{kind}"
        q, k, v = split_qkv(stage.check(stage.cat(key, 0), (rows, *tail), key), g, d)
        yield from ((f"{hf}{n}_proj.{kind}", t) for n, t in (("q", q), ("k", k), ("v", v)))
    key = f"{mc}self_attention.linear_proj.weight"
    yield f"{hf}o_proj.weight", stage.check(stage.cat(key, 1), (h, nq * d), key)
    key = f"{mc}mlp.linear_fc1.weight"
    gate, up = split_fc1([stage.check(s, (2 * f // len(stage.paths), h), key) for s in stage.shards(key)])
    mlp = f"model.layers.{layer}.mlp."
    yield f"{mlp}gate_proj.weight", gate
    yield f"{mlp}up_proj.weight", up
    key = f"{mc}mlp.linear_fc2.weight"
    yield f"{mlp}down_proj.weight", stage.check(stage.cat(key, 1), (h, f), key)
    for hf_name, mc_name in FAMILIES.get(spec.model_type).layer_norms.items():
        size = d if "q_norm" in hf_name or "k_norm" in hf_name else h
        yield f"model.layers.{layer}.{hf_name}", stage.check(stage.shards(mc + mc_name)[0], (size,), mc + mc_name)


def _vocab_rows(stage: StageShards, key: str, spec: ModelSpec) -> torch.Tensor:
    """[Vp, H] merged over TP, trimmed to [V, H]."""
    full = stage.cat(key, 0)
    if full.shape[0] < spec.vocab_size or full.shape[1:] != (spec.hidden_size,):
        stage.check(full, (spec.vocab_size, spec.hidden_size), key)
    return full[: spec.vocab_size]


def iter_hf_tensors(ckpt: McoreCheckpoint) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) in order, holding only one PP stage's rank files at a time."""
    spec, layout = ckpt.spec, ckpt.layout
    offset = 0
    for p in range(layout.pp):
        paths = [layout.path(t, p) for t in range(layout.tp)]
        stage = StageShards([load_rank(path, ckpt.trust_checkpoint)[1] for path in paths], paths)
        if p == 0:
            yield "model.embed_tokens.weight", _vocab_rows(stage, "embedding.word_embeddings.weight", spec)
        n_local = stage.num_layers()
        for local in range(n_local):
            yield from layer_to_hf(stage, spec, local, offset + local)
        offset += n_local
        if p == layout.pp - 1:
            key = "decoder.final_layernorm.weight"
            yield "model.norm.weight", stage.check(stage.shards(key)[0], (spec.hidden_size,), key)
            if not spec.tied_embeddings:
                yield "lm_head.weight", _vocab_rows(stage, "output_layer.weight", spec)
        del stage  # release this stage before the next one is read
    if offset != spec.num_layers:
        raise CheckpointError(
            f"{layout.iteration_dir}: found {offset} layers over all stages, args say {spec.num_layers}"
        )


def convert_mcore_to_hf(
    ckpt: McoreCheckpoint,
    out_path: Path | str,
    *,
    tokenizer_path: Path | str | None = None,
    max_shard_size: str | int = "5GB",
) -> dict[str, str]:
    """Write a HF folder (sharded safetensors + index, config.json, generation / tokenizer files when known).

    Peak memory: one PP stage's rank files (memory-mapped) plus one output shard. Returns the index weight map.
    """
    out = Path(out_path)
    writer = ShardedSafetensorsWriter(out, parse_size(max_shard_size))
    dtype = torch.float32
    for name, tensor in iter_hf_tensors(ckpt):
        dtype = tensor.dtype
        writer.add(name, tensor)
        del tensor  # the loop variable would otherwise keep the last tensor of a stage alive into the next
    weight_map = writer.close()
    write_hf_config(out, ckpt.spec, dtype)
    tok = Path(tokenizer_path) if tokenizer_path is not None else None
    write_generation_config(out, arg(ckpt.args, "hf_generation_config"), tok)
    if tok is not None:
        copy_tokenizer(tok, out)
    return weight_map
