"""Megatron-core per-rank checkpoint folders: find, read and write ``model_optim_rng.pt`` files.

Layout (megatron's ``save_checkpoint`` without dist_checkpointing)::

    <root>/latest_checkpointed_iteration.txt        "1" (or "release")
    <root>/iter_0000001/mp_rank_00/model_optim_rng.pt        PP == 1: mp_rank_<tp:02d>
    <root>/iter_0000001/mp_rank_00_001/model_optim_rng.pt    PP > 1:  mp_rank_<tp:02d>_<pp:03d>

Each file is a ``torch.save`` dict ``{"args", "checkpoint_version", "iteration", "model", ...}``.
"""

from __future__ import annotations

import argparse
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rl_ckpt.errors import CheckpointError
from rl_ckpt.families import MCORE_NORM_ALIASES
from rl_ckpt.spec import arg

CHECKPOINT_VERSION = 3.0
RANK_FILE = "model_optim_rng.pt"
TRACKER_FILE = "latest_checkpointed_iteration.txt"
_RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?")


def rank_dir_name(tp_rank: int, pp_rank: int, pp: int) -> str:
    """``mp_rank_XX`` when PP == 1, else ``mp_rank_XX_YYY``."""
    return f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def iteration_dir_name(iteration: int) -> str:
    """``iter_0000001`` for iteration 1."""
    return f"iter_{iteration:07d}"


def write_tracker(root: Path, iteration: int) -> None:
    """Write ``latest_checkpointed_iteration.txt`` so megatron's ``load_checkpoint`` finds the iteration."""
    (root / TRACKER_FILE).write_text(f"{iteration}\n", encoding="utf-8")


def resolve_iteration_dir(path: Path) -> Path:
    """The folder holding the ``mp_rank_*`` folders, from a checkpoint root or an ``iter_*`` folder."""
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist; check --checkpoint_path")
    tracker = path / TRACKER_FILE
    if tracker.is_file():
        text = tracker.read_text(encoding="utf-8").strip()
        found = path / ("release" if text == "release" else iteration_dir_name(int(text)))
        if not found.is_dir():
            raise CheckpointError(f"{tracker} names iteration {text!r} but {found} does not exist")
        return found
    if any(_RANK_DIR.fullmatch(p.name) for p in path.iterdir()):
        return path
    iters = sorted(p for p in path.iterdir() if p.is_dir() and (p.name.startswith("iter_") or p.name == "release"))
    if len(iters) == 1:
        return iters[0]
    hint = f"it holds {', '.join(p.name for p in iters)}; point at one of them" if iters else "none found"
    raise CheckpointError(
        f"{path} is not a Megatron checkpoint: expected {TRACKER_FILE} or iter_NNNNNNN/mp_rank_XX/{RANK_FILE} ({hint})"
    )


@dataclass(frozen=True)
class RankLayout:
    """The rank files of one iteration folder; ``path(t, p)`` is TP rank t, PP stage p."""

    iteration_dir: Path
    tp: int
    pp: int

    def path(self, tp_rank: int, pp_rank: int) -> Path:
        """Path of one rank file."""
        return self.iteration_dir / rank_dir_name(tp_rank, pp_rank, self.pp) / RANK_FILE

    def check_complete(self) -> None:
        """Raise naming the first missing rank file."""
        for p in range(self.pp):
            for t in range(self.tp):
                if not self.path(t, p).is_file():
                    raise CheckpointError(
                        f"missing rank file {self.path(t, p)} (TP={self.tp} x PP={self.pp}); "
                        "the checkpoint is incomplete: copy that file from where it was saved"
                    )


def discover_layout(iteration_dir: Path) -> RankLayout:
    """TP and PP sizes from the ``mp_rank_*`` folder names (expert-parallel folders are not supported yet)."""
    matches = [m for m in (_RANK_DIR.fullmatch(p.name) for p in iteration_dir.iterdir() if p.is_dir()) if m]
    if not matches:
        raise CheckpointError(f"no mp_rank_* folders in {iteration_dir}; is it a dist_checkpointing (torch_dist) one?")
    tp = max(int(m.group(1)) for m in matches) + 1
    pp = max(int(m.group(2) or 0) for m in matches) + 1
    layout = RankLayout(iteration_dir, tp, pp)
    layout.check_complete()
    return layout


def check_layout_against_args(layout: RankLayout, args: object) -> None:
    """Catch a whole missing rank folder (which the folder names alone cannot show) from the saved TP / PP."""
    want_tp = int(arg(args, "tensor_model_parallel_size", layout.tp) or layout.tp)
    want_pp = int(arg(args, "pipeline_model_parallel_size", layout.pp) or layout.pp)
    if (want_tp, want_pp) != (layout.tp, layout.pp):
        full = RankLayout(layout.iteration_dir, want_tp, want_pp)
        full.check_complete()
        raise CheckpointError(
            f"{layout.iteration_dir}: args say TP={want_tp} x PP={want_pp} but the folders give "
            f"TP={layout.tp} x PP={layout.pp}; remove stray mp_rank_* folders"
        )


def _normalize(model: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Drop ``_extra_state`` / None entries and rename TE fused-layernorm names to the local-spec names."""
    out: dict[str, torch.Tensor] = {}
    for key, value in model.items():
        if key.endswith("_extra_state") or value is None:
            continue
        for te_name, local_name in MCORE_NORM_ALIASES.items():
            if key.endswith(te_name):
                key = key[: -len(te_name)] + local_name
        out[key] = value
    return out


def load_rank(path: Path, trust_checkpoint: bool = False) -> tuple[object, dict[str, torch.Tensor]]:
    """(args, model state dict) of one rank file, memory-mapped.

    Without ``trust_checkpoint`` the file is read with ``weights_only=True`` (argparse.Namespace allowed), which runs
    no code from the file; checkpoints holding other Python objects need ``trust_checkpoint=True``.
    """
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            state = torch.load(path, map_location="cpu", weights_only=not trust_checkpoint, mmap=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"{path} holds Python objects beyond tensors and args ({str(err).splitlines()[0]}); re-run with "
            "--trust_checkpoint to unpickle it (this runs code from the file: only for checkpoints you trust)"
        ) from None
    except (RuntimeError, OSError, EOFError) as err:
        raise CheckpointError(f"cannot read rank file {path}: {err}; the file is corrupt or truncated") from None
    if "model" not in state:
        extra = " (virtual pipeline stages model0, model1, ... are not supported yet)" if "model0" in state else ""
        raise CheckpointError(f"{path} has no 'model' entry{extra}; keys: {sorted(state)}")
    return state.get("args"), _normalize(state["model"])


def save_rank(path: Path, model: dict[str, torch.Tensor], args: dict[str, Any], iteration: int) -> None:
    """Write one rank file as megatron's ``save_checkpoint`` does (model only: no optimizer or RNG state)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration, "model": model}
    torch.save(state, path)
