"""DeepSpeed engine checkpoints: find the tag folder, check every rank file is there, vet the pickles.

Layouts read (``engine.save_checkpoint(save_dir, tag)``)::

    <save_dir>/latest                                            the tag name, e.g. "global_step100"
    <save_dir>/<tag>/mp_rank_00_model_states.pt                  ZeRO 0-2: module, param shapes, ds_config
    <save_dir>/<tag>/zero_pp_rank_<r>_mp_rank_00_model_states.pt ZeRO-3: one per data-parallel rank r
    <save_dir>/<tag>/[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt  ZeRO 1-3: rank r's fp32 partition

and rl_engines' ``deepspeed_train`` checkpoints: an atomic folder with ``COMPLETE``, ``meta.json`` and the engine
checkpoint under ``deepspeed/state/``. HF Trainer's ``checkpoint-N/`` (``latest`` + ``global_stepN/``) is the first
layout. Tensor / pipeline-parallel DeepSpeed checkpoints (``mp_rank_01``, ``layer_*``) are refused.

Trust: DeepSpeed pickles a few of its own classes into the optimizer files (the loss scaler, the ZeRO stage enum,
fragment addresses). Without ``trust_checkpoint`` every rank file's pickle is *listed*, not run
(``torch.serialization.get_unsafe_globals_in_checkpoint``); a file naming anything beyond tensors, containers and
those plain-data classes (``DEEPSPEED_DATA_CLASSES``) is refused. A file that passes references nothing else, so
unpickling it (ours with ``weights_only=True``; DeepSpeed's zero_to_fp32 without) runs no other code.
"""

from __future__ import annotations

import importlib
import json
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rl_ckpt.errors import CheckpointError

LATEST_FILE = "latest"
ZERO012_MODEL_STATES = "mp_rank_00_model_states.pt"
ENGINE_DIR = "deepspeed"
"""rl_engines ``deepspeed_train``: the engine checkpoint's folder inside the atomic checkpoint folder."""
COMPLETE_MARKER = "COMPLETE"
META_FILE = "meta.json"
DEEPSPEED_DATA_CLASSES = frozenset(
    {
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
        "deepspeed.utils.tensor_fragment.fragment_address",
    }
)
"""DeepSpeed classes its checkpoints pickle; none defines ``__reduce__`` / ``__setstate__`` (unpickling only sets
attributes), so files holding nothing else are read without ``--trust_checkpoint``."""
INSTALL_HINT = "pip install 'rl-ckpt[deepspeed]'"
_OPTIM = re.compile(r"(.*)zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")


def zero3_model_states(rank: int) -> str:
    """ZeRO-3's per-rank model states file name."""
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


def optim_states(prefix: str, rank: int) -> str:
    """A rank's optimizer partition file name (``prefix`` is ``"bf16_"`` for bf16 training, else empty)."""
    return f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


@dataclass(frozen=True)
class DeepSpeedCheckpoint:
    """An opened DeepSpeed checkpoint: its tag folder, ZeRO stage, data-parallel size and rank files."""

    tag_dir: Path
    """The folder holding the ``*_model_states.pt`` / ``*_optim_states.pt`` files."""
    zero_stage: int
    dp_world_size: int
    rank_files: tuple[Path, ...]
    """Every file the reconstruction reads (model states first)."""
    meta: dict[str, Any] | None
    """``deepspeed_train``'s ``meta.json`` (role, world_size, zero_stage, global_step), when it is one."""
    root: Path
    """The folder given by the user (HF Trainer's ``checkpoint-N`` may hold config.json here)."""
    trust_checkpoint: bool = False


def _has_model_states(folder: Path) -> bool:
    return folder.is_dir() and any(folder.glob("*model_states.pt"))


def is_deepspeed_checkpoint(path: Path) -> bool:
    """Whether ``path`` looks like a DeepSpeed checkpoint (root with ``latest``, tag folder, deepspeed_train)."""
    if not path.is_dir():
        return False
    if (path / LATEST_FILE).is_file() or _has_model_states(path) or _has_model_states(path / ENGINE_DIR):
        return True
    engine = path / ENGINE_DIR
    return any(_has_model_states(p) for p in (*path.iterdir(), *(engine.iterdir() if engine.is_dir() else ())))


