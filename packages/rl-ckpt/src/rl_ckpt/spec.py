"""ModelSpec: the architecture numbers a conversion needs, read from a HF config or from Megatron args."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from rl_ckpt.errors import CheckpointError
from rl_ckpt.families import FAMILIES, guess_family_name


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a dense decoder; every number is what both HF and Megatron need to lay out the tensors."""

    model_type: str
    """HF model_type, a key of ``FAMILIES``."""
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    """Number of key / value heads (GQA groups); equals num_attention_heads without GQA."""
    head_dim: int
    """Megatron ``kv_channels``; hidden_size // num_attention_heads unless the config says otherwise (Qwen3)."""
    ffn_hidden_size: int
    vocab_size: int
    """Unpadded (HF / tokenizer) vocabulary size."""
    tied_embeddings: bool
    qkv_bias: bool
    norm_epsilon: float
    rotary_base: float
    max_position_embeddings: int
    hf_config: dict[str, Any] | None = None
    """The original HF config.json when known (carried through Megatron args), written back verbatim."""
    num_experts: int = 0
    """Mixture-of-experts layers (Qwen3-MoE: every layer): experts per layer; 0 for a dense decoder."""
    moe_ffn_hidden_size: int = 0
    """An expert's intermediate size (HF ``moe_intermediate_size``)."""
    moe_topk: int = 0
    """Experts per token (HF ``num_experts_per_tok``)."""
    moe_norm_topk_prob: bool = True
    """Whether the top-k routing weights are renormalised to sum to 1 (HF ``norm_topk_prob``)."""
    moe_shared_expert_ffn_hidden_size: int = 0
    """The shared expert's intermediate size (Qwen2-MoE ``shared_expert_intermediate_size``, its output scaled by a
    sigmoid gate); 0: no shared expert."""

    @property
    def moe(self) -> bool:
        """Whether the decoder's MLPs are mixture-of-experts layers."""
        return self.num_experts > 0

    @property
    def q_per_group(self) -> int:
        """Query heads per key / value group."""
        return self.num_attention_heads // self.num_query_groups

    @property
    def qk_norm(self) -> bool:
        """Whether the family has Qwen3's q / k norms."""
        return FAMILIES.get(self.model_type).qk_norm

    @property
    def vision(self) -> bool:
        """A vision-language model: the decoder is its language model, ``hf_config`` the whole model's config."""
        return self.hf_config is not None and "vision_config" in self.hf_config

    @property
    def fused_experts(self) -> bool:
        """Whether the model's HF files hold each MoE layer's experts as two stacked tensors
        (``mlp.experts.gate_up_proj`` / ``down_proj``, :mod:`rl_ckpt.experts`) rather than per-expert matrices."""
        return self.moe and self.hf_config is not None and self.hf_config.get("model_type") in FUSED_EXPERT_FILES

    def file_name(self, name: str) -> str:
        """A tensor's name in the model's HF files from its text-model name (``model.*``, ``lm_head.weight``) or
        vision-tower name (``visual.*``): Qwen3-VL's files use transformers' module names (``model.language_model.``,
        ``model.visual.``); Qwen2-VL's and Qwen2.5-VL's keep ``model.`` and ``visual.``. Read back with
        :func:`vl_text_name`, which takes either spelling."""
        if self.vision and self.hf_config is not None and self.hf_config.get("model_type") in VL_MODULE_NAMED_FILES:
            return vl_module_name(name)
        return name


VL_TEXT_FAMILIES = {"qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3", "qwen3_vl_moe": "qwen3_moe"}
"""Vision-language model types rl-ckpt converts: their language model as its text family, the vision tower carried
(Megatron: ``vision_model.*`` on the first pipeline stage, the same on every TP rank, as ROLL's mcore_adapter)."""
VISION_MODULE = "vision_model"
"""Megatron's name of a VL model's vision tower (ROLL's mcore_adapter; rl_engines' Megatron strategies)."""
VL_MODULE_NAMED_FILES = frozenset({"qwen3_vl", "qwen3_vl_moe"})
"""VL model types whose HF files name tensors as transformers 5's modules do (the others: ``model.*``, ``visual.*``)."""
FUSED_EXPERT_FILES = frozenset({"qwen3_vl_moe"})
"""Model types whose HF files stack each MoE layer's experts into two tensors (see :mod:`rl_ckpt.experts`)."""
ALWAYS_RENORMALISED = frozenset({"qwen3_vl_moe"})
"""MoE model types whose router always renormalises its top-k weights (no ``norm_topk_prob`` in their config)."""


