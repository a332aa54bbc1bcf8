"""``deepspeed_train``'s state: full weights out of ZeRO partitions, atomic checkpoints and HF export.

Checkpoint layout of ``<path>/`` (same contract as ``fsdp2_train``'s): ``deepspeed/state/`` (DeepSpeed's engine
checkpoint: module, ZeRO optimizer partitions, ``zero_to_fp32.py``), ``trainer_state.pt`` (LR scheduler, global
step), ``rng_rank<R>.pt``, ``meta.json``, ``COMPLETE``. Everything goes to ``<path>.tmp-<step>`` first and rank 0
renames it into place after every rank finished; a failed write on any rank removes it on every rank (see
``checkpointing``). DeepSpeed is imported only inside functions.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rl_engines.strategies import lora
from rl_engines.strategies.checkpointing import (
    adapters_only,
    check_adapters_only,
    load_trainer_state,
    lora_meta,
    require_complete,
    save_trainer_state,
    tensor_bytes,
    write_checkpoint_atomically,
    write_hf_folder_atomically,
)

ENGINE_DIR, ENGINE_TAG = "deepspeed", "state"


def iter_full_weights(module: torch.nn.Module, *, fp32_masters: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """Full tensors under the module's state_dict (HF) names; a collective under ZeRO-3 and for masters.

    ``fp32_masters``: return the optimizer's fp32 master copy of each parameter (bf16 / fp16 training keeps the
    module itself in low precision), like ``fsdp2_train`` returns its fp32 parameters. Tied weights are gathered
    once and yielded under each of their names.
    """
    state = module.state_dict(keep_vars=True)
    tied: dict[int, list[str]] = {}
    for name, value in state.items():
        tied.setdefault(id(value), []).append(name)
    for names in tied.values():
        full = _full_tensor(state[names[0]], fp32_masters=fp32_masters)
        for name in names:
            yield name, full


def _full_tensor(value: torch.Tensor, *, fp32_masters: bool) -> torch.Tensor:
    from deepspeed.runtime.zero import GatheredParameters
    from deepspeed.utils import safe_get_full_fp32_param

    if fp32_masters and isinstance(value, torch.nn.Parameter):
        master = safe_get_full_fp32_param(value)
        if master is not None:
            return master.detach()  # type: ignore[no-any-return]
    if hasattr(value, "ds_id"):  # a ZeRO-3 partition: all-gather, copy out, re-partition
        with GatheredParameters([value], modifier_rank=None):
            return value.detach().clone()
    return value.detach()


def save(strategy: Any, path: str) -> None:
    """Write ``strategy``'s checkpoint to ``path`` atomically (every rank calls; a collective)."""

    def write(tmp: Path, rank: int) -> None:
        with deferred_write_errors(strategy.engine) as errors, trained_weights_only(strategy):
            strategy.engine.save_checkpoint(str(tmp / ENGINE_DIR), tag=ENGINE_TAG, save_latest=False,
                                            exclude_frozen_parameters=adapters_only(strategy))  # fmt: skip
        if errors:
            raise errors[0]
        meta = {"role": strategy.role, "world_size": dist.get_world_size(), "zero_stage": strategy.zero_stage,
                "global_step": strategy.global_step,  # the model folder: rl-ckpt finds config.json through it
                "model_name_or_path": str(strategy.config.model_args.model_name_or_path),
                **lora_meta(strategy)}  # fmt: skip
        save_trainer_state(strategy, tmp, rank, meta)

    write_checkpoint_atomically(path, strategy.global_step, write, role=strategy.role,
                                rank_bytes=rank_bytes(strategy.engine))  # fmt: skip


@contextmanager
def trained_weights_only(strategy: Any) -> Iterator[None]:
    """LoRA: the engine's module state while it saves holds the trained weights only. DeepSpeed's
    ``exclude_frozen_parameters`` drops frozen weights by ``named_parameters()``, which names a tied weight once, so
    the second name of a frozen tied weight (``lm_head.weight`` = ``embed_tokens.weight``) would still be written."""
    engine = strategy.engine
    if not adapters_only(strategy):
        yield
        return
    whole = engine.module_state_dict

    def trained(*args: Any, **kwargs: Any) -> dict[str, Any]:
        frozen = {n for n, p in engine.module.named_parameters(remove_duplicate=False) if not p.requires_grad}
        return {name: value for name, value in whole(*args, **kwargs).items() if name not in frozen}

    engine.module_state_dict = trained  # an instance attribute over the method, deleted below
    try:
        yield
    finally:
        del engine.module_state_dict


