"""Checkpoints of a train strategy: sharded model + optimizer, schedule, step and per-rank RNG, written atomically.

Layout of ``<path>/``: ``dcp/`` (torch.distributed.checkpoint: model and optimizer, loadable at another world
size), ``trainer_state.pt`` (scheduler, global step), ``rng_rank<R>.pt``, ``COMPLETE``. Everything is written
into ``<path>.tmp-<step>`` first; rank 0 renames it into place after every rank finished, so a crash never leaves
a half-written checkpoint under the final name. Multi-node jobs need ``path`` on a shared file system.

The atomic folder, trainer state and RNG helpers here are shared by every train strategy (deepspeed_state and
megatron_checkpoint write their engine's own files through :func:`write_checkpoint_atomically`).

A failed write (a full disk, a quota, a file-size limit, or any other error) fails the save on every rank alike:
after each phase the ranks exchange their outcome (:func:`settle`); if any rank failed, every rank removes the
temporary folder, the failing ranks raise their error (an ``OutOfSpaceError`` naming the path, the bytes needed and
free, and the fix, when space ran out) and the others a ``PeerRankError``. Nothing half-written stays behind and no
rank is left waiting in a collective.
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
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor

from rl_engines.disk_space import SAVE_FIX, OutOfSpaceError, error_code, out_of_space_cause, out_of_space_message
from rl_engines.strategies import lora

COMPLETE_MARKER = "COMPLETE"


class PeerRankError(RuntimeError):
    """Raised on a rank whose own part of a save succeeded while another rank's failed: the save was abandoned on
    every rank. The driver reports the failing rank's error in its place (``follows_another_rank``)."""

    follows_another_rank = True


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


def tensor_bytes(*objects: Any) -> int:
    """Bytes of the tensors in ``objects`` (nested dicts / lists / tuples; a DTensor counts its local shard, a ZeRO-3
    parameter its partition ``ds_tensor``), each tensor once: what this rank holds of a state it writes."""
    seen: set[int] = set()
    total, todo = 0, list(objects)
    while todo:
        item = todo.pop()
        if isinstance(item, dict):
            todo.extend(item.values())
        elif isinstance(item, (list, tuple)):
            todo.extend(item)
        elif isinstance(item, torch.Tensor) and id(item) not in seen:
            seen.add(id(item))
            local = item.to_local() if isinstance(item, DTensor) else getattr(item, "ds_tensor", item)
            total += local.numel() * local.element_size()
    return total


def _attempt(action: Callable[[], None] | None) -> Exception | None:
    """Run ``action`` (nothing when None); return its exception instead of raising it."""
    try:
        if action is not None:
            action()
    except Exception as exc:
        return exc
    return None


