"""LoRA on HuggingFace models (``fsdp2_train``, ``deepspeed_train``) through peft, ROLL's ``model_args.lora_*`` keys.

A LoRA layer computes ``W x + (lora_alpha / lora_rank) B A x``: ``W`` frozen (kept in the compute dtype), ``A``
(``[r, in]``, peft's Kaiming-uniform bound) and ``B`` (``[out, r]``, zeros) trained in fp32, so a fresh adapter changes
nothing. ``A`` is drawn by :func:`init_factor` from the seed and the module's HF name alone, so every engine and
parallel layout (peft here, Megatron's tensor-parallel shards in :mod:`rl_engines.strategies.megatron_lora`) starts
from the same adapters.
Inference engines without adapters get merged weights ``W + scale B A`` under the base model's HF names; adapter
files are PEFT's (``adapter_config.json`` + ``adapter_model.safetensors``, keys ``base_model.model.<module>.lora_A
.weight``), which ``peft.PeftModel.from_pretrained`` and ``rl-ckpt merge-lora`` read.
"""

from __future__ import annotations

import contextlib
import math
import re
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rl_engines.config import LORA_ALL_LINEAR, ModelArgs, WorkerConfig

PEFT_PREFIX = "base_model.model."
"""What peft puts before every module path of the wrapped model."""
ADAPTER = "default"
"""The one adapter a training role has (peft's default adapter name)."""
FACTOR = re.compile(rf"^(?P<module>.+)\.lora_(?P<which>[AB])\.{ADAPTER}\.weight$")


def require_peft(role: str) -> Any:
    """The peft package, or an ImportError saying how to install it."""
    try:
        import peft
    except ImportError as exc:
        raise ImportError(
            f"{role}.model_args.lora_target is set, which trains LoRA adapters through the peft package; it is not "
            "installed. Install it with `pip install rl-engines[lora]` (or `pip install peft`)."
        ) from exc
    return peft


def check_lora_role(config: WorkerConfig, role: str, value_head: bool) -> None:
    """LoRA trains a causal LM's adapters; a value-head role with ``lora_target`` is refused naming the key, and so is
    ``freeze_module_prefix`` beside it (LoRA freezes the whole base model already)."""
    if config.model_args.lora and value_head:
        raise ValueError(
            f"{role}.model_args.lora_target is set on a value-head model ({role}); LoRA is built for the policy. "
            f"Train {role} full-parameter: remove {role}.model_args.lora_target."
        )
    if config.model_args.lora and config.model_args.frozen_prefixes():
        raise ValueError(
            f"{role}.model_args.freeze_module_prefix and {role}.model_args.lora_target are both set: LoRA freezes the "
            "whole base model and trains its adapters; keep one of them (lora_target picks which modules adapt)."
        )


def require_lora(config: WorkerConfig, role: str) -> None:
    """A ValueError when ``role`` has no adapters (an adapter-only sync or export asked of a full model)."""
    if not config.model_args.lora:
        raise ValueError(f"{role} has no LoRA adapters ({role}.model_args.lora_target is null); it has full weights.")


def adapters_off(model: nn.Module, role: str, disable: bool) -> contextlib.AbstractContextManager[Any]:
    """A context running ``model`` without its adapters when ``disable`` (the base model: the reference policy)."""
    if not disable:
        return contextlib.nullcontext()
    if not hasattr(model, "disable_adapter"):
        raise ValueError(f"{role}: disable_adapter asks for the base model, but {role} has no LoRA adapters.")
    without: Any = model.disable_adapter
    return without()  # type: ignore[no-any-return]


def linear_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Module path -> module of every linear layer LoRA can wrap, less the output head (``all-linear``)."""
    output_embeddings: Any = getattr(model, "get_output_embeddings", None)
    head = output_embeddings() if output_embeddings is not None else None
    return {name: module for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and module is not head}  # fmt: skip


def resolve_targets(model: nn.Module, args: ModelArgs, role: str) -> list[str] | str:
    """peft's ``target_modules`` for ``lora_target``: ``all-linear`` expanded into the model's linear layer names;
    every name (or the regular expression) must match a linear layer, else a ValueError names the key and lists
    the model's linear layer names."""
    linear = linear_modules(model)
    names = sorted({path.rsplit(".", 1)[-1] for path in linear})
    key = f"{role}.model_args.lora_target"
    targets = args.lora_targets()
    if isinstance(targets, str):
        others = [path for path, _ in model.named_modules() if path not in linear and re.fullmatch(targets, path)]
        if others:
            raise ValueError(
                f"{key}={targets!r} also matches {others[:3]}, which are not linear layers LoRA adapts here (the "
                f"output head and embeddings are not adapted); narrow it to the model's linear layers {names}."
            )
        if not any(re.fullmatch(targets, path) for path in linear):
            raise ValueError(
                f"{key}={targets!r} matches no linear layer of {type(model).__name__} (a regular expression is "
                f"matched against whole module paths such as {next(iter(linear), '?')!r}); its linear layers are "
                f"{names}."
            )
        return targets
    wanted = sorted({name for t in targets for name in (names if t in LORA_ALL_LINEAR else [t])})
    missing = [t for t in wanted if not any(path == t or path.endswith(f".{t}") for path in linear)]
    if missing:
        raise ValueError(
            f"{key} names {missing}, which match no linear layer of {type(model).__name__}; its linear layers are "
            f"{names} (or use all-linear)."
        )
    return wanted


