"""``strategy_config`` of ``megatron_train`` / ``megatron_infer``: ROLL's Megatron keys, typed and validated once.

Every key ROLL documents or writes for the Megatron strategies is known here; each one is supported, accepted as a
performance-only switch (a kernel choice that does not change what is computed), or rejected with a message naming
``<role>.strategy_args.strategy_config.<key>`` and what to do instead. Pure Python (no megatron).
"""

from __future__ import annotations

import importlib.util
import math
import re
from dataclasses import dataclass
from typing import Any

from rl_engines.strategies.base import reject_unknown_keys

NoneType = type(None)

# Megatron TransformerConfig switches that pick a fused kernel for the same math. The adapter always builds the
# unfused local layer spec (no Transformer Engine / Apex, no torch.compile), so they are accepted and not passed on;
# key -> the kernel it would select and why this build does not use it.
KERNEL_FUSION_SWITCHES: dict[str, str] = {
    "apply_rope_fusion": "Transformer Engine's fused RoPE kernel (not in the local layer spec)",
    "bias_activation_fusion": "a torch.compile-fused bias + SwiGLU (these models have no MLP bias)",
    "masked_softmax_fusion": "Apex's CUDA scaled-masked-softmax kernel",
    "bias_dropout_fusion": "a fused bias-dropout-add (no bias, dropout 0 here)",
    "persist_layer_norm": "Apex's persistent LayerNorm kernel (RMSNorm here is torch's)",
    "memory_efficient_layer_norm": "Apex's memory-efficient LayerNorm kernel (RMSNorm here is torch's)",
}
# Training-only switches of Megatron's DDP / optimizer plumbing that change when or how, not what, is computed.
TRAIN_PERFORMANCE_SWITCHES: dict[str, str] = {
    "gradient_accumulation_fusion": "Apex's kernel that accumulates weight gradients into Megatron DDP's main_grad "
    "buffers (here they accumulate in .grad and are copied into the fp32 masters)",
    "cross_entropy_loss_fusion": "Megatron's fused cross-entropy (the losses here are rl-core's, on "
    "vocabulary-parallel log-probs)",
    "overlap_grad_reduce": "overlapping the data-parallel gradient reduction with the backward in Megatron DDP "
    "buckets (here: one flat all-reduce per dtype after the last micro-batch, the same sum)",
    "overlap_param_gather": "overlapping the distributed optimizer's parameter all-gather with the next forward "
    "(here the updated partitions are broadcast right after the step)",
}
PRECISION_KEYS: dict[str, tuple[type, ...]] = {"bf16": (bool,), "fp16": (bool,)}
"""Megatron's precision flags; they must restate ``model_args.dtype``, the one source of the compute dtype."""

