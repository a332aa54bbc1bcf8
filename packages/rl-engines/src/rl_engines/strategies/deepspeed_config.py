"""``deepspeed_train``'s ``strategy_config``: ROLL's DeepSpeed configs, named presets and shorthand keys.

A ROLL user writes ``strategy_config: ${deepspeed_zero2}``, i.e. a whole DeepSpeed config (``zero_optimization``,
``bf16``, ``train_batch_size: auto``, ...). That works here as it is, and so do three shorter forms::

    strategy_config: {preset: deepspeed_zero3_cpuoffload}          # ROLL's config names, see PRESETS
    strategy_config: {zero_stage: 2, offload_optimizer: true}      # shorthand
    strategy_config: {deepspeed_config: /path/ds_zero2.json}       # a DeepSpeed JSON file, or an inline dict

Layers are merged in this order: the preset (default ``deepspeed_zero2``), then ``deepspeed_config``, then the
DeepSpeed keys given directly; the shorthand keys must agree with what those layers set. Batch sizes, gradient
clipping and precision come from ``training_args`` / ``model_args`` (ROLL's ``auto``): an explicit value must
equal the derived one. The optimizer and LR schedule are built from ``training_args`` like ``fsdp2_train``'s, so
``optimizer`` / ``scheduler`` keys are refused, as are the gradient pre-/post-scaling keys the strategy owns.
Nothing here imports DeepSpeed.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

from rl_engines.config import TrainingArgs

ZERO_STAGE_KEY = "zero_optimization"
PRESETS: dict[str, dict[str, Any]] = {
    "deepspeed_zero": {ZERO_STAGE_KEY: {"stage": 0}},
    "deepspeed_zero1": {ZERO_STAGE_KEY: {"stage": 1}},
    "deepspeed_zero2": {ZERO_STAGE_KEY: {"stage": 2}},
    "deepspeed_zero3": {ZERO_STAGE_KEY: {"stage": 3}},
    "deepspeed_zero2_cpuoffload": {ZERO_STAGE_KEY: {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
    "deepspeed_zero3_cpuoffload": {
        ZERO_STAGE_KEY: {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
    },
}
DEFAULT_PRESET = "deepspeed_zero2"
# shorthand key -> accepted types
SHORTHAND_KEYS: dict[str, tuple[type, ...]] = {
    "preset": (str,),
    "zero_stage": (int,),
    "offload_optimizer": (bool,),
    "offload_param": (bool,),
    "deepspeed_config": (dict, str),
}
# DeepSpeed's own top-level keys that are passed through (DeepSpeed validates their contents)
DEEPSPEED_KEYS = {
    "zero_optimization", "bf16", "fp16", "train_batch_size", "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps", "gradient_clipping", "steps_per_print", "wall_clock_breakdown",
    "memory_breakdown", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "communication_data_type",
    "data_types", "activation_checkpointing", "flops_profiler", "tensorboard", "wandb", "csv_monitor",
    "comms_logger", "checkpoint", "dump_state", "seq_parallel_communication_data_type",
}  # fmt: skip
OWNED_KEYS = {
    "optimizer": "the optimizer is AdamW built from <role>.training_args (learning_rate, adam_beta1/2, ...)",
    "scheduler": "the LR schedule is <role>.training_args.lr_scheduler_type with warmup_steps / max_steps",
    "prescale_gradients": "gradients are summed over ranks (GlobalBatchInfo semantics); the strategy owns scaling",
    "gradient_predivide_factor": "gradients are summed over ranks (GlobalBatchInfo semantics); the strategy owns "
    "scaling",
    "amp": "precision follows <role>.model_args.dtype (bf16 / fp16 sections of DeepSpeed)",
}
_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def resolve_strategy_config(options: dict[str, Any], prefix: str) -> dict[str, Any]:
    """Validate ``options`` (a role's strategy_config) and merge it into one DeepSpeed config (batch keys open).

    ``prefix`` is ``<role>.strategy_args.strategy_config``; every error names ``<prefix>.<key>``.
    """
    for key in sorted(options):
        if key in OWNED_KEYS:
            raise ValueError(f"{prefix}.{key} is not accepted: {OWNED_KEYS[key]}. Remove it.")
    known = set(SHORTHAND_KEYS) | DEEPSPEED_KEYS
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(
            f"unknown key(s) {[f'{prefix}.{k}' for k in unknown]}; deepspeed_train reads the shorthand keys "
            f"{sorted(SHORTHAND_KEYS)} and DeepSpeed's own keys {sorted(DEEPSPEED_KEYS)}."
        )
    for key, types in SHORTHAND_KEYS.items():
        value = options.get(key)
        if value is not None and (not isinstance(value, types) or (bool not in types and isinstance(value, bool))):
            wanted = " or ".join(t.__name__ for t in types)
            raise ValueError(f"{prefix}.{key} must be {wanted}, got {type(value).__name__} {value!r}.")
    preset = options.get("preset") or DEFAULT_PRESET
    if preset not in PRESETS:
        raise ValueError(f"{prefix}.preset={preset!r} is not a preset; use one of {sorted(PRESETS)}.")
    explicit: dict[str, Any] = {}
    if options.get("deepspeed_config") is not None:
        _deep_merge(explicit, _load_layer(options["deepspeed_config"], f"{prefix}.deepspeed_config"))
    _deep_merge(explicit, _coerce_numbers({k: v for k, v in options.items() if k in DEEPSPEED_KEYS}))
    merged = copy.deepcopy(PRESETS[preset])
    _deep_merge(merged, explicit)
    if not isinstance(merged[ZERO_STAGE_KEY], dict) or merged[ZERO_STAGE_KEY].get("stage") not in (0, 1, 2, 3):
        raise ValueError(f"{prefix}.{ZERO_STAGE_KEY} must be a mapping whose stage is 0, 1, 2 or 3.")
    _apply_shorthand(merged[ZERO_STAGE_KEY], explicit.get(ZERO_STAGE_KEY) or {}, options, prefix)
    return merged


def _load_layer(value: dict[str, Any] | str, where: str) -> dict[str, Any]:
    """An inline dict, or a DeepSpeed JSON file; its top-level keys are checked like strategy_config's own."""
    if isinstance(value, str):
        path = Path(value)
        if path.suffix not in (".json", ""):
            raise ValueError(
                f"{where}={value!r}: give a DeepSpeed JSON file (like ROLL's roll/configs/deepspeed_zero2.json); a "
                "YAML config's mapping goes inline (strategy_config: ${deepspeed_zero2}) instead."
            )
        if not path.is_file():
            raise FileNotFoundError(f"{where}={value!r} is not a file; give a DeepSpeed JSON file or a mapping.")
        layer = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(layer, dict):
            raise ValueError(f"{where}={value!r} must hold a JSON object, got {type(layer).__name__}.")
    else:
        layer = value
    for key in sorted(layer):
        if key in OWNED_KEYS:
            raise ValueError(f"{where}.{key} is not accepted: {OWNED_KEYS[key]}. Remove it.")
        if key not in DEEPSPEED_KEYS:
            raise ValueError(
                f"{where}.{key} is not a DeepSpeed key deepspeed_train passes on; use {sorted(DEEPSPEED_KEYS)}."
            )
    coerced: dict[str, Any] = _coerce_numbers(copy.deepcopy(layer))
    return coerced


def _apply_shorthand(zero: dict[str, Any], explicit: dict[str, Any], options: dict[str, Any], prefix: str) -> None:
    """``zero_stage`` / ``offload_*`` set ``zero`` (the merged zero_optimization) and must agree with ``explicit``."""
    stage = options.get("zero_stage")
    if stage is not None:
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"{prefix}.zero_stage={stage}; DeepSpeed ZeRO stages are 0, 1, 2 and 3.")
        if explicit.get("stage", stage) != stage:
            raise ValueError(
                f"{prefix}.zero_stage={stage} contradicts {prefix}.{ZERO_STAGE_KEY}.stage={explicit['stage']}."
            )
        zero["stage"] = stage
    for key in ("offload_optimizer", "offload_param"):
        wanted = options.get(key)
        if wanted is None:
            continue
        if key in explicit and _offloaded(explicit, key) != wanted:
            raise ValueError(f"{prefix}.{key}={wanted} contradicts {prefix}.{ZERO_STAGE_KEY}.{key}={explicit[key]}.")
        if not wanted:
            zero.pop(key, None)
        elif not _offloaded(zero, key):
            zero[key] = {"device": "cpu"}
    if zero["stage"] != 3 and _offloaded(zero, "offload_param"):
        raise ValueError(
            f"{prefix}.offload_param needs ZeRO stage 3 (got stage {zero['stage']}); DeepSpeed offloads "
            "parameters only when it partitions them. Use zero_stage: 3 or preset: deepspeed_zero3_cpuoffload."
        )
    if zero["stage"] == 0 and _offloaded(zero, "offload_optimizer"):
        raise ValueError(f"{prefix}.offload_optimizer needs ZeRO stage >= 1 (got stage 0).")


