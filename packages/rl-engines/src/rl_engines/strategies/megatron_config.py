"""``strategy_config`` of ``megatron_train`` / ``megatron_infer``: ROLL's Megatron keys, typed and validated once.

Every key ROLL documents for the Megatron strategies is known here; each one is either supported or rejected with
a message naming ``<role>.strategy_args.strategy_config.<key>`` and what to do instead. Pure Python (no megatron).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rl_engines.strategies.base import reject_unknown_keys

NoneType = type(None)

# key -> accepted types; the infer strategy reads only the parallel layout keys
LAYOUT_KEYS: dict[str, tuple[type, ...]] = {
    "tensor_model_parallel_size": (int,),
    "pipeline_model_parallel_size": (int,),
    "context_parallel_size": (int,),
    "expert_model_parallel_size": (int,),
    "virtual_pipeline_model_parallel_size": (int, NoneType),
    "sequence_parallel": (bool,),
}
TRAIN_KEYS: dict[str, tuple[type, ...]] = {
    **LAYOUT_KEYS,
    "recompute_granularity": (str, NoneType),
    "recompute_method": (str, NoneType),
    "recompute_num_layers": (int, NoneType),
    "use_distributed_optimizer": (bool,),
    "overlap_grad_reduce": (bool,),
    "moe_layer_recompute": (bool,),
    "moe_token_dispatcher_type": (str,),
    "moe_grouped_gemm": (bool,),
    "moe_shared_expert_overlap": (bool,),
}
RECOMPUTE_GRANULARITIES = (None, "full", "selective")
RECOMPUTE_METHODS = (None, "uniform", "block")


@dataclass(frozen=True)
class MegatronOptions:
    """The validated Megatron layout and memory options of one role."""

    tensor_model_parallel_size: int = 1
    """Ranks one layer's matrices are split over (Megatron TP); divides the role's world size."""
    sequence_parallel: bool = False
    """Split layer norms / dropout activations along the sequence over the TP ranks (no effect at TP = 1)."""
    recompute_granularity: str | None = None
    """Activation recomputation: ``full`` (whole layers), ``selective`` (core attention) or None (off)."""
    recompute_method: str | None = None
    """With ``full``: ``uniform`` (default) or ``block``."""
    recompute_num_layers: int | None = None
    """With ``full``: layers per recomputed chunk (uniform) or recomputed layers per stage (block); default 1."""

    @property
    def model_parallel_size(self) -> int:
        """Ranks holding one copy of the model (TP; PP and CP are 1 here)."""
        return self.tensor_model_parallel_size


def _check_types(config: dict[str, Any], keys: dict[str, tuple[type, ...]], prefix: str) -> None:
    for key, value in config.items():
        types = keys[key]
        if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
            wanted = " or ".join("null" if t is NoneType else t.__name__ for t in types)
            raise ValueError(f"{prefix}.{key} must be {wanted}, got {type(value).__name__} {value!r}.")
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ValueError(f"{prefix}.{key} must be >= 1, got {value}.")


def _reject_unsupported(config: dict[str, Any], prefix: str) -> None:
    """Keys ROLL accepts that this adapter cannot honour (yet), each with the reason and the alternative."""
    if config.get("pipeline_model_parallel_size", 1) > 1:
        raise ValueError(
            f"{prefix}.pipeline_model_parallel_size={config['pipeline_model_parallel_size']}: pipeline parallelism "
            "is not supported by this adapter yet (megatron-core 0.16.1's pipeline schedules allocate on 'cuda'). "
            "Set it to 1 and use tensor_model_parallel_size, or fsdp2_train for models that need more memory."
        )
    for key, reason in (
        ("context_parallel_size", "needs Transformer Engine attention; the local Megatron spec used here has none"),
        ("expert_model_parallel_size", "applies to MoE models; this adapter supports dense decoders only"),
    ):
        if config.get(key, 1) > 1:
            raise ValueError(f"{prefix}.{key}={config[key]}: {reason}. Set it to 1 (or remove it).")
    if config.get("virtual_pipeline_model_parallel_size") not in (None, 1):
        raise ValueError(
            f"{prefix}.virtual_pipeline_model_parallel_size={config['virtual_pipeline_model_parallel_size']} needs "
            "pipeline_model_parallel_size > 1, which is not supported; remove it."
        )
    moe = sorted(key for key in config if key.startswith("moe_"))
    if moe:
        raise ValueError(
            f"{[f'{prefix}.{key}' for key in moe]} apply to MoE models; this adapter supports dense decoders "
            "(Qwen2 / Qwen3 / Llama / Mistral) only. Remove them."
        )
    if config.get("use_distributed_optimizer"):
        raise ValueError(
            f"{prefix}.use_distributed_optimizer=true: Megatron's DistributedOptimizer needs Megatron's DDP grad "
            "buffers, which this adapter does not use (it runs torch AdamW on each rank's own shards, gradients "
            "summed over data-parallel ranks). Set it to false; fsdp2_train shards optimizer state instead."
        )
    if config.get("overlap_grad_reduce"):
        raise ValueError(
            f"{prefix}.overlap_grad_reduce=true needs Megatron's DDP grad buffers, which this adapter does not use; "
            "set it to false."
        )


def _check_recompute(config: dict[str, Any], prefix: str) -> None:
    granularity = config.get("recompute_granularity")
    if granularity not in RECOMPUTE_GRANULARITIES:
        raise ValueError(f"{prefix}.recompute_granularity={granularity!r}; use full, selective or null.")
    method = config.get("recompute_method")
    if method not in RECOMPUTE_METHODS:
        raise ValueError(f"{prefix}.recompute_method={method!r}; use uniform, block or null.")
    if granularity != "full" and (method is not None or config.get("recompute_num_layers") is not None):
        raise ValueError(
            f"{prefix}.recompute_method / recompute_num_layers apply to recompute_granularity: full only; "
            f"recompute_granularity is {granularity!r}. Remove them or set recompute_granularity: full."
        )


def parse_megatron_options(config: dict[str, Any], role: str, *, train: bool) -> MegatronOptions:
    """Validate a megatron_train (``train``) or megatron_infer strategy_config; errors name every bad key."""
    prefix = f"{role}.strategy_args.strategy_config"
    keys = TRAIN_KEYS if train else LAYOUT_KEYS
    reject_unknown_keys(config, set(keys), prefix)
    _check_types(config, keys, prefix)
    _reject_unsupported(config, prefix)
    _check_recompute(config, prefix)
    tp = int(config.get("tensor_model_parallel_size", 1))
    granularity = config.get("recompute_granularity")
    full = granularity == "full"
    return MegatronOptions(
        tensor_model_parallel_size=tp,
        sequence_parallel=bool(config.get("sequence_parallel", False)) and tp > 1,
        recompute_granularity=granularity,
        recompute_method=(config.get("recompute_method") or "uniform") if full else None,
        recompute_num_layers=(config.get("recompute_num_layers") or 1) if full else None,
    )


def check_world_size(options: MegatronOptions, world_size: int, role: str) -> int:
    """The data-parallel size ``world / TP``; raises naming the key when TP does not divide the world size."""
    tp = options.tensor_model_parallel_size
    if world_size % tp:
        raise ValueError(
            f"{role}.strategy_args.strategy_config.tensor_model_parallel_size={tp} does not divide the role's "
            f"world size {world_size} (len({role}.device_mapping)); pick a divisor."
        )
    return world_size // tp
