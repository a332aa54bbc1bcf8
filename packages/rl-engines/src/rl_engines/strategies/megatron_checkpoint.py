"""Checkpoints and HF export of the Megatron strategies, written atomically.

Layout of ``<path>/``: ``mp_rank_<TT>.pt`` (one per tensor-parallel rank, written by data-parallel rank 0: the
rank's fp32 model shards; data-parallel replicas are identical), ``optim_mp_rank_<TT>_dp_rank_<DDD>.pt`` (AdamW
state by Megatron parameter name: one file per DP rank when use_distributed_optimizer partitions it, else DP rank
0's full copy), ``rng_rank<R>.pt`` (every rank), ``trainer_state.pt`` (scheduler, global step), ``meta.json``,
``COMPLETE``. Under pipeline parallelism each stage writes its own files, tagged ``<TT>_<PPP>`` as Megatron does
(``mp_rank_00_001.pt``: TP rank 0 of stage 1), with its parameters under their local names. Written into
``<path>.tmp-<step>`` first and renamed by rank 0 after every rank finished.

Optimizer state is keyed by name, so a checkpoint resumes at another data-parallel size and with or without
use_distributed_optimizer: each rank memory-maps the partition files of its TP rank and stage and copies only the
entries of the parameters it owns (no rank ever holds the whole state). Resuming needs the same
tensor_model_parallel_size and pipeline_model_parallel_size; to change them, export with ``save_hf`` (or convert
with rl-ckpt) and start from the HF folder.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from itertools import chain
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rl_ckpt.hf_io import ShardedSafetensorsWriter, parse_size
from rl_engines.strategies import lora
from rl_engines.strategies.checkpointing import (
    check_adapters_only,
    load_trainer_state,
    lora_meta,
    require_complete,
    save_trainer_state,
    tensor_bytes,
    write_checkpoint_atomically,
    write_hf_folder_atomically,
)
from rl_engines.strategies.megatron_ops import local_optimizer

MAX_SHARD_SIZE = "5GB"


def save(strategy: Any, path: str) -> None:
    """Write ``strategy``'s checkpoint to ``path`` (every rank calls; a collective)."""
    layout = strategy.model.layout

    partitioned = local_optimizer(strategy.optimizer) is not strategy.optimizer

    def write(tmp: Path, rank: int) -> None:
        if strategy.checkpoint_writer:
            masters = {name: value.detach() for name, value in strategy.masters.items()}  # fp32
            torch.save({"model": masters}, tmp / f"mp_rank_{rank_tag(layout)}.pt")
        if strategy.checkpoint_writer or partitioned:
            torch.save(named_optimizer_state(strategy), tmp / optimizer_file(layout, strategy.dp_rank))
        meta = {"role": strategy.role, "tensor_model_parallel_size": layout.tp,
                "pipeline_model_parallel_size": layout.pp, "expert_model_parallel_size": layout.ep,
                "virtual_pipeline_model_parallel_size": layout.vp, "stage_offsets": list(layout.offsets),
                "world_size": dist.get_world_size(),
                "data_parallel_size": strategy.dp_size, "use_distributed_optimizer": partitioned,
                "global_step": strategy.global_step, **lora_meta(strategy)}  # fmt: skip
        save_trainer_state(strategy, tmp, rank, meta)

    written = tensor_bytes(
        strategy.masters if strategy.checkpoint_writer else {},
        local_optimizer(strategy.optimizer).state if strategy.checkpoint_writer or partitioned else {},
    )
    write_checkpoint_atomically(path, strategy.global_step, write, role=strategy.role, rank_bytes=written)