def init_factor(seed: int, module: str, rank: int, fan_in: int) -> torch.Tensor:
    """The initial ``A`` factor ``[rank, fan_in]`` (fp32) of the adapter on HF module ``module`` (e.g.
    ``model.layers.0.self_attn.q_proj``): uniform in peft's Kaiming bound ``1 / sqrt(fan_in)``, drawn from a
    generator of its own seeded by ``seed`` and the module's name (independent of module order, engine and
    sharding)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(module.encode()))
    bound = 1.0 / math.sqrt(fan_in)
    return (torch.rand(rank, fan_in, generator=generator) * 2 - 1) * bound


def apply_lora(model: nn.Module, args: ModelArgs, role: str, compute_dtype: torch.dtype, seed: int) -> nn.Module:
    """``model`` wrapped by peft with one trainable adapter per target (fp32, ``A`` from :func:`init_factor`) and
    its own weights frozen in ``compute_dtype``."""
    peft = require_peft(role)
    config = peft.LoraConfig(
        r=args.lora_rank,
        lora_alpha=args.alpha,
        lora_dropout=args.lora_dropout,
        target_modules=resolve_targets(model, args, role),
        task_type=peft.TaskType.CAUSAL_LM,
    )
    wrapped = peft.get_peft_model(model, config, adapter_name=ADAPTER)
    with torch.no_grad():
        for name, layer in wrapped.named_modules():
            factor = getattr(layer, "lora_A", None)
            if isinstance(factor, nn.ModuleDict) and ADAPTER in factor:
                weight: Any = factor[ADAPTER].weight
                weight.copy_(init_factor(seed, base_name(name), weight.shape[0], weight.shape[1]))
    for param in wrapped.parameters():
        if param.requires_grad:
            param.data = param.data.float()
        else:
            param.data = param.data.to(compute_dtype)
    return wrapped  # type: ignore[no-any-return]


def base_name(name: str) -> str:
    """A peft model's parameter name -> the base model's HF name (no ``base_model.model.`` / ``.base_layer``)."""
    name = name.removeprefix(PEFT_PREFIX)
    return name.replace(".base_layer.", ".")


def merged_weights(items: Iterable[tuple[str, torch.Tensor]], scale: float) -> Iterator[tuple[str, torch.Tensor]]:
    """A peft model's full weights (state-dict order) -> the base model's HF weights with every adapter merged
    in: ``W + scale B A`` (computed in fp32, stored in ``W``'s dtype). A LoRA layer's base weight waits for its two
    factors; every other tensor passes through renamed."""
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in items:
        factor = FACTOR.match(name)
        if factor is None and not name.endswith(".base_layer.weight"):
            yield base_name(name), tensor
            continue
        module = factor["module"] if factor else name.removesuffix(".base_layer.weight")
        parts = waiting.setdefault(module, {})
        parts[factor["which"] if factor else "W"] = tensor
        if len(parts) == 3:
            del waiting[module]
            yield base_name(module) + ".weight", merge(parts["W"], parts["A"], parts["B"], scale)
    if waiting:
        raise ValueError(f"LoRA layers without their base weight or both factors: {sorted(waiting)}")


def merge(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """``W + scale B A`` in fp32, returned in ``W``'s dtype."""
    return (weight.float() + scale * (lora_b.float() @ lora_a.float())).to(weight.dtype)


def adapter_weights(items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapter factors of a peft model's weights, under PEFT's file names (adapter name dropped)."""
    for name, tensor in items:
        if FACTOR.match(name):
            yield name.replace(f".{ADAPTER}.weight", ".weight"), tensor


def peft_config(args: ModelArgs, modules: Iterable[str], base_model: str | None = None) -> dict[str, Any]:
    """PEFT's ``adapter_config.json`` of adapters with ``args``' rank and alpha on ``modules`` (module names such as
    ``q_proj``), as ``peft.PeftModel.from_pretrained``, vLLM and ``rl-ckpt merge-lora`` read it."""
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": args.lora_rank, "lora_alpha": args.alpha,
              "target_modules": sorted(set(modules)), "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "use_rslora": False}  # fmt: skip
    return config if base_model is None else {**config, "base_model_name_or_path": base_model}


def write_adapter(folder: Path, factors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """A PEFT adapter folder: ``factors`` (PEFT file names) and ``config`` (:func:`peft_config`)."""
    import json

    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({name: t.contiguous() for name, t in factors.items()}, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))


def write_hf(model: Any, state_dict: dict[str, torch.Tensor], scale: float, folder: Path) -> None:
    """A HuggingFace folder of a peft model's full weights (peft names): the base model with the adapters merged in
    at ``folder``, the adapters alone in PEFT's format at ``folder / "adapter"``."""
    model.get_base_model().save_pretrained(str(folder), state_dict=dict(merged_weights(state_dict.items(), scale)))
    model.save_pretrained(str(folder / "adapter"), state_dict=state_dict)
