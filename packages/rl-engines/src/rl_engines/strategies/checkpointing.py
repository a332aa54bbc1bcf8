"""Checkpoints of a train strategy: sharded model + optimizer, schedule, step and per-rank RNG, written atomically.

Layout of ``<path>/``: ``dcp/`` (torch.distributed.checkpoint: model and optimizer, loadable at another world
size), ``trainer_state.pt`` (scheduler, global step), ``rng_rank<R>.pt``, ``COMPLETE``. Everything is written
into ``<path>.tmp-<step>`` first; rank 0 renames it into place after every rank finished, so a crash never leaves
a half-written checkpoint under the final name. Multi-node jobs need ``path`` on a shared file system.

The atomic folder, trainer state and RNG helpers here are shared by every train strategy (deepspeed_state and
megatron_checkpoint write their engine's own files through :func:`write_checkpoint_atomically`).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
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


def rng_state() -> dict[str, Any]:
    """This process's torch / Python / NumPy (and CUDA, when present) generator states, for ``rng_rank<R>.pt``."""
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),  # noqa: NPY002  (the legacy global generator is what libraries use)
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned (the CUDA state only where there is a GPU)."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])  # noqa: NPY002
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def fsync_tree(root: Path) -> None:
    """Flush every file under ``root`` to disk (before a rename publishes the folder)."""
    for file in root.rglob("*"):
        if file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())


def write_checkpoint_atomically(path: str, step: int, write_fn: Callable[[Path, int], None]) -> None:
    """Every rank calls ``write_fn(tmp, rank)`` on ``<path>.tmp-<step>``; then rank 0 publishes it (a collective).

    After every rank finished, rank 0 fsyncs the folder, marks it ``COMPLETE``, moves an existing ``path`` to
    ``<path>.old``, renames the temporary folder to ``path`` and removes ``.old``: a crash leaves either the old
    checkpoint or the new one under ``path``, never a half-written one.
    """
    final = Path(path)
    tmp = final.with_name(f"{final.name}.tmp-{step}")
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    write_fn(tmp, rank)
    dist.barrier()
    if rank == 0:
        fsync_tree(tmp)
        (tmp / COMPLETE_MARKER).touch()
        old = final.with_name(f"{final.name}.old")
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def save_trainer_state(strategy: Any, folder: Path, rank: int, meta: dict[str, Any]) -> None:
    """``rng_rank<rank>.pt`` (every rank), and on rank 0 ``trainer_state.pt`` (scheduler, global step) + ``meta``."""
    torch.save(rng_state(), folder / f"rng_rank{rank}.pt")
    if rank == 0:
        trainer = {"scheduler": strategy.scheduler.state_dict(), "global_step": strategy.global_step}
        torch.save(trainer, folder / "trainer_state.pt")
        (folder / "meta.json").write_text(json.dumps(meta, indent=2))


def require_complete(path: str, role: str) -> Path:
    """``path`` as a Path, or FileNotFoundError when it is not a checkpoint folder with the COMPLETE marker."""
    root = Path(path)
    if not (root / COMPLETE_MARKER).exists():
        raise FileNotFoundError(
            f"{role}: {path} is not a complete checkpoint (no {COMPLETE_MARKER} marker). Point "
            "resume_from_checkpoint at a folder written by save_checkpoint; a `.tmp-*` folder is an interrupted save."
        )
    return root


def load_trainer_state(strategy: Any, root: Path, *, restore_rng: bool = True) -> None:
    """Restore what :func:`save_trainer_state` wrote: scheduler, global step and (if asked) this rank's RNG."""
    trainer = torch.load(root / "trainer_state.pt", weights_only=False)
    strategy.scheduler.load_state_dict(trainer["scheduler"])
    strategy.global_step = int(trainer["global_step"])
    rng_file = root / f"rng_rank{dist.get_rank()}.pt"
    if rng_file.exists() and restore_rng:
        set_rng_state(torch.load(rng_file, weights_only=False))


def write_hf_folder_atomically(path: str, write_fn: Callable[[Path], None], tokenizer: Any) -> None:
    """Rank 0 only: ``write_fn(tmp)`` into ``<path>.tmp``, add the tokenizer, fsync, then replace ``path`` with it."""
    final = Path(path)
    tmp = final.with_name(f"{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    write_fn(tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    fsync_tree(tmp)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)


def save(strategy: Any, path: str) -> None:
    """Write ``strategy``'s checkpoint to ``path`` (every rank calls; a collective)."""

    def write(tmp: Path, rank: int) -> None:
        model_sd, optim_sd = get_state_dict(strategy.model, strategy.optimizer)
        dcp_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "dcp"))
        meta = {"role": strategy.role, "world_size": dist.get_world_size(), "global_step": strategy.global_step}
        save_trainer_state(strategy, tmp, rank, meta)

    write_checkpoint_atomically(path, strategy.global_step, write)


def load(strategy: Any, path: str) -> None:
    """Restore ``strategy`` from ``path``; RNG per rank when the world size matches (else each rank's seed)."""
    root = require_complete(path, strategy.role)
    model_sd, optim_sd = get_state_dict(strategy.model, strategy.optimizer)
    dcp_load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(root / "dcp"))  # fills them in place
    set_state_dict(strategy.model, strategy.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    load_trainer_state(strategy, root)


def save_hf(strategy: Any, path: str) -> None:
    """Gather full weights to rank 0 and write a HuggingFace folder there, atomically (every rank calls)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state_dict = get_model_state_dict(strategy.model, options=options)

    def write(tmp: Path) -> None:
        strategy.model.save_pretrained(str(tmp), state_dict=state_dict)

    if dist.get_rank() == 0:
        write_hf_folder_atomically(path, write, strategy.tokenizer)
    dist.barrier()
