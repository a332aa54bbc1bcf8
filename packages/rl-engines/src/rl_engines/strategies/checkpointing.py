"""Checkpoints of a train strategy: sharded model + optimizer, schedule, step and per-rank RNG, written atomically.

Layout of ``<path>/``: ``dcp/`` (torch.distributed.checkpoint: model and optimizer, loadable at another world
size), ``trainer_state.pt`` (scheduler, global step), ``rng_rank<R>.pt``, ``COMPLETE``. Everything is written
into ``<path>.tmp-<step>`` first; rank 0 renames it into place after every rank finished, so a crash never leaves
a half-written checkpoint under the final name. Multi-node jobs need ``path`` on a shared file system.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

COMPLETE_MARKER = "COMPLETE"


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),  # noqa: NPY002  (the legacy global generator is what libraries use)
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])  # noqa: NPY002
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _fsync_tree(root: Path) -> None:
    for file in root.rglob("*"):
        if file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())


def save(strategy: Any, path: str) -> None:
    """Write ``strategy``'s checkpoint to ``path`` (every rank calls; a collective)."""
    final = Path(path)
    tmp = final.with_name(f"{final.name}.tmp-{strategy.global_step}")
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(strategy.model, strategy.optimizer)
    dcp_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "dcp"))
    torch.save(_rng_state(), tmp / f"rng_rank{rank}.pt")
    if rank == 0:
        state = {"scheduler": strategy.scheduler.state_dict(), "global_step": strategy.global_step}
        torch.save(state, tmp / "trainer_state.pt")
        meta = {"role": strategy.role, "world_size": dist.get_world_size(), "global_step": strategy.global_step}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    dist.barrier()
    if rank == 0:
        _fsync_tree(tmp)
        (tmp / COMPLETE_MARKER).touch()
        old = final.with_name(f"{final.name}.old")
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def load(strategy: Any, path: str) -> None:
    """Restore ``strategy`` from ``path``; RNG per rank when the world size matches (else each rank's seed)."""
    root = Path(path)
    if not (root / COMPLETE_MARKER).exists():
        raise FileNotFoundError(
            f"{strategy.role}: {path} is not a complete checkpoint (no {COMPLETE_MARKER} marker). Point "
            "resume_from_checkpoint at a folder written by save_checkpoint; a `.tmp-*` folder is an interrupted save."
        )
    model_sd, optim_sd = get_state_dict(strategy.model, strategy.optimizer)
    dcp_load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(root / "dcp"))  # fills them in place
    set_state_dict(strategy.model, strategy.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    trainer = torch.load(root / "trainer_state.pt", weights_only=False)
    strategy.scheduler.load_state_dict(trainer["scheduler"])
    strategy.global_step = int(trainer["global_step"])
    rng_file = root / f"rng_rank{dist.get_rank()}.pt"
    if rng_file.exists():
        _set_rng_state(torch.load(rng_file, weights_only=False))


def save_hf(strategy: Any, path: str) -> None:
    """Gather full weights to rank 0 and write a HuggingFace folder there, atomically (every rank calls)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state_dict = get_model_state_dict(strategy.model, options=options)
    if dist.get_rank() == 0:
        final = Path(path)
        tmp = final.with_name(f"{final.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        strategy.model.save_pretrained(str(tmp), state_dict=state_dict)
        if strategy.tokenizer is not None:
            strategy.tokenizer.save_pretrained(str(tmp))
        _fsync_tree(tmp)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    dist.barrier()
