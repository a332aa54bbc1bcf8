"""Megatron-core per-rank checkpoint folders: find, read and write ``model_optim_rng.pt`` files.

Layout (megatron's ``save_checkpoint`` without dist_checkpointing)::

    <root>/latest_checkpointed_iteration.txt        "1" (or "release")
    <root>/iter_0000001/mp_rank_00/model_optim_rng.pt        PP == 1: mp_rank_<tp:02d>
    <root>/iter_0000001/mp_rank_00_001/model_optim_rng.pt    PP > 1:  mp_rank_<tp:02d>_<pp:03d>
    <root>/iter_0000001/mp_rank_00_001_002/model_optim_rng.pt  EP > 1: _<ep:03d> appended (a MoE model's
                                                             expert-parallel rank: its experts, the rest replicated)

Each file is a ``torch.save`` dict ``{"args", "checkpoint_version", "iteration", "model", ...}``; Megatron-LM's
training loop adds ``optimizer``, ``opt_param_scheduler``, ``rng_state`` (numpy arrays inside) and more, and its
``args`` namespace holds enums: they are read as inert placeholders (``safe_load``), never executed.
A dist_checkpointing (``torch_dist``) iteration folder holds ``metadata.json`` and ``.metadata`` instead of
``mp_rank_*`` folders (see ``mcore_dist``).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rl_ckpt.errors import CheckpointError
from rl_ckpt.families import MCORE_NORM_ALIASES
from rl_ckpt.safe_load import load_torch_file
from rl_ckpt.sources import Source
from rl_ckpt.spec import arg
from rl_ckpt.staged_file import StagingBuffers
from rl_ckpt.stream_io import FileReader
from rl_ckpt.torch_zip import locate_storages, save_streamed

CHECKPOINT_VERSION = 3.0
RANK_FILE = "model_optim_rng.pt"
TRACKER_FILE = "latest_checkpointed_iteration.txt"
DIST_MARKERS = ("metadata.json", ".metadata")
"""Files that make a folder a dist_checkpointing one (megatron's backend description, torch DCP's metadata)."""
_RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?")  # TP, PP, EP; TP + EP alone looks like TP + PP


def rank_dir_name(tp_rank: int, pp_rank: int, pp: int, ep_rank: int = 0, ep: int = 1) -> str:
    """``mp_rank_XX`` when PP == 1, else ``mp_rank_XX_YYY``; ``_ZZZ`` (the expert-parallel rank) added when EP > 1,
    as Megatron names them."""
    name = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return name if ep == 1 else f"{name}_{ep_rank:03d}"


def iteration_dir_name(iteration: int) -> str:
    """``iter_0000001`` for iteration 1."""
    return f"iter_{iteration:07d}"


def write_tracker(root: Path, iteration: int) -> None:
    """Write ``latest_checkpointed_iteration.txt`` so megatron's ``load_checkpoint`` finds the iteration."""
    (root / TRACKER_FILE).write_text(f"{iteration}\n", encoding="utf-8")


def is_dist_dir(path: Path) -> bool:
    """Whether ``path`` is a dist_checkpointing (``torch_dist``) iteration folder."""
    return any((path / name).is_file() for name in DIST_MARKERS)


def resolve_iteration_dir(path: Path) -> Path:
    """The iteration folder (``mp_rank_*`` folders or a torch_dist folder) from a checkpoint root or itself."""
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist; check --checkpoint_path")
    tracker = path / TRACKER_FILE
    if tracker.is_file():
        text = tracker.read_text(encoding="utf-8").strip()
        found = path / ("release" if text == "release" else iteration_dir_name(int(text)))
        if not found.is_dir():
            raise CheckpointError(f"{tracker} names iteration {text!r} but {found} does not exist")
        return found
    if is_dist_dir(path) or any(_RANK_DIR.fullmatch(p.name) for p in path.iterdir()):
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
    """The rank files of one iteration folder; ``path(t, p, e)`` is TP rank t, PP stage p, expert-parallel rank e."""

    iteration_dir: Path
    tp: int
    pp: int
    ep: int = 1

    def path(self, tp_rank: int, pp_rank: int, ep_rank: int = 0) -> Path:
        """Path of one rank file."""
        return self.iteration_dir / rank_dir_name(tp_rank, pp_rank, self.pp, ep_rank, self.ep) / RANK_FILE

    def check_complete(self) -> None:
        """Raise naming the first missing rank file."""
        sizes = f"TP={self.tp} x PP={self.pp}" + (f" x EP={self.ep}" if self.ep > 1 else "")
        for p in range(self.pp):
            for e in range(self.ep):
                for t in range(self.tp):
                    if not self.path(t, p, e).is_file():
                        raise CheckpointError(
                            f"missing rank file {self.path(t, p, e)} ({sizes}); "
                            "the checkpoint is incomplete: copy that file from where it was saved"
                        )


def discover_layout(iteration_dir: Path) -> RankLayout:
    """TP, PP and EP sizes from the ``mp_rank_*`` folder names (``mp_rank_XX_EEE``, expert parallelism without
    PP, reads as PP here: :func:`check_layout_against_args` tells them apart by the args)."""
    names = [p.name for p in iteration_dir.iterdir() if p.is_dir()]
    matches = [m for m in (_RANK_DIR.fullmatch(name) for name in names) if m]
    if not matches:
        raise CheckpointError(f"no mp_rank_* folders in {iteration_dir}; is it a dist_checkpointing (torch_dist) one?")
    tp = max(int(m.group(1)) for m in matches) + 1
    pp = max(int(m.group(2) or 0) for m in matches) + 1
    ep = max(int(m.group(3) or 0) for m in matches) + 1
    layout = RankLayout(iteration_dir, tp, pp, ep)
    layout.check_complete()
    return layout