def _engine_root(path: Path) -> tuple[Path, dict[str, Any] | None]:
    """(folder holding the tag folders, deepspeed_train meta) for a user-given path."""
    if not (path / ENGINE_DIR).is_dir() or not (path / META_FILE).is_file():
        return path, None
    if not (path / COMPLETE_MARKER).exists():
        raise CheckpointError(
            f"{path} is a deepspeed_train checkpoint without its {COMPLETE_MARKER} marker: the save was interrupted "
            "(a `.tmp-*` folder). Convert the last complete checkpoint instead"
        )
    meta = json.loads((path / META_FILE).read_text(encoding="utf-8"))
    return path / ENGINE_DIR, dict(meta)


def resolve_tag_dir(path: Path, tag: str | None = None) -> tuple[Path, dict[str, Any] | None]:
    """The tag folder of ``path`` (explicit ``tag``, the path itself, ``latest``, or its only tag folder)."""
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist; check --checkpoint_path")
    root, meta = _engine_root(path)
    if tag is not None:
        found = root / tag
    elif _has_model_states(root):
        return root, meta
    elif (root / LATEST_FILE).is_file():
        tag = (root / LATEST_FILE).read_text(encoding="utf-8").strip()
        found = root / tag
    else:
        tags = sorted(p for p in root.iterdir() if _has_model_states(p))
        if len(tags) != 1:
            hint = f"it holds {', '.join(p.name for p in tags)}; point at one" if tags else "none found"
            raise CheckpointError(
                f"{path} is not a DeepSpeed checkpoint: expected a '{LATEST_FILE}' file or a tag folder holding "
                f"{ZERO012_MODEL_STATES} / {zero3_model_states(0)} ({hint})"
            )
        found = tags[0]
    if not found.is_dir():
        raise CheckpointError(f"{root}: tag {tag!r} (from '{LATEST_FILE}' or --tag) names a missing folder {found}")
    return found, meta


def check_pickle(path: Path, trust_checkpoint: bool) -> None:
    """Refuse ``path`` when its pickle names classes beyond tensors and DeepSpeed's plain-data records.

    Lists the pickle's globals without running it; ``trust_checkpoint`` skips the check.
    """
    if trust_checkpoint:
        return
    lister = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)
    try:
        found = set(lister(str(path))) if lister is not None else {"<unknown: torch < 2.5 cannot list them>"}
    except (RuntimeError, OSError, ValueError, pickle.UnpicklingError) as err:
        raise CheckpointError(f"cannot read rank file {path}: {err}; the file is corrupt or truncated") from None
    unknown = sorted(found - DEEPSPEED_DATA_CLASSES)
    if unknown:
        raise CheckpointError(
            f"{path} holds pickled Python objects ({', '.join(unknown)}) beyond tensors and DeepSpeed's own "
            "optimizer records; unpickling them runs code from the file. Re-run with --trust_checkpoint if you "
            "trust where the checkpoint comes from"
        )


def _data_classes() -> list[Any]:
    """The importable classes of ``DEEPSPEED_DATA_CLASSES`` (for ``weights_only`` loads)."""
    classes = []
    for dotted in sorted(DEEPSPEED_DATA_CLASSES):
        module, _, name = dotted.rpartition(".")
        try:
            classes.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return classes


def load_states(path: Path, trust_checkpoint: bool) -> dict[str, Any]:
    """One rank file, memory-mapped; ``weights_only=True`` (DeepSpeed's data classes allowed) unless trusted."""
    check_pickle(path, trust_checkpoint)
    try:
        with torch.serialization.safe_globals(_data_classes()):
            state = torch.load(path, map_location="cpu", weights_only=not trust_checkpoint, mmap=True)
    except ModuleNotFoundError as err:
        raise CheckpointError(f"{path} needs the module {err.name!r} to unpickle: {INSTALL_HINT}") from None
    except (RuntimeError, OSError, EOFError, pickle.UnpicklingError) as err:
        raise CheckpointError(f"cannot read rank file {path}: {err}; the file is corrupt or truncated") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not DeepSpeed's model states dict")
    return state