def vl_text_name(module_name: str) -> str:
    """A VL weight's text-model / ``visual.*`` name from transformers 5's module name (``model.language_model.X`` ->
    ``model.X``, ``model.visual.X`` -> ``visual.X``; other names unchanged)."""
    for module, text in (("model.language_model.", "model."), ("model.visual.", "visual.")):
        if module_name.startswith(module):
            return text + module_name.removeprefix(module)
    return module_name


def vl_module_name(text_name: str) -> str:
    """The inverse of :func:`vl_text_name`."""
    if text_name.startswith("visual."):
        return "model." + text_name
    return "model.language_model." + text_name.removeprefix("model.") if text_name.startswith("model.") else text_name


def rope_parameters(text: Mapping[str, Any]) -> dict[str, Any]:
    """A config section's RoPE parameters (transformers 5: ``rope_parameters``; older files: ``rope_scaling``)."""
    return dict(text.get("rope_parameters") or text.get("rope_scaling") or {})


def language_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The text section of a vision-language ``config.json`` as its text twin's config: the text family's
    ``model_type``, the whole model's tie flag, ``rope_theta``, no rope scaling (multimodal RoPE sections are the
    VL model's own)."""
    family = VL_TEXT_FAMILIES.get(str(cfg.get("model_type")))
    if family is None:
        raise CheckpointError(
            f"config.json describes a vision-language model of model_type={cfg.get('model_type')!r}; rl-ckpt converts "
            f"{sorted(VL_TEXT_FAMILIES)}"
        )
    text = dict(cfg.get("text_config") or {})
    rope = rope_parameters(text)
    text = {key: value for key, value in text.items() if key not in ("rope_scaling", "rope_parameters")}
    text["rope_theta"] = float(rope.get("rope_theta") or text.get("rope_theta") or 10000.0)
    if cfg.get("model_type") in ALWAYS_RENORMALISED:
        text["norm_topk_prob"] = True
    text["model_type"] = family
    text["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    return text


def _rope_theta(cfg: Mapping[str, Any]) -> float:
    # transformers < 5 stores rope_theta at the top level, transformers >= 5 inside rope_parameters.
    if "rope_theta" in cfg:
        return float(cfg["rope_theta"])
    params = cfg.get("rope_parameters") or {}
    return float(params.get("rope_theta", 10000.0))


def spec_from_hf_config(cfg: Mapping[str, Any]) -> ModelSpec:
    """Read a HF config.json dict; raises CheckpointError for an unknown model_type or an unsupported option. A
    vision-language config gives its language model's spec carrying the whole config."""
    if "vision_config" in cfg:
        return replace(spec_from_hf_config(language_config(cfg)), hf_config=copy.deepcopy(dict(cfg)))
    family = FAMILIES.get(str(cfg.get("model_type")))
    if cfg.get("mlp_bias"):
        raise CheckpointError("config.json sets mlp_bias=true, which rl-ckpt does not convert yet")
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    moe = _moe_fields(cfg) if family.moe else {}
    return ModelSpec(
        model_type=family.name,
        num_layers=int(cfg["num_hidden_layers"]),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        ffn_hidden_size=int(cfg["intermediate_size"]),
        vocab_size=int(cfg["vocab_size"]),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=family.qkv_bias(cfg),
        norm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)),
        rotary_base=_rope_theta(cfg),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        hf_config=copy.deepcopy(dict(cfg)),
        **moe,
    )