def _outcomes(error: BaseException | None, rank_bytes: int) -> tuple[list[int], bool, int]:
    """Every rank's outcome (a collective): the ranks whose own write failed, whether any rank raised (a
    :class:`PeerRankError` too), and the bytes of all ranks together."""
    code = 0 if error is None else 2 if isinstance(error, PeerRankError) else 1
    nccl = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    mine = torch.tensor([code, rank_bytes], dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    rows = torch.stack(every).cpu().tolist()
    failed = [rank for rank, (code, _) in enumerate(rows) if code == 1]
    return failed, any(code for code, _ in rows), sum(count for _, count in rows)


def settle(
    error: Exception | None, *, role: str, what: str, path: Path, temporary: Path, rank_bytes: int, cleaned: str
) -> None:
    """Every rank calls this after its part of one phase of a save (a collective). When any rank failed, every
    rank removes ``temporary`` and raises: a rank that failed its own error (an :class:`OutOfSpaceError` when space
    ran out, naming ``path``, the bytes of all ranks and the bytes free), the others a :class:`PeerRankError`.

    ``what`` completes "<role>: rank R could not ..." (e.g. ``"save checkpoint"``); ``cleaned`` says what was
    removed and what is untouched.
    """
    failed, abandoned, total = _outcomes(error, rank_bytes)
    if not abandoned:
        return
    shutil.rmtree(temporary, ignore_errors=True)
    if error is None or isinstance(error, PeerRankError):
        raise PeerRankError(
            f"{role}: rank(s) {failed} failed to {what} {path}; this rank's part was removed with {temporary}. "
            f"Fix: see the error of rank {failed[0] if failed else 0}."
        )
    cause = out_of_space_cause(error)
    if cause is None:
        raise error
    message = out_of_space_message(
        f"{role}: rank {dist.get_rank()} could not {what}", path, cause, needed=total, cleaned=cleaned, fix=SAVE_FIX
    )
    raise OutOfSpaceError(error_code(cause), message, str(getattr(cause, "filename", None) or path)) from None


def _prepare(final: Path, tmp: Path) -> None:
    """Rank 0: an empty ``tmp``, and no temporary folder of an earlier interrupted save of ``final`` left over."""
    for stale in final.parent.glob(f"{final.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir(parents=True)


def _publish(final: Path, tmp: Path, marker: str | None) -> None:
    """Rank 0: fsync ``tmp``, mark it complete (``marker``), and rename it to ``final`` (an existing one is moved to
    ``<final>.old`` first and put back if the rename fails, removed once it succeeded)."""
    fsync_tree(tmp)
    if marker is not None:
        (tmp / marker).touch()
    old = final.with_name(f"{final.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    try:
        tmp.rename(final)
    except BaseException:
        if old.exists():
            old.rename(final)
        raise
    shutil.rmtree(old, ignore_errors=True)


def write_checkpoint_atomically(
    path: str, step: int, write_fn: Callable[[Path, int], None], *, role: str, rank_bytes: int
) -> None:
    """Every rank calls ``write_fn(tmp, rank)`` on ``<path>.tmp-<step>``; then rank 0 publishes it (a collective).

    After every rank finished, rank 0 fsyncs the folder, marks it ``COMPLETE``, moves an existing ``path`` to
    ``<path>.old``, renames the temporary folder to ``path`` and removes ``.old``: a crash leaves either the old
    checkpoint or the new one under ``path``, never a half-written one. A failure on any rank removes the temporary
    folder and raises on every rank (see :func:`settle`); ``rank_bytes`` (what this rank writes) sizes the message.
    """
    final = Path(path)
    tmp = final.with_name(f"{final.name}.tmp-{step}")
    rank = dist.get_rank()
    cleaned = f"The temporary folder {tmp} was removed; earlier checkpoints are untouched."

    def phase(action: Callable[[], None] | None) -> None:
        settle(_attempt(action), role=role, what="save checkpoint", path=final, temporary=tmp,
               rank_bytes=rank_bytes, cleaned=cleaned)  # fmt: skip

    phase((lambda: _prepare(final, tmp)) if rank == 0 else None)
    phase(lambda: write_fn(tmp, rank))
    phase((lambda: _publish(final, tmp, COMPLETE_MARKER)) if rank == 0 else None)


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


PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json")
"""A vision-language model's processor configs, which an export carries over from the model folder it started from
(the tokenizer's own folder), so the exported folder loads and serves with its images."""


def _copy_processor_files(source: Path, folder: Path) -> None:
    if source.is_dir():
        for name in PROCESSOR_FILES:
            if (source / name).is_file() and not (folder / name).exists():
                shutil.copy2(source / name, folder / name)


def write_hf_folder_atomically(
    path: str,
    write_fn: Callable[[Path], None],
    tokenizer: Any,
    *,
    role: str,
    rank_bytes: int,
    follow: Callable[[], None] | None = None,
) -> None:
    """Every rank calls (a collective): rank 0 runs ``write_fn(tmp)`` into ``<path>.tmp``, adds the tokenizer (and a
    vision-language model's processor configs, :data:`PROCESSOR_FILES`), fsyncs, then replaces ``path`` with it; the
    other ranks run ``follow`` (their part of the collectives rank 0's write drives). A failure on any rank removes
    ``<path>.tmp`` and raises on every rank (see :func:`settle`). ``rank_bytes``: the bytes of the weights this rank
    contributes to the export (sizes the message)."""
    final = Path(path)
    tmp = final.with_name(f"{final.name}.tmp")

    def write() -> None:
        shutil.rmtree(tmp, ignore_errors=True)
        write_fn(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
            _copy_processor_files(Path(str(getattr(tokenizer, "name_or_path", ""))), tmp)
        _publish(final, tmp, None)

    error = _attempt(write if dist.get_rank() == 0 else follow)
    cleaned = f"The temporary folder {tmp} was removed; an earlier export at {final} is untouched."
    settle(error, role=role, what="export the HuggingFace model to", path=final, temporary=tmp,
           rank_bytes=rank_bytes, cleaned=cleaned)  # fmt: skip


def adapters_only(strategy: Any) -> bool:
    """A LoRA model's checkpoint holds its adapters (and their optimizer state) only: the base never changes."""
    return bool(strategy.config.model_args.lora)


def _state_dicts(strategy: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model and optimizer state dicts a checkpoint holds; with LoRA the trainable weights' only (torch's
    ``ignore_frozen_params`` keeps a frozen weight tied to another under its second name, so names are filtered)."""
    if not adapters_only(strategy):
        return get_state_dict(strategy.model, strategy.optimizer)
    options = StateDictOptions(ignore_frozen_params=True)
    model_sd, optim_sd = get_state_dict(strategy.model, strategy.optimizer, options=options)
    trained = {name for name, p in strategy.model.named_parameters(remove_duplicate=False) if p.requires_grad}
    return {name: value for name, value in model_sd.items() if name in trained}, optim_sd


def _expert_keys(strategy: Any) -> dict[str, str]:
    """Expert parallelism (fsdp2 ``ep_size``): each expert tensor's checkpoint name, its ``ep`` rank's own (the
    ranks hold different experts under one parameter name; :func:`rl_engines.strategies.fsdp2_experts
    .checkpoint_name`). Empty without it."""
    from rl_engines.strategies.fsdp2_experts import checkpoint_name

    mesh = getattr(strategy, "expert_mesh", None)
    return {} if mesh is None else {name: checkpoint_name(name, mesh) for name in strategy.expert_names}


def _renamed(
    model_sd: dict[str, Any], optim_sd: dict[str, Any], names: dict[str, str]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both state dicts with the parameter names of ``names`` replaced (the same tensors)."""
    if not names:
        return model_sd, optim_sd
    optim = {**optim_sd, "state": {names.get(k, k): v for k, v in optim_sd.get("state", {}).items()},
             "param_groups": [{**group, "params": [names.get(p, p) for p in group["params"]]}
                              for group in optim_sd.get("param_groups", [])]}  # fmt: skip
    return {names.get(k, k): v for k, v in model_sd.items()}, optim


def _ep_meta(strategy: Any) -> dict[str, Any]:
    mesh = getattr(strategy, "expert_mesh", None)
    return {} if mesh is None else {"ep_size": mesh.ep}


def _check_ep_size(strategy: Any, root: Path) -> None:
    """A checkpoint holds each ``ep`` rank's experts apart: resuming needs the ``ep_size`` it was written with."""
    meta_file = root / "meta.json"
    saved = json.loads(meta_file.read_text()).get("ep_size", 1) if meta_file.exists() else 1
    here = _ep_meta(strategy).get("ep_size", 1)
    if saved != here:
        raise ValueError(
            f"{strategy.role}: {root} was written with strategy_config.ep_size={saved} (each expert-parallel rank's "
            f"experts apart) but this run has ep_size={here}; resume with ep_size={saved}."
        )


def save(strategy: Any, path: str) -> None:
    """Write ``strategy``'s checkpoint to ``path`` (every rank calls; a collective). With LoRA only the adapters
    and their optimizer state are written (``meta.json`` says ``adapters_only``)."""

    def write(tmp: Path, rank: int) -> None:
        model_sd, optim_sd = _renamed(*_state_dicts(strategy), _expert_keys(strategy))
        try:
            dcp_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "dcp"))
        except CheckpointException as exc:  # a BaseException, raised on every rank when any rank's write failed
            if rank not in exc.failures:
                raise PeerRankError(f"{strategy.role}: rank(s) {sorted(exc.failures)} failed to write {tmp}") from None
            raise exc.failures[rank][0] from None  # this rank's own error (an OSError, torch's short write, ...)
        meta = {"role": strategy.role, "world_size": dist.get_world_size(), "global_step": strategy.global_step,
                **lora_meta(strategy), **_ep_meta(strategy)}  # fmt: skip
        save_trainer_state(strategy, tmp, rank, meta)

    written = [p for p in strategy.model.parameters() if p.requires_grad or not adapters_only(strategy)]
    rank_bytes = tensor_bytes(written, list(strategy.optimizer.state.values()))
    write_checkpoint_atomically(path, strategy.global_step, write, role=strategy.role, rank_bytes=rank_bytes)


def load(strategy: Any, path: str) -> None:
    """Restore ``strategy`` from ``path``; RNG per rank when the world size matches (else each rank's seed)."""
    root = require_complete(path, strategy.role)
    check_adapters_only(strategy, root)
    _check_ep_size(strategy, root)
    keys = _expert_keys(strategy)
    model_sd, optim_sd = _renamed(*_state_dicts(strategy), keys)
    dcp_load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(root / "dcp"))  # fills them in place
    model_sd, optim_sd = _renamed(model_sd, optim_sd, {saved: name for name, saved in keys.items()})
    # dcp_load refused a checkpoint missing any of these keys; the frozen base is not among them (LoRA)
    options = StateDictOptions(ignore_frozen_params=adapters_only(strategy), strict=not adapters_only(strategy))
    set_state_dict(strategy.model, strategy.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                   options=options)  # fmt: skip
    load_trainer_state(strategy, root)


def lora_meta(strategy: Any) -> dict[str, Any]:
    """What ``meta.json`` records of LoRA: whether the checkpoint holds adapters only, and their keys."""
    if not adapters_only(strategy):
        return {"adapters_only": False}
    return {"adapters_only": True, "lora": strategy.config.model_args.lora_signature()}


def check_adapters_only(strategy: Any, root: Path) -> None:
    """A LoRA checkpoint restores a LoRA model with the same lora_target / lora_rank / lora_alpha, and a full one a
    full model; anything else is refused naming the keys (a mismatch would drop or rescale adapters silently)."""
    meta_file = root / "meta.json"
    meta = json.loads(meta_file.read_text()) if meta_file.exists() else {}
    saved = bool(meta.get("adapters_only"))
    prefix = f"{strategy.role}.model_args"
    if saved != adapters_only(strategy):
        kinds = {True: "LoRA adapters only", False: "full weights"}
        raise ValueError(
            f"{strategy.role}: {root} holds {kinds[saved]}, but {prefix}.lora_target="
            f"{strategy.config.model_args.lora_target!r} builds a model with {kinds[adapters_only(strategy)]}; "
            f"resume with the lora_* keys the checkpoint was written with ({meta.get('lora') or 'none'})."
        )
    here = lora_meta(strategy).get("lora")
    if saved and meta.get("lora") != here:
        raise ValueError(
            f"{strategy.role}: {root} holds adapters of {meta.get('lora')}, but {prefix} asks for {here}; resume "
            "with the lora_target / lora_rank / lora_alpha the checkpoint was written with."
        )


def save_hf(strategy: Any, path: str) -> None:
    """Gather full weights to rank 0 and write a HuggingFace folder there, atomically (every rank calls). A LoRA
    model writes the base model with its adapters merged in, and the adapters alone (PEFT's format) in
    ``<path>/adapter``."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if getattr(strategy, "expert_mesh", None) is None:
        state_dict = get_model_state_dict(strategy.model, options=options)
    else:  # expert parallelism: the experts of every ep rank, gathered in expert order (a collective); rank 0 keeps
        state_dict = {}  # the full weights, as the full-state-dict path does
        for name, value in strategy.named_weights():
            if dist.get_rank() == 0:
                state_dict[name] = value.cpu()

    def write(tmp: Path) -> None:
        if adapters_only(strategy):
            lora.write_hf(strategy.model, state_dict, strategy.config.model_args.lora_scale, tmp)  # type: ignore[arg-type]
        else:
            strategy.model.save_pretrained(str(tmp), state_dict=state_dict)

    write_hf_folder_atomically(path, write, strategy.tokenizer, role=strategy.role,
                               rank_bytes=tensor_bytes(state_dict))  # fmt: skip
