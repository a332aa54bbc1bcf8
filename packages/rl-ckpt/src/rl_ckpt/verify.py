"""``--verify``: logits of the source model and of the converted model on a short fixed input (needs transformers)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from rl_ckpt.errors import CheckpointError
from rl_ckpt.mcore_merge import McoreSource, iter_hf_tensors
from rl_ckpt.spec import hf_config_dict, vl_module_name, vl_text_name

VERIFY_TOKENS = 16
"""Length of the fixed verification input (one sequence)."""


def verify_input(vocab_size: int) -> torch.Tensor:
    """Fixed token ids [1, VERIFY_TOKENS] spread over the vocabulary (no tokenizer needed)."""
    return (torch.arange(VERIFY_TOKENS, dtype=torch.long) * 7919 % vocab_size).unsqueeze(0)


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise CheckpointError("--verify needs transformers: pip install 'rl-ckpt[transformers]'") from None
    return transformers


def model_from_tensors(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Any:
    """A float32 HF CausalLM built from a config dict and a full state dict (lm_head may be absent when tied)."""
    tf = _transformers()
    kwargs = {k: v for k, v in config.items() if k != "model_type"}
    cfg = tf.AutoConfig.for_model(config["model_type"], **kwargs)
    model = _model_class(tf, config).from_config(cfg, attn_implementation="eager").float()
    if "vision_config" in config:  # the files' names -> transformers' module names
        tensors = {vl_module_name(vl_text_name(k)): v for k, v in tensors.items()}
    state = fused_experts({k: v.float() for k, v in tensors.items()}, set(model.state_dict()))
    missing, unexpected = model.load_state_dict(state, strict=False)
    allowed = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    if unexpected or set(missing) - allowed:
        raise CheckpointError(f"converted tensors do not fit the model: missing {missing}, unexpected {unexpected}")
    return model


_PER_EXPERT = re.compile(r"(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def fused_experts(tensors: dict[str, torch.Tensor], model_keys: set[str]) -> dict[str, torch.Tensor]:
    """HF's per-expert checkpoint names (``mlp.experts.<e>.gate_proj.weight``, ...) folded into the fused tensors a
    transformers 5 MoE model holds (``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``),
    where the model has them; everything else as it is."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, tensor in tensors.items():
        match = _PER_EXPERT.fullmatch(name)
        if match is None or f"{match.group(1)}.gate_up_proj" not in model_keys:
            out[name] = tensor
            continue
        experts.setdefault(match.group(1), {}).setdefault(int(match.group(2)), {})[match.group(3)] = tensor
    for prefix, by_expert in experts.items():
        order = sorted(by_expert)
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([by_expert[e]["gate_proj"], by_expert[e]["up_proj"]]) for e in order]
        )
        out[f"{prefix}.down_proj"] = torch.stack([by_expert[e]["down_proj"] for e in order])
    return out


def _model_class(tf: Any, config: dict[str, Any]) -> Any:
    """transformers' auto class of ``config``: a vision-language model's (its logits on text input verify the
    language model; its tensors, the vision tower's too, must all fit)."""
    return tf.AutoModelForImageTextToText if "vision_config" in config else tf.AutoModelForCausalLM


def model_from_folder(path: Path) -> Any:
    """``AutoModelForCausalLM.from_pretrained(path)`` (a VL model's auto class) in float32 with eager attention."""
    tf = _transformers()
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    return _model_class(tf, config).from_pretrained(str(path), attn_implementation="eager").float()


def logits_max_abs_diff(a: Any, b: Any, vocab_size: int) -> float:
    """max |logits_a - logits_b| over the fixed input; logits [1, VERIFY_TOKENS, V]."""
    ids = verify_input(vocab_size)
    with torch.no_grad():
        la = a.eval()(input_ids=ids).logits.float()
        lb = b.eval()(input_ids=ids).logits.float()
    if la.shape != lb.shape:
        raise CheckpointError(f"logits shapes differ: {tuple(la.shape)} vs {tuple(lb.shape)}")
    return float((la - lb).abs().max())


def _merged_model(ckpt: McoreSource) -> Any:
    tensors = dict(iter_hf_tensors(ckpt))
    dtype = next(iter(tensors.values())).dtype
    return model_from_tensors(hf_config_dict(ckpt.spec, str(dtype).removeprefix("torch.")), tensors)


def verify_hf_to_mcore(hf_path: Path, ckpt: McoreSource) -> float:
    """Logits of the original HF model vs the model rebuilt from the written Megatron checkpoint."""
    return logits_max_abs_diff(model_from_folder(hf_path), _merged_model(ckpt), ckpt.spec.vocab_size)


def verify_mcore_to_hf(ckpt: McoreSource, hf_path: Path) -> float:
    """Logits of the model merged from the Megatron rank files vs the written HF folder loaded by transformers."""
    return logits_max_abs_diff(_merged_model(ckpt), model_from_folder(hf_path), ckpt.spec.vocab_size)