@contextmanager
def deferred_write_errors(engine: Any) -> Iterator[list[Exception]]:
    """While DeepSpeed saves: a failed file write (its checkpoint engine's ``save``, the copy of its recovery
    scripts) is recorded in the yielded list instead of raised, and the writes after it skipped, so that this rank
    still takes part in the barriers ``engine.save_checkpoint`` runs after them; the caller raises the first one."""
    errors: list[Exception] = []
    writer = engine.checkpoint_engine

    def recorded(write: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> None:
            if not errors:
                try:
                    write(*args, **kwargs)
                except Exception as exc:
                    errors.append(exc)

        return call

    writer.save = recorded(writer.save)  # instance attributes over the class methods, deleted below
    engine._copy_recovery_script = recorded(engine._copy_recovery_script)
    try:
        yield errors
    finally:
        del writer.save, engine._copy_recovery_script


def rank_bytes(engine: Any) -> int:
    """Bytes this rank writes into a checkpoint, about: the module's parameters on rank 0 (which writes the model
    states; a ZeRO-3 partition each) plus the state and parameters (fp32 master partitions) of the optimizer and of
    the optimizers it wraps."""
    found: list[Any] = [list(engine.module.parameters())] if dist.get_rank() == 0 else []
    optimizer = engine.optimizer
    while optimizer is not None:
        found += [list(getattr(optimizer, "state", {}).values())]
        found += [group["params"] for group in getattr(optimizer, "param_groups", [])]
        optimizer = getattr(optimizer, "optimizer", None)
    return tensor_bytes(*found)


def load(strategy: Any, path: str) -> None:
    """Restore a checkpoint written by :func:`save` (same world size and ZeRO stage; RNG per rank)."""
    root = require_complete(path, strategy.role)
    check_adapters_only(strategy, root)
    meta = json.loads((root / "meta.json").read_text())
    here = {"world_size": dist.get_world_size(), "zero_stage": strategy.zero_stage}
    if strategy.zero_stage > 0 and any(meta[key] != value for key, value in here.items()):
        raise ValueError(
            f"{strategy.role}: {path} was written at world size {meta['world_size']} with ZeRO stage "
            f"{meta['zero_stage']}; this run has {here['world_size']} / {here['zero_stage']}. DeepSpeed ZeRO "
            "checkpoints reload only at the layout they were written with; export full weights with save_hf (or "
            f"{ENGINE_DIR}/{ENGINE_TAG}/../zero_to_fp32.py) and start from those."
        )
    loaded, _ = strategy.engine.load_checkpoint(
        str(root / ENGINE_DIR),
        tag=ENGINE_TAG,
        load_optimizer_states=True,
        load_lr_scheduler_states=False,
        load_module_strict=not adapters_only(strategy),  # LoRA: the frozen base comes from model_name_or_path
    )
    if loaded is None:
        raise FileNotFoundError(f"{strategy.role}: DeepSpeed found no engine checkpoint under {root / ENGINE_DIR}.")
    load_trainer_state(strategy, root)


def save_hf(strategy: Any, path: str) -> None:
    """Gather full (fp32 master) weights and write a HuggingFace folder on rank 0, atomically (every rank calls)."""
    rank = dist.get_rank()
    state_dict = {}
    for name, value in strategy.full_weights():
        if rank == 0:
            state_dict[name] = value.to("cpu", copy=True)

    def write(tmp: Path) -> None:
        if adapters_only(strategy):  # the merged model, and the adapters in PEFT's format under adapter/
            lora.write_hf(strategy.engine.module, state_dict, strategy.config.model_args.lora_scale, tmp)
        else:
            strategy.engine.module.save_pretrained(str(tmp), state_dict=state_dict)

    write_hf_folder_atomically(path, write, strategy.tokenizer, role=strategy.role,
                               rank_bytes=tensor_bytes(state_dict))  # fmt: skip