def _rank0_model_states(tag_dir: Path) -> Path:
    """ZeRO 0-2's ``mp_rank_00`` or ZeRO-3's rank-0 model states file; raises naming what is there instead."""
    for name in (ZERO012_MODEL_STATES, zero3_model_states(0)):
        if (tag_dir / name).is_file():
            return tag_dir / name
    names = sorted(p.name for p in tag_dir.glob("*model_states.pt"))
    if any(n.startswith("layer_") for n in names):
        raise CheckpointError(f"{tag_dir} is a DeepSpeed pipeline-parallel checkpoint (layer_*), not supported")
    if any(re.fullmatch(r"(zero_pp_rank_\d+_)?mp_rank_(?!00)\d+_model_states\.pt", n) for n in names):
        raise CheckpointError(
            f"{tag_dir} is a tensor-parallel (Megatron-DeepSpeed) checkpoint ({', '.join(names)}), not supported; "
            "DeepSpeed's ds_to_universal.py merges it"
        )
    if not names:
        raise CheckpointError(f"{tag_dir} holds no {ZERO012_MODEL_STATES} or {zero3_model_states(0)}")
    raise CheckpointError(
        f"missing rank file {tag_dir / zero3_model_states(0)} (found {', '.join(names)}); the checkpoint is "
        "incomplete: copy that file from the node that saved it"
    )


def _zero_stage(state: dict[str, Any], model_states: Path, tag_dir: Path) -> int:
    """The ZeRO stage from the saved ds_config, else from the file names."""
    stage = ((state.get("ds_config") or {}).get("zero_optimization") or {}).get("stage")
    if stage is not None:
        return int(stage)
    if model_states.name == zero3_model_states(0):
        return 3
    return 1 if any(tag_dir.glob("*optim_states.pt")) else 0


def _expected_files(tag_dir: Path, stage: int, dp: int) -> list[Path]:
    """Every rank file of a checkpoint at ``stage`` written by ``dp`` data-parallel ranks (model states first)."""
    found = {int(m.group(2)): m.group(1) for p in tag_dir.iterdir() if (m := _OPTIM.fullmatch(p.name))}
    stray = sorted(r for r in found if r >= dp)
    if stray:
        raise CheckpointError(
            f"{tag_dir} holds optimizer files of ranks {stray} but was saved by {dp} data-parallel ranks; "
            "remove the files of another run"
        )
    prefix = next(iter(found.values()), "")
    files = [tag_dir / zero3_model_states(r) for r in range(dp)] if stage == 3 else [tag_dir / ZERO012_MODEL_STATES]
    if stage >= 1:
        files += [tag_dir / optim_states(prefix, r) for r in range(dp)]
    return files


def open_deepspeed_checkpoint(
    path: Path | str, *, tag: str | None = None, trust_checkpoint: bool = False
) -> DeepSpeedCheckpoint:
    """Find the tag folder, read rank 0's model states (stage, world size), check every rank file is there."""
    root = Path(path)
    tag_dir, meta = resolve_tag_dir(root, tag)
    model_states = _rank0_model_states(tag_dir)
    state = load_states(model_states, trust_checkpoint)
    mp = int(state.get("mp_world_size", 1) or 1)
    if mp > 1:
        raise CheckpointError(f"{model_states} was saved with tensor-parallel size {mp}; only 1 is supported")
    dp = int(state.get("dp_world_size", 1) or 1)
    stage = _zero_stage(state, model_states, tag_dir)
    files = _expected_files(tag_dir, stage, dp)
    for file in files:
        if not file.is_file():
            raise CheckpointError(
                f"missing rank file {file} (ZeRO-{stage}, {dp} data-parallel ranks): the checkpoint is incomplete; "
                "copy that file from the node that saved it (every rank writes its own partition)"
            )
    return DeepSpeedCheckpoint(tag_dir, stage, dp, tuple(files), meta, root, trust_checkpoint)
