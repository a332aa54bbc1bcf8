"""LoRA adapter (PEFT's folder format) + its HuggingFace base model -> one plain HF model folder.

A LoRA layer computes ``W x + s B A x`` with ``s = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA), so the
merged weight is ``W + s B A`` (``(B A)^T`` for a ``fan_in_fan_out`` layer such as GPT-2's Conv1D). The adapter
folder is what ``PeftModel.save_pretrained`` (and rl-engines' ``save_hf`` under ``adapter/``) writes:
``adapter_config.json`` and ``adapter_model.safetensors`` with keys ``base_model.model.<module>.lora_A.weight`` /
``lora_B.weight``; or an rl-engines ``megatron_train`` LoRA checkpoint (adapters only, split over its
tensor-parallel files: :mod:`rl_ckpt.megatron_lora`). Every other base tensor is streamed to the output unchanged;
config, generation config and tokenizer files are copied. Adapters this cannot merge exactly (DoRA, per-module rank
/ alpha patterns, embedding adapters, LoRA biases, modules_to_save) are refused naming the key.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from rl_ckpt.disk_space import output_folder
from rl_ckpt.errors import CheckpointError
from rl_ckpt.hf_io import TOKENIZER_FILES, HFCheckpoint, ShardedSafetensorsWriter, copy_tokenizer, parse_size
from rl_ckpt.megatron_lora import is_megatron_adapter, read_megatron_adapter

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
FACTOR = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])(\.[^.]+)?\.weight$")
"""A factor's key: ``<module>.lora_A.weight`` (a saved adapter) or ``<module>.lora_A.<adapter name>.weight``."""
UNMERGEABLE = {
    "use_dora": "DoRA rescales each merged column by a learned magnitude",
    "rank_pattern": "per-module ranks",
    "alpha_pattern": "per-module alphas",
    "modules_to_save": "fully trained copies of whole modules",
}
"""adapter_config.json keys whose non-empty value this merge refuses -> what they would need."""


@dataclass(frozen=True)
class LoraAdapter:
    """A read adapter: the scale ``s`` and, per base weight name, its factors ``(A [r, in], B [out, r])``."""

    folder: Path
    scale: float
    fan_in_fan_out: bool
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]

    def delta(self, name: str) -> torch.Tensor:
        """``s B A`` of base weight ``name`` in fp32 (transposed for fan_in_fan_out layers)."""
        lora_a, lora_b = self.factors[name]
        product = lora_b.float() @ lora_a.float()
        return self.scale * (product.T if self.fan_in_fan_out else product)


def read_adapter(folder: Path) -> LoraAdapter:
    """The adapter in ``folder`` (PEFT's files, or a megatron_train LoRA checkpoint); raises naming the file and
    key for anything it cannot merge."""
    config_file = folder / ADAPTER_CONFIG
    if not config_file.is_file() and folder.is_dir() and is_megatron_adapter(folder):
        scale, factors = read_megatron_adapter(folder)
        return LoraAdapter(folder, scale, False, factors)
    if not config_file.is_file():
        raise CheckpointError(
            f"--adapter_path {folder} has no {ADAPTER_CONFIG}; point it at a PEFT LoRA adapter folder (or a "
            "megatron_train LoRA checkpoint folder)"
        )
    config: dict[str, Any] = json.loads(config_file.read_text(encoding="utf-8"))
    if str(config.get("peft_type", "")).upper() != "LORA":
        raise CheckpointError(f"{config_file}: peft_type {config.get('peft_type')!r} is not LORA; only LoRA merges")
    for key, what in UNMERGEABLE.items():
        if config.get(key):
            raise CheckpointError(f"{config_file}: {key} is set ({what}); this merge handles plain LoRA only")
    rank, alpha = int(config["r"]), float(config.get("lora_alpha") or config["r"])
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights_file = folder / ADAPTER_WEIGHTS
    if not weights_file.is_file():
        raise CheckpointError(f"{folder} has no {ADAPTER_WEIGHTS} (only safetensors adapters are read)")
    factors = _factors(load_file(str(weights_file)), weights_file)
    return LoraAdapter(folder, scale, bool(config.get("fan_in_fan_out")), factors)


def _factors(tensors: dict[str, torch.Tensor], source: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = FACTOR.match(key)
        if match is None:
            raise CheckpointError(
                f"{source}: tensor {key!r} is not a LoRA factor (lora_A / lora_B weight); embedding adapters, LoRA "
                "biases and saved modules are not merged here"
            )
        module = match["module"].removeprefix(PEFT_PREFIX)
        parts.setdefault(f"{module}.weight", {})[match["which"]] = tensor
    incomplete = sorted(name for name, found in parts.items() if len(found) != 2)
    if incomplete:
        raise CheckpointError(f"{source}: LoRA layers without both lora_A and lora_B: {incomplete[:5]}")
    return {name: (found["A"], found["B"]) for name, found in parts.items()}


def merge_lora(base_path: Path, adapter_path: Path, out: Path, *, max_shard_size: str = "5GB") -> dict[str, str]:
    """Write ``base + adapter`` merged into ``out`` (sharded safetensors, index, config, tokenizer); returns the
    weight map. Each merged weight is ``W + s B A`` computed in fp32 and stored in ``W``'s dtype."""
    adapter = read_adapter(adapter_path)
    base = HFCheckpoint(base_path)
    missing = sorted(set(adapter.factors) - set(base.weight_map))
    if missing:
        raise CheckpointError(
            f"{adapter_path} adapts {missing[:5]}, which {base_path} does not have: the adapter was trained on "
            "another base model (check adapter_config.json's base_model_name_or_path)"
        )
    with output_folder(out):  # a failed merge leaves no partial output
        writer = ShardedSafetensorsWriter(out, parse_size(max_shard_size))
        for name in base.weight_map:
            writer.add(name, _merged(base, adapter, name) if name in adapter.factors else base.lazy(name))
        weight_map = writer.close()
        for extra in ("config.json", "generation_config.json"):
            if (base_path / extra).is_file():
                shutil.copyfile(base_path / extra, out / extra)
        if any((base_path / name).is_file() for name in TOKENIZER_FILES):
            copy_tokenizer(base_path, out)
    return weight_map


def _merged(base: HFCheckpoint, adapter: LoraAdapter, name: str) -> torch.Tensor:
    weight = base.get(name)
    delta = adapter.delta(name)
    if delta.shape != weight.shape:
        raise CheckpointError(
            f"{adapter.folder}: the adapter of {name} has shape {tuple(delta.shape)} (B A) but the base weight is "
            f"{tuple(weight.shape)}: the adapter belongs to another model size"
        )
    return (weight.float() + delta).to(weight.dtype)