def _moe_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """A mixture-of-experts family's expert numbers; a layout other than every layer sparse is refused naming the
    config key (only that is mapped)."""
    if int(cfg.get("decoder_sparse_step", 1)) != 1 or cfg.get("mlp_only_layers"):
        raise CheckpointError(
            f"config.json sets decoder_sparse_step={cfg.get('decoder_sparse_step')} / mlp_only_layers="
            f"{cfg.get('mlp_only_layers')}: dense layers between the MoE layers are not mapped yet (every layer MoE is)"
        )
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))  # transformers 5 writes the second
    return {"num_experts": int(experts), "moe_ffn_hidden_size": int(cfg["moe_intermediate_size"]),
            "moe_topk": int(cfg["num_experts_per_tok"]),
            "moe_norm_topk_prob": bool(cfg.get("norm_topk_prob", True)),
            "moe_shared_expert_ffn_hidden_size": int(cfg.get("shared_expert_intermediate_size") or 0)}  # fmt: skip


def mcore_args(spec: ModelSpec, tp: int, pp: int, padded_vocab_size: int, divisible_by: int) -> dict[str, Any]:
    """The ``args`` dict stored in every rank file (megatron-core stores an argparse Namespace with these names)."""
    return {
        "num_layers": spec.num_layers,
        "hidden_size": spec.hidden_size,
        "num_attention_heads": spec.num_attention_heads,
        "group_query_attention": spec.num_query_groups != spec.num_attention_heads,
        "num_query_groups": spec.num_query_groups,
        "kv_channels": spec.head_dim,
        "ffn_hidden_size": spec.ffn_hidden_size,
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "make_vocab_size_divisible_by": divisible_by,
        "padded_vocab_size": padded_vocab_size,
        "vocab_size": spec.vocab_size,
        "untie_embeddings_and_output_weights": not spec.tied_embeddings,
        "add_qkv_bias": spec.qkv_bias,
        "add_bias_linear": False,
        "qk_layernorm": spec.qk_norm,
        "normalization": "RMSNorm",
        "norm_epsilon": spec.norm_epsilon,
        "swiglu": True,
        "position_embedding_type": "rope",
        "rotary_base": spec.rotary_base,
        "max_position_embeddings": spec.max_position_embeddings,
        "model_type_hf": spec.model_type,
        "hf_config": copy.deepcopy(spec.hf_config),
        **_moe_args(spec),
    }


def _moe_args(spec: ModelSpec) -> dict[str, Any]:
    """Megatron's MoE arguments of a MoE ``spec`` (HF's router: softmax, top-k, renormalised when norm_topk_prob)."""
    if not spec.moe:
        return {}
    shared = spec.moe_shared_expert_ffn_hidden_size
    return {
        "num_experts": spec.num_experts,
        "moe_ffn_hidden_size": spec.moe_ffn_hidden_size,
        "moe_router_topk": spec.moe_topk,
        "moe_router_pre_softmax": not spec.moe_norm_topk_prob,
        "moe_shared_expert_intermediate_size": shared or None,
        "moe_shared_expert_gate": shared > 0,
        "moe_grouped_gemm": False,
    }


def arg(args: object, key: str, default: Any = None) -> Any:
    """``args[key]`` for a dict, ``args.key`` for megatron's argparse Namespace; ``default`` when absent."""
    if isinstance(args, Mapping):
        return args.get(key, default)
    return getattr(args, key, default)


def required(args: object, key: str) -> int:
    """``int(args.key)``; raises naming the key when the args lack it (or are not megatron's args at all)."""
    value = arg(args, key)
    if value is None:
        raise CheckpointError(f"the checkpoint's args have no {key!r} (args: {type(args).__name__}); is it megatron's?")
    return int(value)


def _vocab_size(args: object, hf_config: Mapping[str, Any] | None, override: int | None) -> int:
    size = override or arg(args, "vocab_size") or (hf_config or {}).get("vocab_size")
    if not size:
        raise CheckpointError(
            "the Megatron args do not record the unpadded vocabulary size; pass --vocab_size N or --tokenizer_path"
        )
    return int(size)