def _offloaded(zero: dict[str, Any], key: str) -> bool:
    section = zero.get(key)
    return isinstance(section, dict) and section.get("device", "none") not in ("none", None)


def finalize_deepspeed_config(
    merged: dict[str, Any], args: TrainingArgs, *, dtype: str, world_size: int, prefix: str, pin_memory: bool
) -> dict[str, Any]:
    """Fill the keys ROLL leaves ``auto``: batch sizes (ROLL FAQ), clipping, precision; check explicit ones.

    ``train_batch_size = per_device_train_batch_size x gradient_accumulation_steps x world_size``.
    """
    config = copy.deepcopy(merged)
    derived: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "train_batch_size": args.per_device_train_batch_size * args.gradient_accumulation_steps * world_size,
        "gradient_clipping": float(args.max_grad_norm or 0.0),
    }
    sources = {
        "train_micro_batch_size_per_gpu": "training_args.per_device_train_batch_size",
        "gradient_accumulation_steps": "training_args.gradient_accumulation_steps",
        "train_batch_size": "per_device_train_batch_size x gradient_accumulation_steps x world size "
        f"({world_size}) (ROLL FAQ)",
        "gradient_clipping": "training_args.max_grad_norm",
    }
    for key, value in derived.items():
        given = config.get(key, "auto")
        if given != "auto" and given != value:
            raise ValueError(
                f"{prefix}.{key}={given!r}, but {sources[key]} gives {value!r}; set it to auto (or remove it) "
                "and change training_args instead."
            )
        config[key] = value
    for section, wanted in (("bf16", dtype == "bf16"), ("fp16", dtype == "fp16")):
        given = config.get(section, {}).get("enabled", "auto")
        if given != "auto" and bool(given) != wanted:
            raise ValueError(
                f"{prefix}.{section}.enabled={given!r} contradicts model_args.dtype={dtype!r}; set it to auto "
                "(the dtype decides) or change model_args.dtype."
            )
        config.setdefault(section, {})["enabled"] = wanted
    zero = config.setdefault(ZERO_STAGE_KEY, {})
    for key in [k for k, v in zero.items() if v == "auto"]:
        del zero[key]  # bucket sizes left "auto" take DeepSpeed's defaults
    for key in ("offload_optimizer", "offload_param"):
        if _offloaded(zero, key):
            zero[key].setdefault("pin_memory", pin_memory)
    if _offloaded(zero, "offload_optimizer"):
        config.setdefault("zero_force_ds_cpu_optimizer", False)  # torch AdamW: no DeepSpeedCPUAdam build needed
    config.setdefault("steps_per_print", 10**12)  # the strategy reports metrics itself
    return config


def _deep_merge(base: dict[str, Any], layer: dict[str, Any]) -> None:
    for key, value in layer.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)


def _coerce_numbers(value: Any) -> Any:
    """YAML reads ``1e9`` (no dot) as a string; DeepSpeed's integer fields need the number."""
    if isinstance(value, dict):
        return {k: _coerce_numbers(v) for k, v in value.items()}
    if isinstance(value, str) and _NUMBER.match(value):
        number = float(value)
        return int(number) if number.is_integer() else number
    return value