def load(strategy: Any, path: str) -> None:
    """Restore ``strategy`` from ``path`` (same tensor-, pipeline-, virtual-pipeline- and expert-parallel sizes and
    the same split of the layers over the stages: the files hold each stage's parameters under local names); RNG
    per rank when the world size matches."""
    root = require_complete(path, strategy.role)
    check_adapters_only(strategy, root)
    meta = json.loads((root / "meta.json").read_text())
    layout = strategy.model.layout
    for key, here in (("tensor_model_parallel_size", layout.tp), ("pipeline_model_parallel_size", layout.pp),
                      ("expert_model_parallel_size", layout.ep),
                      ("virtual_pipeline_model_parallel_size", layout.vp)):  # fmt: skip
        if meta.get(key, 1) != here:
            raise ValueError(
                f"{strategy.role}: {path} was saved with {key}={meta.get(key, 1)}, this run has {here} "
                f"({strategy.role}.strategy_args.strategy_config.{key}). Resume with the same size, or start from a "
                "save_hf export of it."
            )
    saved_offsets = meta.get("stage_offsets")
    if saved_offsets is not None and tuple(saved_offsets) != layout.offsets:
        raise ValueError(
            f"{strategy.role}: {path} was saved with its layers split over the virtual pipeline stages at "
            f"{tuple(saved_offsets)}, this run splits them at {layout.offsets} ({strategy.role}.strategy_args."
            "strategy_config.pipeline_model_parallel_layout / account_for_*_in_pipeline_split). Resume with the same "
            "split, or start from a save_hf export of it."
        )
    state = torch.load(root / f"mp_rank_{rank_tag(layout)}.pt", map_location=strategy.device, weights_only=True)
    with torch.no_grad():
        for name, value in state["model"].items():
            strategy.masters[name].copy_(value)
    strategy.publish_masters()
    load_optimizer_state(strategy, root)
    load_trainer_state(strategy, root, restore_rng=meta["world_size"] == dist.get_world_size())


def rank_tag(layout: Any, ep_rank: int | str | None = None) -> str:
    """Megatron's model-parallel rank tag of a file: ``<TT>`` (TP rank), ``<TT>_<PPP>`` under pipeline parallelism,
    then ``_<EEE>`` (expert-parallel rank; ``ep_rank`` another one, or ``"*"`` for a glob) under expert
    parallelism."""
    tag = f"{layout.tp_rank:02d}" if layout.pp == 1 else f"{layout.tp_rank:02d}_{layout.pp_rank:03d}"
    if layout.ep == 1:
        return tag
    ep_rank = layout.ep_rank if ep_rank is None else ep_rank
    return f"{tag}_{ep_rank}" if isinstance(ep_rank, str) else f"{tag}_{ep_rank:03d}"


def optimizer_file(layout: Any, dp_rank: int | None, ep_rank: int | str | None = None) -> str:
    """Name of one optimizer-state partition file of ``layout``'s TP rank and stage (and expert-parallel rank:
    ``ep_rank``, default its own); ``dp_rank`` None gives the glob of all of them."""
    return f"optim_mp_rank_{rank_tag(layout, ep_rank)}_dp_rank_{'*' if dp_rank is None else f'{dp_rank:03d}'}.pt"


def named_optimizer_state(strategy: Any) -> dict[str, Any]:
    """This rank's AdamW state keyed by Megatron parameter name, and the hyper-parameters of its groups (the
    exposed ones, which hold the scheduler's current learning rate)."""
    names = {id(master): name for name, master in strategy.masters.items()}
    state = {names[id(param)]: dict(value) for param, value in local_optimizer(strategy.optimizer).state.items()}
    groups = [{k: v for k, v in group.items() if k != "params"} for group in strategy.optimizer.param_groups]
    return {"state": state, "param_groups": groups}