_HF_VS_MCORE = {
    "num_hidden_layers": "num_layers",
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_attention_heads",
    "intermediate_size": "ffn_hidden_size",
}


def _check_hf_config(spec: ModelSpec, hf_config: Mapping[str, Any]) -> None:
    """Raise when a HF config.json found next to the checkpoint describes another model than its args."""
    if hf_config.get("model_type", spec.model_type) != spec.model_type:
        raise CheckpointError(
            f"the HF config.json found for this checkpoint has model_type={hf_config['model_type']!r} but "
            f"{spec.model_type!r} was asked for (--model_type or the args); drop one of them"
        )
    for hf_key, field_name in _HF_VS_MCORE.items():
        if hf_key in hf_config and int(hf_config[hf_key]) != getattr(spec, field_name):
            raise CheckpointError(
                f"the HF config.json found for this checkpoint says {hf_key}={hf_config[hf_key]} but the Megatron "
                f"args say {field_name}={getattr(spec, field_name)}: it belongs to another model; pass the right "
                "--tokenizer_path"
            )


_SUPPORTED_ARGS: dict[str, tuple[Any, ...]] = {
    "normalization": ("RMSNorm",),
    "position_embedding_type": ("rope",),
    "swiglu": (True,),
    "rotary_percent": (1.0,),
    "add_bias_linear": (False,),
    "apply_layernorm_1p": (False,),
    "multi_latent_attention": (False,),
    "moe_layer_freq": (1,),
    "moe_router_score_function": ("softmax",),
    "moe_router_topk_scaling_factor": (1.0,),
    "moe_expert_capacity_factor": (),
}
"""Megatron args whose other values make a model the families cannot express (absent: fine)."""


def check_supported_args(args: object, hf_config: Mapping[str, Any] | None) -> None:
    """Raise naming the first Megatron argument that describes something rl-ckpt does not convert."""
    for key, allowed in _SUPPORTED_ARGS.items():
        value = arg(args, key)
        if value is not None and value not in allowed:
            raise CheckpointError(
                f"the checkpoint's args set {key}={value!r}; rl-ckpt converts only {key} in {allowed or '(unset)'} "
                "(RMSNorm / SwiGLU / RoPE decoders without linear biases; MoE layers in every layer with a softmax "
                "top-k router and no capacity limit)"
            )
    if arg(args, "use_rope_scaling") and hf_config is None:
        raise CheckpointError(
            "the checkpoint's args set use_rope_scaling (Llama 3.1 RoPE scaling), which the config.json built from "
            "the args would lose; pass --tokenizer_path with the model's HF config.json"
        )