def check_layout_against_args(layout: RankLayout, args: object) -> RankLayout:
    """The layout the args describe: catches a whole missing rank folder (which the folder names alone cannot show)
    from the saved TP / PP / EP, and reads ``mp_rank_XX_EEE`` folders as expert-parallel ranks when the args say
    PP = 1 and EP > 1."""
    want_tp = int(arg(args, "tensor_model_parallel_size", layout.tp) or layout.tp)
    want_pp = int(arg(args, "pipeline_model_parallel_size", layout.pp) or layout.pp)
    want_ep = int(arg(args, "expert_model_parallel_size", layout.ep) or layout.ep)
    if want_pp == 1 and want_ep > 1 and layout.ep == 1:  # mp_rank_XX_EEE: the second number is the EP rank
        layout = RankLayout(layout.iteration_dir, layout.tp, 1, layout.pp)
    if (want_tp, want_pp, want_ep) != (layout.tp, layout.pp, layout.ep):
        full = RankLayout(layout.iteration_dir, want_tp, want_pp, want_ep)
        full.check_complete()
        raise CheckpointError(
            f"{layout.iteration_dir}: args say TP={want_tp} x PP={want_pp} x EP={want_ep} but the folders give "
            f"TP={layout.tp} x PP={layout.pp} x EP={layout.ep}; remove stray mp_rank_* folders"
        )
    return layout


def local_norm_name(key: str) -> str:
    """``key`` with a Transformer-Engine fused-layernorm name replaced by the local-spec name."""
    for te_name, local_name in MCORE_NORM_ALIASES.items():
        if key.endswith(te_name):
            return key[: -len(te_name)] + local_name
    return key


def normalize_keys(model: dict[str, Any], where: Path) -> dict[str, torch.Tensor]:
    """Drop ``_extra_state`` / None entries, rename TE fused-layernorm names; raise for any other non-tensor."""
    out: dict[str, torch.Tensor] = {}
    for key, value in model.items():
        if key.endswith("_extra_state") or value is None:
            continue
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{where}: model entry {key} is a {type(value).__name__}, not a tensor")
        out[local_norm_name(key)] = value
    return out


def load_rank(
    path: Path, trust_checkpoint: bool = False, *, lazy: bool = False, chunk: int | None = None
) -> tuple[object, dict[str, torch.Tensor]]:
    """(args, model state dict) of one rank file, memory-mapped; see ``safe_load`` for what ``trust_checkpoint``
    changes (by default no code from the file runs, whatever it holds). ``chunk``: the model chunk ``model<chunk>``
    of a file saved with a virtual pipeline (Megatron-LM writes one state dict per chunk).

    ``lazy``: the tensors are left on disk, meta tensors marked with their bytes' place (see ``sources``), read
    only when a writer copies them (memory-mapped when their offsets cannot be checked against the zip directory).
    """
    key = "model" if chunk is None else f"model{chunk}"
    if lazy:
        state = _load_state(path, trust_checkpoint, meta=True, key=key)
        model = normalize_keys(state[key], path)
        with path.open("rb") as f:
            if locate_storages(model.values(), path, 0, f):
                return state.get("args"), model
    state = _load_state(path, trust_checkpoint, meta=False, key=key)
    return state.get("args"), normalize_keys(state[key], path)


def rank_args(path: Path, trust_checkpoint: bool = False) -> object:
    """The ``args`` of one rank file (None when it has none), its tensors left on disk."""
    state = load_torch_file(path, trust=trust_checkpoint, meta=True)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a Megatron checkpoint's dict")
    return state.get("args")


def virtual_stages(args: object) -> int:
    """Model chunks per rank file: the args' ``virtual_pipeline_model_parallel_size`` (1 without one)."""
    return int(arg(args, "virtual_pipeline_model_parallel_size", 1) or 1)


def _load_state(path: Path, trust_checkpoint: bool, *, meta: bool, key: str = "model") -> dict[str, Any]:
    state = load_torch_file(path, trust=trust_checkpoint, meta=meta)
    if not isinstance(state, dict) or key not in state:
        keys = sorted(state) if isinstance(state, dict) else type(state).__name__
        extra = ""
        if key == "model" and "model0" in keys:
            extra = " (model0, model1, ...: saved with a virtual pipeline, which its args must name)"
        raise CheckpointError(f"{path} has no {key!r} entry{extra}; keys: {keys}")
    return state


def save_rank(
    path: Path,
    chunks: Sequence[Mapping[str, Source]],
    args: dict[str, Any],
    iteration: int,
    *,
    buffers: StagingBuffers | None = None,
    reader: FileReader | None = None,
) -> None:
    """Write one rank file as megatron's ``save_checkpoint`` does (model only: no optimizer or RNG state): the
    bytes ``torch.save`` writes, every tensor compact, streamed from the sources (``torch_zip.save_streamed``).
    ``chunks``: the rank's model state dict, or one per model chunk of a virtual pipeline (``model0``, ``model1``,
    ... as Megatron-LM names them)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration}
    with contextlib.ExitStack() as stack:
        if reader is None:
            reader = stack.enter_context(FileReader())
        models = {"model": chunks[0]} if len(chunks) == 1 else {f"model{c}": chunk for c, chunk in enumerate(chunks)}
        save_streamed(path, state, models, buffers=buffers or StagingBuffers(), reader=reader)
