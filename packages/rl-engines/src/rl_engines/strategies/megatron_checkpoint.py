"""Checkpoints and HF export of the Megatron strategies, written atomically.

Layout of ``<path>/``: ``mp_rank_<TT>.pt`` (one per tensor-parallel rank, written by data-parallel rank 0: the
rank's model shards and its AdamW state; data-parallel replicas are identical), ``rng_rank<R>.pt`` (every rank),
``trainer_state.pt`` (scheduler, global step), ``meta.json``, ``COMPLETE``. Written into ``<path>.tmp-<step>``
first and renamed by rank 0 after every rank finished. Resuming needs the same tensor_model_parallel_size; to
change it, export with ``save_hf`` (or convert with rl-ckpt) and start from the HF folder.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rl_ckpt.hf_io import ShardedSafetensorsWriter, parse_size
from rl_engines.strategies.checkpointing import (
    load_trainer_state,
    require_complete,
    save_trainer_state,
    write_checkpoint_atomically,
    write_hf_folder_atomically,
)

MAX_SHARD_SIZE = "5GB"


def save(strategy: Any, path: str) -> None:
    """Write ``strategy``'s checkpoint to ``path`` (every rank calls; a collective)."""
    layout = strategy.model.layout

    def write(tmp: Path, rank: int) -> None:
        if strategy.dp_rank == 0:
            masters = {name: value.detach() for name, value in strategy.masters.items()}  # fp32
            state = {"model": masters, "optimizer": strategy.optimizer.state_dict()}
            torch.save(state, tmp / f"mp_rank_{layout.tp_rank:02d}.pt")
        meta = {"role": strategy.role, "tensor_model_parallel_size": layout.tp, "world_size": dist.get_world_size(),
                "global_step": strategy.global_step}  # fmt: skip
        save_trainer_state(strategy, tmp, rank, meta)

    write_checkpoint_atomically(path, strategy.global_step, write)


def load(strategy: Any, path: str) -> None:
    """Restore ``strategy`` from ``path`` (same tensor-parallel size); RNG per rank when the world size matches."""
    root = require_complete(path, strategy.role)
    meta = json.loads((root / "meta.json").read_text())
    layout = strategy.model.layout
    if meta["tensor_model_parallel_size"] != layout.tp:
        raise ValueError(
            f"{strategy.role}: {path} was saved with tensor_model_parallel_size={meta['tensor_model_parallel_size']}"
            f", this run has {layout.tp} ({strategy.role}.strategy_args.strategy_config.tensor_model_parallel_size). "
            "Resume with the same size, or start from a save_hf export of it."
        )
    state = torch.load(root / f"mp_rank_{layout.tp_rank:02d}.pt", map_location=strategy.device, weights_only=True)
    with torch.no_grad():
        for name, value in state["model"].items():
            strategy.masters[name].copy_(value)
    strategy.publish_masters()
    strategy.optimizer.load_state_dict(state["optimizer"])
    load_trainer_state(strategy, root, restore_rng=meta["world_size"] == dist.get_world_size())


def _hf_config(strategy: Any, dtype: torch.dtype) -> Any:
    """The source model's config, marked as a 1-label token classifier for a critic (as HF saves one)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(strategy.config.model_args.model_name_or_path))
    if strategy.model.layout.value_head:
        config.architectures = [config.architectures[0].replace("ForCausalLM", "ForTokenClassification")]
        config.num_labels = 1
    config.dtype = str(dtype).removeprefix("torch.")
    return config


def save_hf(strategy: Any, path: str) -> None:
    """Full HF-named weights (gathered over TP) written by rank 0 as safetensors + config + tokenizer, atomically."""
    weights = strategy.named_weights()  # a generator: every rank must run it, for the TP gathers

    def write(tmp: Path) -> None:
        writer = ShardedSafetensorsWriter(tmp, parse_size(MAX_SHARD_SIZE))
        dtype = torch.float32
        tied = strategy.model.layout.spec.tied_embeddings
        for name, tensor in weights:
            if not (tied and name == "lm_head.weight"):  # HF re-ties it on load
                dtype = tensor.dtype
                writer.add(name, tensor.detach().cpu().clone())
        writer.close()
        _hf_config(strategy, dtype).save_pretrained(str(tmp))
        generation = Path(str(strategy.config.model_args.model_name_or_path)) / "generation_config.json"
        if generation.is_file():
            shutil.copy2(generation, tmp / "generation_config.json")

    if dist.get_rank() == 0:
        write_hf_folder_atomically(path, write, strategy.tokenizer)
    else:
        for _ in weights:  # take part in the gathers rank 0 runs while writing
            pass
    dist.barrier()
