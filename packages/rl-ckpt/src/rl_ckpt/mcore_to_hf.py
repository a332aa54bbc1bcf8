"""Megatron-core checkpoint (per-rank files at any TP x PP, or torch_dist) -> HuggingFace folder, streamed."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from rl_ckpt.disk_space import output_folder
from rl_ckpt.errors import CheckpointError
from rl_ckpt.hf_io import ShardedSafetensorsWriter, copy_tokenizer, parse_size, write_generation_config, write_hf_config
from rl_ckpt.mcore_dist import DistCheckpoint, open_dist_checkpoint
from rl_ckpt.mcore_io import (
    RankLayout,
    check_layout_against_args,
    discover_layout,
    is_dist_dir,
    load_rank,
    rank_args,
    resolve_iteration_dir,
    virtual_stages,
)
from rl_ckpt.mcore_merge import (
    McoreSource,
    StageShards,
    check_moe_layout,
    checkpoint_spec,
    iter_hf_sources,
    iter_hf_tensors,
    layer_sources,
    layer_to_hf,
    merge_expert_ranks,
)
from rl_ckpt.megatron_lora import is_megatron_adapter
from rl_ckpt.sources import dtype_of
from rl_ckpt.spec import ModelSpec, arg

__all__ = [
    "DistCheckpoint",
    "McoreCheckpoint",
    "McoreSource",
    "StageShards",
    "convert_mcore_to_hf",
    "iter_hf_sources",
    "iter_hf_tensors",
    "layer_sources",
    "layer_to_hf",
    "open_mcore_checkpoint",
]


@dataclass(frozen=True)
class McoreCheckpoint:
    """An opened per-rank Megatron checkpoint: where its rank files are, its args, and the model it holds."""

    layout: RankLayout
    args: object
    spec: ModelSpec
    trust_checkpoint: bool = False
    vp: int = 1
    """Model chunks per rank file (Megatron-LM's ``model0``, ``model1``, ... with a virtual pipeline)."""

    @property
    def iteration_dir(self) -> Path:
        """The ``iter_NNNNNNN`` folder."""
        return self.layout.iteration_dir

    def _load(self, tp_rank: int, pp_rank: int, ep_rank: int, chunk: int | None) -> dict[str, torch.Tensor]:
        path = self.layout.path(tp_rank, pp_rank, ep_rank)
        return load_rank(path, self.trust_checkpoint, lazy=True, chunk=chunk)[1]

    def stages(self) -> Iterator[StageShards]:
        """One piece at a time, in layer order: a PP stage's TP ranks' model state dicts, or with a virtual pipeline
        one model chunk (chunk c of stage s is virtual stage c·PP + s, its layers numbered from 0 as a stage's
        are), left on disk (see ``load_rank``); a MoE model's expert-parallel ranks merged into one (experts under
        their global index, :func:`merge_expert_ranks`)."""
        pp, ep = self.layout.pp, self.layout.ep
        local = self.spec.num_experts // ep
        pieces = pp * self.vp
        for k in range(pieces):
            chunk, p = divmod(k, pp)
            which = chunk if self.vp > 1 else None
            paths = [self.layout.path(t, p) for t in range(self.layout.tp)]
            # No local variable keeps the states: the caller's ``del`` must free the stage before the next is read.
            yield StageShards(
                [merge_expert_ranks([self._load(t, p, e, which) for e in range(ep)], local)
                 for t in range(self.layout.tp)],
                paths,
                first=k == 0,
                last=k == pieces - 1,
            )  # fmt: skip


def open_mcore_checkpoint(
    path: Path | str,
    *,
    vocab_size: int | None = None,
    model_type: str | None = None,
    tokenizer_path: Path | str | None = None,
    trust_checkpoint: bool = False,
) -> McoreCheckpoint | DistCheckpoint:
    """Open either format: per-rank files (TP / PP from the folder names; args of rank 0) or torch_dist.

    The model is detected from the args, completed by ``tokenizer_path``'s or the args' ``tokenizer_model``
    config.json (see :func:`rl_ckpt.mcore_merge.checkpoint_spec`); the flags override both.
    """
    if Path(path).is_dir() and is_megatron_adapter(Path(path)):
        raise CheckpointError(
            f"{path} holds the LoRA adapters of a megatron_train run only (meta.json: adapters_only), not a model: "
            f"merge them into the base model with `rl-ckpt merge-lora --base_model_path BASE --adapter_path {path} "
            "--output_path OUT`, or use the run's exported actor_hf/ folder (merged)"
        )
    iteration_dir = resolve_iteration_dir(Path(path))
    if is_dist_dir(iteration_dir):
        return open_dist_checkpoint(
            iteration_dir, vocab_size=vocab_size, model_type=model_type, tokenizer_path=tokenizer_path,
            trust_checkpoint=trust_checkpoint,
        )  # fmt: skip
    layout = discover_layout(iteration_dir)
    args = rank_args(layout.path(0, 0, 0), trust_checkpoint)
    if args is None:
        raise CheckpointError(f"{layout.path(0, 0, 0)} has no 'args'; pass --model_type and the sizes are unknown")
    layout = check_layout_against_args(layout, args)
    spec = checkpoint_spec(args, vocab_size=vocab_size, model_type=model_type, tokenizer_path=tokenizer_path)
    check_moe_layout(spec, layout.tp, layout.ep, str(iteration_dir))
    vp = virtual_stages(args)
    if spec.num_layers % (layout.pp * vp):
        raise CheckpointError(
            f"{iteration_dir}: {spec.num_layers} layers do not split over PP={layout.pp} x virtual pipeline {vp} "
            "(the args' pipeline_model_parallel_size x virtual_pipeline_model_parallel_size); check the args"
        )
    return McoreCheckpoint(layout, args, spec, trust_checkpoint, vp)


def convert_mcore_to_hf(
    ckpt: McoreSource,
    out_path: Path | str,
    *,
    tokenizer_path: Path | str | None = None,
    max_shard_size: str | int = "5GB",
) -> dict[str, str]:
    """Write a HF folder (sharded safetensors + index, config.json, generation / tokenizer files when known).

    No tensor is built in memory: the merge of each tensor is planned (views of the rank files, concatenations) and
    its bytes are read from the rank files straight into the output shard's write buffers. Peak memory: those
    buffers and the plans of one output shard. Returns the index weight map.
    """
    out = Path(out_path)
    with output_folder(out):  # a failed conversion leaves no partial output
        writer = ShardedSafetensorsWriter(out, parse_size(max_shard_size))
        dtype = torch.float32
        for name, tensor in iter_hf_sources(ckpt):
            dtype = dtype_of(tensor)
            writer.add(name, tensor)
            del tensor  # the loop variable would otherwise keep the last tensor of a stage alive into the next
        weight_map = writer.close()
        write_hf_config(out, ckpt.spec, dtype)
        tok = Path(tokenizer_path) if tokenizer_path is not None else None
        write_generation_config(out, arg(ckpt.args, "hf_generation_config"), tok)
        if tok is not None:
            copy_tokenizer(tok, out)
    return weight_map