def spec_from_mcore_args(
    args: object,
    vocab_size: int | None = None,
    model_type: str | None = None,
    hf_config: Mapping[str, Any] | None = None,
) -> ModelSpec:
    """Read the ``args`` of a rank file (our dict or megatron-core's Namespace); flags override what it says.

    ``hf_config``: the model's HF config.json when known (carried in our args, or found next to the checkpoint):
    it gives the model type and vocabulary size Megatron-LM's args lack, and must agree with the args' sizes.
    """
    if hf_config is None and isinstance(arg(args, "hf_config"), Mapping):
        hf_config = arg(args, "hf_config")
    if hf_config is not None and "vision_config" in hf_config:  # the language model's numbers, the whole config
        language = spec_from_mcore_args(args, vocab_size, model_type, language_config(hf_config))
        return replace(language, hf_config=copy.deepcopy(dict(hf_config)))
    check_supported_args(args, hf_config)
    heads = required(args, "num_attention_heads")
    hidden = required(args, "hidden_size")
    qkv_bias = bool(arg(args, "add_qkv_bias", False))
    qk_norm = bool(arg(args, "qk_layernorm", False))
    known = (hf_config or {}).get("model_type")
    shared = bool(arg(args, "moe_shared_expert_intermediate_size"))
    guessed = guess_family_name(qkv_bias, qk_norm, arg(args, "num_experts"), shared)
    name = model_type or arg(args, "model_type_hf") or known or guessed
    groups = int(arg(args, "num_query_groups") or heads) if arg(args, "group_query_attention", True) else heads
    spec = ModelSpec(
        model_type=FAMILIES.get(name).name,
        num_layers=required(args, "num_layers"),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        head_dim=int(arg(args, "kv_channels") or hidden // heads),
        ffn_hidden_size=required(args, "ffn_hidden_size"),
        vocab_size=_vocab_size(args, hf_config, vocab_size),
        tied_embeddings=not bool(arg(args, "untie_embeddings_and_output_weights", False)),
        qkv_bias=qkv_bias,
        norm_epsilon=float(arg(args, "norm_epsilon", 1e-5)),
        rotary_base=float(arg(args, "rotary_base", 10000.0)),
        max_position_embeddings=int(arg(args, "max_position_embeddings", 4096)),
        hf_config=copy.deepcopy(dict(hf_config)) if hf_config is not None else None,
        **_moe_fields_from_args(args, hf_config),
    )
    if spec.moe != FAMILIES.get(spec.model_type).moe:
        raise CheckpointError(
            f"the checkpoint's args set num_experts={spec.num_experts} but the model type is {spec.model_type!r} "
            f"(a {'MoE' if FAMILIES.get(spec.model_type).moe else 'dense'} family); pass the right --model_type"
        )
    if hf_config is not None:
        _check_hf_config(spec, hf_config)
    return spec


def _moe_fields_from_args(args: object, hf_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """ModelSpec's MoE fields from Megatron's args (norm_topk_prob from the HF config when known)."""
    experts = int(arg(args, "num_experts") or 0)
    if not experts:
        return {}
    missing = [key for key in ("moe_ffn_hidden_size", "moe_router_topk") if not arg(args, key)]
    if missing:
        raise CheckpointError(f"the checkpoint's args set num_experts={experts} but lack {missing}; are they "
                              "megatron's?")  # fmt: skip
    pre_softmax = bool(arg(args, "moe_router_pre_softmax", False))
    norm = bool((hf_config or {}).get("norm_topk_prob", not pre_softmax))
    return {
        "num_experts": experts,
        "moe_ffn_hidden_size": int(arg(args, "moe_ffn_hidden_size")),
        "moe_topk": int(arg(args, "moe_router_topk")),
        "moe_norm_topk_prob": norm,
        "moe_shared_expert_ffn_hidden_size": int(arg(args, "moe_shared_expert_intermediate_size") or 0),
    }


def hf_config_dict(spec: ModelSpec, dtype: str) -> dict[str, Any]:
    """A HF config.json dict for ``spec``: the original one when it was carried along, else built from numbers."""
    if spec.hf_config is not None:
        carried = copy.deepcopy(spec.hf_config)
        (carried.setdefault("text_config", {}) if spec.vision else carried)["vocab_size"] = spec.vocab_size
        return carried
    family = FAMILIES.get(spec.model_type)
    cfg: dict[str, Any] = {
        "architectures": [family.architecture],
        "model_type": family.name,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.ffn_hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_query_groups,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "tie_word_embeddings": spec.tied_embeddings,
        "rms_norm_eps": spec.norm_epsilon,
        "rope_theta": spec.rotary_base,
        "max_position_embeddings": spec.max_position_embeddings,
        "hidden_act": "silu",
        "torch_dtype": dtype,
    }
    if family.fixed_qkv_bias is None:
        cfg[family.qkv_bias_key] = spec.qkv_bias
    if spec.moe:
        cfg.update(num_experts=spec.num_experts, moe_intermediate_size=spec.moe_ffn_hidden_size,
                   num_experts_per_tok=spec.moe_topk, norm_topk_prob=spec.moe_norm_topk_prob, decoder_sparse_step=1,
                   mlp_only_layers=[])  # fmt: skip
        if spec.moe_shared_expert_ffn_hidden_size:
            cfg["shared_expert_intermediate_size"] = spec.moe_shared_expert_ffn_hidden_size
    return cfg