def load_optimizer_state(strategy: Any, root: Path) -> None:
    """Fill this rank's optimizer from its TP rank's (and stage's) partition files in ``root`` (saved at any DP size,
    partitioned or not): the entries of the parameters this rank owns only. Experts come from the files of this
    rank's expert-parallel rank (other ranks' local experts have the same names); dense tensors from any of them
    (partitioned over all data-parallel ranks, they may have been saved by another expert-parallel rank)."""
    layout = strategy.model.layout
    local = local_optimizer(strategy.optimizer)
    names = {id(master): name for name, master in strategy.masters.items()}
    params = [names[id(param)] for group in local.param_groups for param in group["params"]]
    own = {file.name for file in root.glob(optimizer_file(layout, None))}
    found, groups = {}, []
    for file in sorted(root.glob(optimizer_file(layout, None, "*"))):  # memory-mapped: only entries copied are read
        part = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
        groups = part["param_groups"]
        wanted = {name for name in params if file.name in own or name not in strategy.experts}
        for name in wanted & part["state"].keys():
            found[name] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in part["state"][name].items()}
    if not groups:
        raise ValueError(
            f"{strategy.role}: {root} holds no optimizer state files {optimizer_file(layout, None)} (not a "
            "megatron_train one)"
        )
    if len(groups) != len(local.param_groups):
        raise ValueError(
            f"{strategy.role}: {root} holds optimizer state of {len(groups)} parameter group(s), this run's optimizer "
            f"has {len(local.param_groups)} (a MoE model keeps its dense and expert tensors in two; checkpoints of "
            "MoE models written before that hold one). Resume from a save_hf export of it instead."
        )
    local_groups, start = [], 0  # the saved hyper-parameters over this rank's own parameter indices
    for group, saved in zip(local.param_groups, groups, strict=True):
        local_groups.append({**saved, "params": list(range(start, start + len(group["params"])))})
        start += len(group["params"])
    state = {index: found[name] for index, name in enumerate(params) if name in found}
    local.load_state_dict({"state": state, "param_groups": local_groups})  # casts to each parameter's device
    for group, saved in zip(strategy.optimizer.param_groups, groups, strict=True):
        group.update(saved)  # a partitioned optimizer copies these into its local one at every step


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
    """Full HF-named weights (gathered over TP and stages) written by rank 0 as safetensors + config + tokenizer,
    atomically."""
    weights = strategy.named_weights()  # a generator: every rank must run it, for the TP gathers and PP broadcasts
    adapters = strategy.adapter_weights() if strategy.adapters is not None else iter(())  # then these, alike

    def write(tmp: Path) -> None:
        try:
            _write_hf_weights(strategy, weights, tmp)
            if strategy.adapters is not None:  # LoRA: the merged model here, the adapters alone in adapter/
                _write_adapter(strategy, adapters, tmp / "adapter")
        finally:
            _drain(weights)  # after a failed write too: the other ranks wait in the gathers of the remaining weights
            _drain(adapters)
        generation = Path(str(strategy.config.model_args.model_name_or_path)) / "generation_config.json"
        if generation.is_file():
            shutil.copy2(generation, tmp / "generation_config.json")

    exported = tensor_bytes(strategy.masters) if strategy.dp_rank == 0 else 0  # fp32, one copy of each shard
    write_hf_folder_atomically(path, write, strategy.tokenizer, role=strategy.role, rank_bytes=exported,
                               follow=lambda: _drain(chain(weights, adapters)))  # fmt: skip


def _write_adapter(strategy: Any, adapters: Iterator[tuple[str, torch.Tensor]], folder: Path) -> None:
    """Rank 0: the adapters in PEFT's folder format (what ``rl-ckpt merge-lora`` and peft load)."""
    factors = {name: tensor.detach().cpu().clone() for name, tensor in adapters}
    modules = [name.rsplit(".", 1)[-1] for name in strategy.adapters.adapted]
    base = str(strategy.config.model_args.model_name_or_path)
    lora.write_adapter(folder, factors, lora.peft_config(strategy.config.model_args, modules, base))


def _drain(weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Run the rest of ``weights``: a rank's part of the TP gathers and PP broadcasts rank 0's export drives."""
    for _ in weights:
        pass


def _write_hf_weights(strategy: Any, weights: Iterator[tuple[str, torch.Tensor]], tmp: Path) -> None:
    """Rank 0: the safetensors shards and config.json of an export into ``tmp``."""
    writer = ShardedSafetensorsWriter(tmp, parse_size(MAX_SHARD_SIZE))
    dtype = torch.float32
    tied = strategy.model.layout.spec.tied_embeddings
    for name, tensor in weights:
        if not (tied and name == "lm_head.weight"):  # HF re-ties it on load
            dtype = tensor.dtype
            writer.add(name, tensor.detach().cpu().clone())
    writer.close()
    _hf_config(strategy, dtype).save_pretrained(str(tmp))
