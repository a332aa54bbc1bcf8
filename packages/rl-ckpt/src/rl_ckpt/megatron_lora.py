"""The LoRA adapters of an rl-engines ``megatron_train`` checkpoint, gathered over its tensor-parallel files.

Such a checkpoint (``meta.json`` with ``adapters_only: true``) holds in each ``mp_rank_<TT>.pt`` (``<TT>_<PPP>``
under pipeline parallelism) a ``model`` dict of that rank's adapter factors, named by HF module path
(``model.layers.<i>.self_attn.q_proj.lora_A.weight``). They are sharded like their base weights: the ``B`` of a
column-parallel projection (q / k / v / gate / up) by rows, the ``A`` of a row-parallel one (o_proj, down_proj) by
columns; the other factor is the same on every TP rank. The scale is ``lora_alpha / lora_rank`` from ``meta.json``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from rl_ckpt.errors import CheckpointError

ROW_PARALLEL = ("o_proj", "down_proj")
"""HF projections Megatron splits by input columns (their ``A`` is split); the others split ``B`` by rows."""
RANK_FILE = re.compile(r"^mp_rank_(?P<tp>\d{2})(?:_(?P<pp>\d{3}))?\.pt$")


def is_megatron_adapter(folder: Path) -> bool:
    """Whether ``folder`` is a megatron_train checkpoint holding LoRA adapters only."""
    meta = folder / "meta.json"
    if not meta.is_file() or not any(RANK_FILE.match(p.name) for p in folder.iterdir()):
        return False
    return bool(json.loads(meta.read_text(encoding="utf-8")).get("adapters_only"))


def read_megatron_adapter(folder: Path) -> tuple[float, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """The scale and, per base weight name, the full factors ``(A, B)`` of the checkpoint in ``folder``."""
    meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
    lora = meta.get("lora") or {}
    if "lora_rank" not in lora:
        raise CheckpointError(f"{folder / 'meta.json'} records no lora_rank / lora_alpha; not a LoRA checkpoint")
    tp = int(meta.get("tensor_model_parallel_size", 1))
    shards: dict[str, list[torch.Tensor | None]] = {}
    for path in sorted(folder.iterdir()):
        match = RANK_FILE.match(path.name)
        if match is None:
            continue
        rank = int(match["tp"])
        for name, tensor in torch.load(path, map_location="cpu", weights_only=True)["model"].items():
            shards.setdefault(name, [None] * tp)[rank] = tensor
    factors: dict[str, dict[str, torch.Tensor]] = {}
    for name, parts in shards.items():
        missing = [rank for rank, part in enumerate(parts) if part is None]
        if missing:
            raise CheckpointError(f"{folder}: {name} lacks the shards of tensor-parallel ranks {missing}")
        module, which = name.rsplit(".lora_", 1)
        row = module.rsplit(".", 1)[-1] in ROW_PARALLEL
        split = 1 if row and which.startswith("A") else 0 if not row and which.startswith("B") else None
        full = torch.cat(parts, dim=split) if split is not None else parts[0]  # type: ignore[arg-type]
        factors.setdefault(f"{module}.weight", {})[which[0]] = full  # type: ignore[assignment]
    scale = float(lora.get("lora_alpha") or 2 * lora["lora_rank"]) / float(lora["lora_rank"])
    return scale, {name: (found["A"], found["B"]) for name, found in factors.items()}