# key -> accepted types; the infer strategy reads only the parallel layout, precision and kernel keys
LAYOUT_KEYS: dict[str, tuple[type, ...]] = {
    "tensor_model_parallel_size": (int,),
    "pipeline_model_parallel_size": (int,),
    "context_parallel_size": (int,),
    "expert_model_parallel_size": (int,),
    "expert_tensor_parallel_size": (int, NoneType),
    "virtual_pipeline_model_parallel_size": (int, NoneType),
    "sequence_parallel": (bool,),
    "account_for_embedding_in_pipeline_split": (bool,),
    "account_for_loss_in_pipeline_split": (bool,),
    "pipeline_model_parallel_layout": (str, NoneType),
}
# Mixture-of-experts settings (a MoE model only); the kernel choices among them are logged when not acted on.
MOE_KEYS: dict[str, tuple[type, ...]] = {
    "moe_token_dispatcher_type": (str,),
    "moe_grouped_gemm": (bool,),
    "moe_permute_fusion": (bool,),
    "moe_aux_loss_coeff": (float, int),
}
COEFFICIENT_KEYS = frozenset({"moe_aux_loss_coeff"})
"""Numbers that may be 0 (a finite number >= 0), unlike the sizes and counts (>= 1)."""
MOE_DISPATCHERS = ("allgather", "alltoall")
MOE_SWITCHES: dict[str, str] = {
    "moe_grouped_gemm": "Transformer Engine's grouped GEMM over a rank's experts (not installed: the experts run one "
    "after another, Megatron's SequentialMLP, the same math)",
    "moe_shared_expert_overlap": "overlapping the shared expert with the token dispatch on CUDA streams (Qwen2-MoE's "
    "shared expert runs after the routed experts here, the same math; Qwen3-MoE has none)",
    "moe_token_dispatcher_type": "the alltoall dispatcher (megatron-core's needs CUDA streams: the allgather "
    "dispatcher runs here, the same routing and results)",
    "moe_permute_fusion": "Transformer Engine's fused token permutation before and after the experts (not installed: "
    "torch's gather / scatter permute the tokens, the same order)",
}
INFER_OPTIMIZER_SWITCHES: dict[str, str] = {
    "use_distributed_optimizer": "a log-prob role has no optimizer (ROLL's files repeat the train role's setting; "
    "its Megatron inference strategy does not read it either)",
}
"""Training keys that ROLL's files also give megatron_infer roles, where they select nothing."""
INFER_KEYS: dict[str, tuple[type, ...]] = {
    **LAYOUT_KEYS,
    **PRECISION_KEYS,
    **dict.fromkeys(KERNEL_FUSION_SWITCHES, (bool,)),
    **MOE_KEYS,
    **dict.fromkeys(INFER_OPTIMIZER_SWITCHES, (bool,)),
    "moe_shared_expert_overlap": (bool,),
}
TRAIN_KEYS: dict[str, tuple[type, ...]] = {
    **INFER_KEYS,
    **dict.fromkeys(TRAIN_PERFORMANCE_SWITCHES, (bool,)),
    "recompute_granularity": (str, NoneType),
    "recompute_method": (str, NoneType),
    "recompute_num_layers": (int, NoneType),
    "recompute_modules": (str, list, NoneType),
    "use_distributed_optimizer": (bool,),
    "distrib_optim_fully_reshardable": (bool,),
    "moe_layer_recompute": (bool,),
    "moe_shared_expert_overlap": (bool,),
}
RECOMPUTE_GRANULARITIES = (None, "full", "selective")
RECOMPUTE_METHODS = (None, "uniform", "block")
RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm")
"""Megatron's selective recompute modules of a dense decoder layer: the attention core, the MLP, the input and
pre-MLP norms (``mla_up_proj`` is MLA attention's, which no model here has)."""
MOE_RECOMPUTE_MODULES = ("moe", "moe_act", "shared_experts")
"""Those of a MoE layer: the whole layer, its experts' activation function, Qwen2-MoE's shared expert (MoE models
only, like the ``moe_*`` keys)."""
RECOMPUTE_MODULE_SWITCHES: dict[str, str] = {
    "layernorm": "megatron-core's norm recompute (CheckpointWithoutOutput) reads Transformer Engine's FP8 state even "
    "without FP8, and Transformer Engine is not installed: the norms' outputs are kept (the same results, more "
    "activation memory)",
    "moe_act": "megatron-core recomputes the experts' activation inside grouped GEMM only (Transformer Engine, not "
    "installed: the experts run one after another, SequentialMLP): their activations are kept (the same results)",
}
"""Selective recompute modules this build cannot act on (memory, not results): accepted, logged, not passed on."""
ADDITIONAL_CONFIGS = "additional_configs"
"""ROLL's (mcore_adapter) mapping of extra TransformerConfig settings; here: more strategy_config keys."""


