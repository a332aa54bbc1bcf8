"""Model families: the HuggingFace <-> Megatron-core name map of each supported dense decoder.

One registry, ``FAMILIES``, keyed by the HF ``model_type``. Adding a family touches this file only. Tensors that
need reshaping (QKV fusion, gate/up fusion, TP splits, vocabulary padding) are handled by ``layout``; a family
lists only its one-to-one per-layer tensors (norms) and a few flags.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rl_ckpt.registry import Registry

# Megatron-core (local spec) names of the two per-layer norms, and their Transformer-Engine fused aliases: with the
# TE spec the input norm lives inside linear_qkv and the pre-MLP norm inside linear_fc1. Readers accept both.
MCORE_NORM_ALIASES: dict[str, str] = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}

_DENSE_NORMS: dict[str, str] = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
}
_QK_NORMS: dict[str, str] = {
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
}


@dataclass(frozen=True)
class ModelFamily:
    """One dense decoder family (RMSNorm, RoPE, SwiGLU MLP, optional QKV bias / qk-norm)."""

    name: str
    """HF ``model_type`` (config.json), e.g. ``"qwen2"``."""
    architecture: str
    """HF ``architectures[0]``, e.g. ``"Qwen2ForCausalLM"``."""
    fixed_qkv_bias: bool | None
    """True / False when the family always / never has q, k, v biases; None: read HF ``attention_bias``."""
    layer_norms: Mapping[str, str] = field(default_factory=lambda: dict(_DENSE_NORMS))
    """Per-layer tensors copied as they are: HF suffix after ``model.layers.N.`` -> mcore suffix after
    ``decoder.layers.N.``; all replicated over TP."""

    moe: bool = False
    """Mixture-of-experts MLPs (a router and per-expert SwiGLU MLPs in every layer; Qwen2-MoE adds a shared expert
    behind a sigmoid gate)."""
    qkv_bias_key: str = "attention_bias"
    """The HF config key of q, k, v biases when the family does not fix them (Qwen2-MoE: ``qkv_bias``)."""
    qkv_bias_default: bool = False
    """Their presence when the config does not say."""

    @property
    def qk_norm(self) -> bool:
        """Whether the family has per-head q / k RMSNorms (Qwen3)."""
        return any("q_norm" in k for k in self.layer_norms)

    def qkv_bias(self, hf_config: Mapping[str, Any]) -> bool:
        """Whether a model of this family with ``hf_config`` has q, k, v biases."""
        if self.fixed_qkv_bias is not None:
            return self.fixed_qkv_bias
        return bool(hf_config.get(self.qkv_bias_key, self.qkv_bias_default))


FAMILIES: Registry[ModelFamily] = Registry("model type", "--model_type")
for _family in (
    ModelFamily("qwen2", "Qwen2ForCausalLM", fixed_qkv_bias=True),
    ModelFamily("llama", "LlamaForCausalLM", fixed_qkv_bias=None),
    ModelFamily("mistral", "MistralForCausalLM", fixed_qkv_bias=False),
    ModelFamily("qwen3", "Qwen3ForCausalLM", fixed_qkv_bias=None, layer_norms={**_DENSE_NORMS, **_QK_NORMS}),
    ModelFamily(
        "qwen3_moe", "Qwen3MoeForCausalLM", fixed_qkv_bias=None, layer_norms={**_DENSE_NORMS, **_QK_NORMS}, moe=True
    ),
    ModelFamily("qwen2_moe", "Qwen2MoeForCausalLM", None, moe=True, qkv_bias_key="qkv_bias", qkv_bias_default=True),
):
    FAMILIES.register(_family.name)(_family)


def guess_family_name(qkv_bias: bool, qk_layernorm: bool, num_experts: int | None = None, shared: bool = False) -> str:
    """Family of a Megatron checkpoint whose args do not name one (megatron-core's own argparse Namespace)."""
    if num_experts:
        return "qwen2_moe" if shared or qkv_bias else "qwen3_moe"
    if qk_layernorm:
        return "qwen3"
    return "qwen2" if qkv_bias else "llama"