@dataclass(frozen=True)
class MegatronOptions:
    """The validated Megatron layout and memory options of one role."""

    tensor_model_parallel_size: int = 1
    """Ranks one layer's matrices are split over (Megatron TP); divides the role's world size."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages the decoder layers are split over (Megatron PP, an even split); TP x PP divides the world."""
    virtual_pipeline_model_parallel_size: int = 1
    """Model chunks per pipeline stage (Megatron's virtual pipeline, the interleaved 1F1B schedule; 1: off)."""
    account_for_embedding_in_pipeline_split: bool = False
    """Count the embedding as a layer when splitting the layers over pipeline stages: the first stage holds one
    decoder layer fewer (Megatron's key; ``num_hidden_layers`` + 1 must divide evenly)."""
    account_for_loss_in_pipeline_split: bool = False
    """The same for the output layer and loss: the last stage holds one decoder layer fewer."""
    pipeline_model_parallel_layout: str | None = None
    """Megatron's custom split (``"E|(tt|)*30,L"``): the layers of each virtual stage in order, stages apart by
    ``|``; ``virtual_pipeline_model_parallel_size`` is then the stage count / PP (:func:`pipeline_layout_stages`)."""
    sequence_parallel: bool = False
    """Split layer norms / dropout activations along the sequence over the TP ranks (no effect at TP = 1)."""
    recompute_granularity: str | None = None
    """Activation recomputation: ``full`` (whole layers), ``selective`` (core attention) or None (off)."""
    recompute_method: str | None = None
    """With ``full``: ``uniform`` (default) or ``block``."""
    recompute_num_layers: int | None = None
    """With ``full``: layers per recomputed chunk (uniform) or recomputed layers per stage (block); default 1."""
    recompute_modules: tuple[str, ...] | None = None
    """With ``selective``: the parts of each layer recomputed (Megatron's default: ``core_attn``)."""
    use_distributed_optimizer: bool = False
    """Partition AdamW's state over the data-parallel ranks (ZeRO stage 1, Megatron's DistributedOptimizer)."""
    expert_model_parallel_size: int = 1
    """MoE models: ranks a layer's experts are split over (Megatron EP); divides the data-parallel size."""
    moe_token_dispatcher_type: str = "allgather"
    """MoE models: how tokens reach their experts' ranks (the one that runs here: allgather without CUDA)."""
    moe_layer_recompute: bool = False
    """MoE models: recompute each MoE layer in the backward (Megatron's moe_layer_recompute)."""
    moe_aux_loss_coeff: float | None = None
    """MoE models: the router load-balancing loss coefficient (Megatron's key; None: model_args.moe_aux_loss_coef, else
    the model config's router_aux_loss_coef, see megatron_router)."""
    moe_keys: tuple[str, ...] = ()
    """The MoE-only keys the config sets (an error on a dense model, checked once the model is known)."""
    unused_switches: tuple[str, ...] = ()
    """Performance-only keys set to true that this build does not act on (logged once at start-up)."""
    train: bool = True
    """A megatron_train role (False: megatron_infer)."""

    @property
    def model_parallel_size(self) -> int:
        """Ranks holding one copy of the model (TP x PP; CP is 1 here)."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size


def _check_types(config: dict[str, Any], keys: dict[str, tuple[type, ...]], prefix: str) -> None:
    for key, value in config.items():
        types = keys[key]
        if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
            wanted = " or ".join("null" if t is NoneType else t.__name__ for t in types)
            raise ValueError(f"{prefix}.{key} must be {wanted}, got {type(value).__name__} {value!r}.")
        if key in COEFFICIENT_KEYS and isinstance(value, (int, float)):
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{prefix}.{key} must be a finite number >= 0, got {value!r}.")
        elif isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ValueError(f"{prefix}.{key} must be >= 1, got {value}.")


def _reject_unsupported(config: dict[str, Any], prefix: str) -> None:
    """Keys ROLL accepts that this adapter cannot honour (yet), each with the reason and the alternative."""
    for key, reason in (
        ("context_parallel_size", "needs Transformer Engine attention; the local Megatron spec used here has none"),
    ):
        if config.get(key, 1) > 1:
            raise ValueError(f"{prefix}.{key}={config[key]}: {reason}. Set it to 1 (or remove it).")
    virtual = config.get("virtual_pipeline_model_parallel_size") or 1
    if virtual > 1 and config.get("pipeline_model_parallel_size", 1) == 1:
        raise ValueError(
            f"{prefix}.virtual_pipeline_model_parallel_size={virtual} interleaves model chunks over pipeline stages, "
            f"but pipeline_model_parallel_size is 1; set {prefix}.pipeline_model_parallel_size > 1 or remove it."
        )
    dispatcher = config.get("moe_token_dispatcher_type", "allgather")
    if dispatcher not in MOE_DISPATCHERS:
        raise ValueError(
            f"{prefix}.moe_token_dispatcher_type={dispatcher!r}: use one of {list(MOE_DISPATCHERS)} (flex needs "
            "DeepEP, which this build does not have)."
        )
    expert_tp, tp = config.get("expert_tensor_parallel_size"), config.get("tensor_model_parallel_size", 1)
    if expert_tp is not None and expert_tp != tp:
        raise ValueError(
            f"{prefix}.expert_tensor_parallel_size={expert_tp}: experts split over the TP ranks as the dense layers "
            f"are (Megatron's default, tensor_model_parallel_size={tp}) is what is built; set it to {tp} or remove it."
        )
    if config.get("distrib_optim_fully_reshardable"):
        raise ValueError(
            f"{prefix}.distrib_optim_fully_reshardable=true: a checkpoint here keeps the optimizer state by parameter "
            "name per tensor-parallel rank and stage, so it resumes at another data-parallel size and with or without "
            "use_distributed_optimizer (Megatron's dp_reshardable, its default), not at another tensor- or "
            "pipeline-parallel size; set it to false (or remove it) and change those sizes through a save_hf export."
        )
    if config.get("overlap_param_gather") and not config.get("use_distributed_optimizer"):
        raise ValueError(
            f"{prefix}.overlap_param_gather=true applies to the distributed optimizer (as in Megatron); set "
            f"{prefix}.use_distributed_optimizer: true or remove it."
        )


def _check_precision(config: dict[str, Any], prefix: str, dtype: str, role: str) -> None:
    """``bf16`` / ``fp16`` may restate ``model_args.dtype`` (ROLL files set both); a contradiction is an error."""
    for key in PRECISION_KEYS:
        if key in config and config[key] != (dtype == key):
            fix = f"set {role}.model_args.dtype: {key}" if config[key] else f"remove {prefix}.{key}"
            raise ValueError(
                f"{prefix}.{key}={str(config[key]).lower()} contradicts {role}.model_args.dtype={dtype!r}; the "
                f"compute dtype is model_args.dtype (strategy_config.bf16 / fp16 only restate it): {fix}."
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
    if config.get("moe_layer_recompute") and granularity == "full":
        raise ValueError(
            f"{prefix}.moe_layer_recompute=true with recompute_granularity: full: full recompute already recomputes "
            "the MoE layers (Megatron refuses both); remove one of them."
        )
    modules = recompute_modules(config.get("recompute_modules"))
    if modules is not None and granularity != "selective":
        raise ValueError(
            f"{prefix}.recompute_modules applies to recompute_granularity: selective only (as in Megatron); "
            f"recompute_granularity is {granularity!r}. Remove it or set recompute_granularity: selective."
        )
    wrong = sorted(set(modules or ()) - set(RECOMPUTE_MODULES) - set(MOE_RECOMPUTE_MODULES))
    if wrong:
        raise ValueError(
            f"{prefix}.recompute_modules names {wrong}; a decoder layer recomputes {list(RECOMPUTE_MODULES)}, a MoE "
            f"layer also {list(MOE_RECOMPUTE_MODULES)} (mla_up_proj is MLA attention's, which no model here has)."
        )


def _recompute_modules_here(modules: tuple[str, ...] | None) -> tuple[tuple[str, ...] | None, tuple[str, ...]]:
    """The selective recompute modules passed to Megatron, and those it cannot act on in this build (logged as
    ``recompute_modules.<module>``, :data:`RECOMPUTE_MODULE_SWITCHES`)."""
    if modules is None:
        return None, ()
    te = importlib.util.find_spec("transformer_engine") is not None
    skipped = tuple(m for m in modules if m in RECOMPUTE_MODULE_SWITCHES and not (m == "layernorm" and te))
    return tuple(m for m in modules if m not in skipped), tuple(f"recompute_modules.{m}" for m in skipped)


def recompute_modules(value: str | list[Any] | None) -> tuple[str, ...] | None:
    """ROLL's ``recompute_modules``: a comma-separated string (mcore_adapter's form) or a list."""
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else value
    return tuple(str(item).strip() for item in items if str(item).strip())


def merge_additional_configs(config: dict[str, Any], keys: dict[str, tuple[type, ...]], prefix: str) -> dict[str, Any]:
    """``additional_configs`` (mcore_adapter sets them on the model's TransformerConfig, below the named keys) read
    as more strategy_config keys: each must be one, and a key given both ways takes the named value (ROLL's order)."""
    extra = config.get(ADDITIONAL_CONFIGS)
    rest = {key: value for key, value in config.items() if key != ADDITIONAL_CONFIGS}
    if extra is None:
        return rest
    if not isinstance(extra, dict):
        raise ValueError(f"{prefix}.{ADDITIONAL_CONFIGS} must be a mapping of setting -> value, got {extra!r}.")
    reject_unknown_keys(extra, set(keys), f"{prefix}.{ADDITIONAL_CONFIGS}")
    return {**extra, **rest}


LAYOUT_LAYERS = {"E": "the embedding", "L": "the output layer and loss", "t": "a decoder layer"}
"""The layer letters of ``pipeline_model_parallel_layout`` built here (Megatron's ``m``, an MTP layer, is not)."""


def pipeline_layout_stages(layout: str, key: str) -> tuple[str, ...]:
    """Megatron's ``pipeline_model_parallel_layout`` string as its virtual stages in order, each the letters of its
    layers (Megatron's syntax: ``|`` between stages, ``(...)*n`` and ``x*n`` repeat, commas are cosmetic), checked
    as Megatron checks it: the embedding once, first, and the output layer once, last. ``key`` names it in errors."""
    text = layout.replace(",", "")  # not spaces: megatron-core refuses them
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        text = re.sub(pattern, lambda match: match.group(1) * int(match.group(2)), text)
    stages = tuple(text.split("|"))
    unknown = sorted({letter for stage in stages for letter in stage} - set(LAYOUT_LAYERS))
    if unknown:
        raise ValueError(
            f"{key}={layout!r} holds {unknown}: a layout names " + ", ".join(f"{k} ({v})" for k, v in
            LAYOUT_LAYERS.items()) + " per stage, stages apart by '|' ('m', an MTP layer, is not built here)."
        )  # fmt: skip
    flat = "".join(stages)
    if flat.count("E") != 1 or flat.count("L") != 1 or not flat.startswith("E") or not flat.endswith("L"):
        raise ValueError(
            f"{key}={layout!r}: the embedding 'E' must come once, first, and the output layer 'L' once, last (as "
            "Megatron requires), e.g. 'Ett|tt|tt|ttL'."
        )
    return stages


def _layout(config: dict[str, Any], prefix: str) -> tuple[str | None, int]:
    """``pipeline_model_parallel_layout`` (validated) and the virtual pipeline size: the layout's stage count / PP
    when it is given (as ROLL's mcore_adapter derives it), else ``virtual_pipeline_model_parallel_size``."""
    layout, virtual = config.get("pipeline_model_parallel_layout"), config.get("virtual_pipeline_model_parallel_size")
    if layout is None:
        return None, int(virtual or 1)
    key = f"{prefix}.pipeline_model_parallel_layout"
    splits = ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
    given = [k for k in splits if config.get(k)]
    if given:
        raise ValueError(f"{key} places every layer itself; remove {[f'{prefix}.{k}' for k in given]} (Megatron "
                         "refuses both).")  # fmt: skip
    stages, pp = pipeline_layout_stages(layout, key), int(config.get("pipeline_model_parallel_size", 1))
    if len(stages) % pp:
        raise ValueError(f"{key} has {len(stages)} stages, which {prefix}.pipeline_model_parallel_size={pp} does "
                         "not divide; each rank holds stages / PP of them (the virtual pipeline size).")  # fmt: skip
    if virtual not in (None, len(stages) // pp):
        raise ValueError(f"{prefix}.virtual_pipeline_model_parallel_size={virtual} contradicts {key} ({len(stages)} "
                         f"stages over {pp} ranks: {len(stages) // pp}); remove it.")  # fmt: skip
    if len(stages) // pp > 1 and pp == 1:
        raise ValueError(f"{key} has {len(stages)} stages with {prefix}.pipeline_model_parallel_size=1; give one "
                         "stage, or set pipeline_model_parallel_size.")  # fmt: skip
    return layout, len(stages) // pp


def parse_megatron_options(config: dict[str, Any], role: str, *, train: bool, dtype: str) -> MegatronOptions:
    """Validate a megatron_train (``train``) or megatron_infer strategy_config against the role's
    ``model_args.dtype``; errors name every bad key."""
    prefix = f"{role}.strategy_args.strategy_config"
    keys = TRAIN_KEYS if train else INFER_KEYS
    reject_unknown_keys(config, {*keys, ADDITIONAL_CONFIGS}, prefix)
    config = merge_additional_configs(config, keys, prefix)
    _check_types(config, keys, prefix)
    _reject_unsupported(config, prefix)
    _check_recompute(config, prefix)
    _check_precision(config, prefix, dtype, role)
    switches = KERNEL_FUSION_SWITCHES | TRAIN_PERFORMANCE_SWITCHES
    tp = int(config.get("tensor_model_parallel_size", 1))
    granularity = config.get("recompute_granularity")
    full = granularity == "full"
    unused = tuple(key for key in switches if config.get(key))
    sequence_parallel = bool(config.get("sequence_parallel", False)) and tp > 1
    dispatcher = str(config.get("moe_token_dispatcher_type", "allgather"))
    unused += tuple(key for key in ("moe_grouped_gemm", "moe_shared_expert_overlap", "moe_permute_fusion")
                    if config.get(key))  # fmt: skip
    modules, skipped = _recompute_modules_here(recompute_modules(config.get("recompute_modules")))
    unused += skipped
    if not train:
        unused += tuple(key for key in INFER_OPTIMIZER_SWITCHES if config.get(key))
    if dispatcher == "alltoall" and not _cuda():
        dispatcher, unused = "allgather", (*unused, "moe_token_dispatcher_type")
    layout, virtual = _layout(config, prefix)
    return MegatronOptions(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=int(config.get("pipeline_model_parallel_size", 1)),
        virtual_pipeline_model_parallel_size=virtual,
        pipeline_model_parallel_layout=layout,
        account_for_embedding_in_pipeline_split=bool(config.get("account_for_embedding_in_pipeline_split", False)),
        account_for_loss_in_pipeline_split=bool(config.get("account_for_loss_in_pipeline_split", False)),
        sequence_parallel=sequence_parallel,
        recompute_granularity=granularity,
        recompute_method=(config.get("recompute_method") or "uniform") if full else None,
        recompute_num_layers=(config.get("recompute_num_layers") or 1) if full else None,
        recompute_modules=modules,
        use_distributed_optimizer=train and bool(config.get("use_distributed_optimizer", False)),
        unused_switches=unused,
        expert_model_parallel_size=int(config.get("expert_model_parallel_size", 1)),
        moe_token_dispatcher_type=dispatcher,
        moe_layer_recompute=bool(config.get("moe_layer_recompute", False)),
        moe_aux_loss_coeff=None if config.get("moe_aux_loss_coeff") is None else float(config["moe_aux_loss_coeff"]),
        moe_keys=_moe_keys(config),
        train=train,
    )


def _moe_keys(config: dict[str, Any]) -> tuple[str, ...]:
    """The keys that only a MoE model takes: ``moe_*``, expert parallelism, MoE layers' recompute modules."""
    moe_modules = set(recompute_modules(config.get("recompute_modules")) or ()) & set(MOE_RECOMPUTE_MODULES)
    return tuple(sorted(key for key in config if key.startswith("moe_")
                        or (key == "expert_model_parallel_size" and config[key] > 1)
                        or (key == "expert_tensor_parallel_size" and config[key] is not None)
                        or (key == "recompute_modules" and moe_modules)))  # fmt: skip


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def check_moe_options(options: MegatronOptions, spec: Any, role: str) -> None:
    """The MoE keys against the model (``spec``: rl_ckpt's ModelSpec): none on a dense decoder; on a MoE one, the
    expert count divisible by expert_model_parallel_size and, when training at TP > 1, sequence parallelism (the
    experts are then split over the TP ranks too: Megatron's expert tensor parallelism at its default size, TP)."""
    prefix = f"{role}.strategy_args.strategy_config"
    if not spec.moe:
        if options.moe_keys:
            raise ValueError(
                f"{[f'{prefix}.{key}' for key in options.moe_keys]} apply to MoE models; {role}'s model is a dense "
                f"{spec.model_type} decoder. Remove them."
            )
        return
    ep = options.expert_model_parallel_size
    if spec.num_experts % ep:
        raise ValueError(f"{prefix}.expert_model_parallel_size={ep} does not divide the model's {spec.num_experts} "
                         "experts; pick a divisor.")  # fmt: skip
    tp = options.tensor_model_parallel_size
    if options.train and tp > 1 and not options.sequence_parallel:
        raise ValueError(
            f"{prefix}.tensor_model_parallel_size={tp} on a MoE model ({spec.model_type}) without "
            f"{prefix}.sequence_parallel: megatron-core trains MoE layers at TP > 1 only with sequence parallelism "
            "(as ROLL's MoE files set it); set sequence_parallel: true."
        )


def describe_unused_switches(options: MegatronOptions, role: str) -> str:
    """One line naming the performance-only switches that are set but not acted on, and why ("" when none)."""
    if not options.unused_switches:
        return ""
    switches = (KERNEL_FUSION_SWITCHES | TRAIN_PERFORMANCE_SWITCHES | MOE_SWITCHES
                | INFER_OPTIMIZER_SWITCHES
                | {f"recompute_modules.{m}": reason for m, reason in RECOMPUTE_MODULE_SWITCHES.items()})  # fmt: skip
    reasons = "; ".join(f"{key}: {switches[key]}" for key in options.unused_switches)
    return (
        f"{role}.strategy_args.strategy_config: performance-only switches accepted but not used by this build "
        f"(the computation is the same without them) - {reasons}."
    )


def check_world_size(options: MegatronOptions, world_size: int, role: str) -> int:
    """The data-parallel size ``world / (TP x PP)``; raises naming the keys when TP x PP does not divide the world
    size."""
    tp, pp = options.tensor_model_parallel_size, options.pipeline_model_parallel_size
    prefix = f"{role}.strategy_args.strategy_config"
    if world_size % (tp * pp):
        raise ValueError(
            f"{prefix}.tensor_model_parallel_size={tp} x {prefix}.pipeline_model_parallel_size={pp} = {tp * pp} "
            f"does not divide the role's world size {world_size} (len({role}.device_mapping)); pick divisors."
        )
    dp, ep = world_size // (tp * pp), options.expert_model_parallel_size
    if dp % ep:
        raise ValueError(
            f"{prefix}.expert_model_parallel_size={ep} does not divide the data-parallel size {dp} (world size "
            f"{world_size} / (TP x PP)); the experts are split over data-parallel ranks: pick a divisor."
        )
    return dp
