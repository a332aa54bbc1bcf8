"""Model loading and the forward passes every strategy shares: response log-probs, entropy and values.

Batch layout (verl / ROLL): ``prompts [B, P]`` left-padded, ``responses [B, R]`` right-padded,
``input_ids = cat(prompts, responses) [B, P+R]``, ``attention_mask [B, P+R]`` (1 = real token),
``position_ids [B, P+R]``, ``response_mask [B, R]`` (True = the token counts).
"""

from __future__ import annotations

import importlib.util
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rl_core.batch import RolloutBatch
from rl_core.losses import entropy_from_logits
from rl_engines.config import ModelArgs
from rl_engines.strategies import varlen_attention
from rl_engines.vision import VISUAL_KEY, is_visual, is_vl_model, visual_inputs

logger = logging.getLogger(__name__)

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_model_path(model_args: ModelArgs, role: str) -> str:
    """The local model folder, or an error naming ``<role>.model_args.model_name_or_path``."""
    path = model_args.model_name_or_path
    if not path:
        raise ValueError(
            f"{role}.model_args.model_name_or_path is not set; point it (or `pretrain`) at a HF model folder."
        )
    if not Path(path).is_dir():
        raise FileNotFoundError(
            f"{role}.model_args.model_name_or_path={path!r} is not a folder. Give a local HF model folder "
            "(config.json + weights). Workers do not download: the RLVR and agentic pipelines fetch a hub id "
            "(org/name, model_download_type) into a folder before the workers start."
        )
    return path


def load_model(model_args: ModelArgs, role: str, *, dtype: torch.dtype, value_head: bool = False) -> nn.Module:
    """Load a causal LM, or (``value_head``) the same backbone with a 1-output token-classification head."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    path = resolve_model_path(model_args, role)
    kwargs: dict[str, Any] = {"dtype": dtype}
    attention = attention_kernel(model_args, role)
    if attention:
        kwargs["attn_implementation"] = attention
    if is_vl_model(path):
        if value_head:
            raise ValueError(
                f"{role}.model_args.model_name_or_path={path!r} is a vision-language model; a value head on it (a "
                "critic) is not built. Use a critic-free estimator (GRPO, REINFORCE++, RLOO) for vision-language runs."
            )
        from transformers import AutoModelForImageTextToText

        model: Any = AutoModelForImageTextToText.from_pretrained(path, **kwargs)
    elif value_head:  # no dropout before the value head (as verl): training computes the values scoring computes
        config = AutoConfig.from_pretrained(path, num_labels=1)
        config.classifier_dropout = 0.0
        model = AutoModelForTokenClassification.from_pretrained(path, config=config, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    model.config.use_cache = False
    return model  # type: ignore[no-any-return]


def freeze_modules(model: nn.Module, model_args: ModelArgs, role: str) -> set[str]:
    """Freeze (``requires_grad`` off) the parameters ``model_args.freeze_module_prefix`` names, as ROLL does; returns
    their names. A prefix matching no parameter is an error naming it and the model's top-level modules."""
    prefixes = model_args.frozen_prefixes()
    frozen = set()
    for name, param in model.named_parameters():
        if any(name.startswith(prefix) for prefix in prefixes):
            param.requires_grad_(False)
            frozen.add(name)
    unmatched = [prefix for prefix in prefixes if not any(name.startswith(prefix) for name in frozen)]
    if unmatched:
        heads = sorted({".".join(name.split(".")[:2]) for name, _ in model.named_parameters()})
        raise ValueError(
            f"{role}.model_args.freeze_module_prefix: {unmatched} match no parameter of the model; parameter names "
            f"start with {heads}."
        )
    return frozen


def attention_kernel(model_args: ModelArgs, role: str) -> str | None:
    """The transformers attention kernel for ``model_args`` on this worker. Flash-attention needs a CUDA device: with
    its package the worker runs it; without the package, PyTorch's own varlen flash-attention kernel where torch
    ships it (:mod:`~rl_engines.strategies.varlen_attention`); otherwise sdpa (the same attention, another kernel).
    Each substitute is logged."""
    wanted = model_args.attention(f"{role}.model_args")
    if wanted is None or not wanted.startswith("flash_attention"):
        return wanted
    package = "flash_attn_interface" if wanted == "flash_attention_3" else "flash_attn"
    if torch.cuda.is_available() and importlib.util.find_spec(package) is not None:
        return wanted
    if varlen_attention.available():
        logger.warning(
            "[engines] %s.model_args asks for %s; this worker has no %s package, so it runs PyTorch's own "
            "flash-attention varlen kernel (torch.nn.attention.varlen, attention implementation %s): padding and "
            "packing removed as flash-attention does.", role, wanted, package, varlen_attention.TORCH_FLASH,
        )  # fmt: skip
        return varlen_attention.register()
    logger.warning(
        "[engines] %s.model_args asks for %s, which needs a CUDA device and the %s package; this worker has %s, "
        "so it runs sdpa: the same attention (packed rows still attend within their own sample), another kernel.",
        role, wanted, package, "no CUDA device" if not torch.cuda.is_available() else f"no {package}",
    )  # fmt: skip
    return "sdpa"


def is_varlen(kernel: str | None) -> bool:
    """True for the kernels that find packed sequences by their position ids (flash-attention's varlen kind)."""
    return kernel is not None and (kernel.startswith("flash_attention") or kernel == varlen_attention.TORCH_FLASH)


def enable_activation_checkpointing(model: Any) -> None:
    """Non-reentrant activation recomputation; newer transformers (5.23) name it activation_checkpointing_enable,
    older ones (5.17) only have gradient_checkpointing_enable."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def load_tokenizer(path: str) -> Any | None:
    """The tokenizer saved with the model, or None when the folder has none (ids-only use)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        return None


def unwrapped(model: Any) -> Any:
    """The transformers model inside a peft wrapper (the model itself otherwise)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


_EXPERT = re.compile(r"(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.weight")


def fused_expert_slice(targets: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """The view of a transformers 5 fused MoE tensor that checkpoint name ``name`` (``...experts.<e>.gate_proj
    .weight`` / ``up_proj`` / ``down_proj``) stands for: rows ``[:I]`` / ``[I:]`` of ``experts.gate_up_proj[e]``
    ``[2I, H]``, or ``experts.down_proj[e]``; None for any other name."""
    match = _EXPERT.fullmatch(name)
    if match is None:
        return None
    expert, proj = int(match["expert"]), match["proj"]
    fused = targets.get(f"{match['prefix']}.{'down_proj' if proj == 'down' else 'gate_up_proj'}")
    if fused is None or expert >= fused.shape[0]:
        return None
    if proj == "down":
        return fused.data[expert]
    half = fused.shape[1] // 2
    return fused.data[expert, :half] if proj == "gate" else fused.data[expert, half:]


def in_checkpoint_names(model: Any, weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` under the names a model folder stores them in: transformers 5 loads some checkpoints into other
    tensors than it stores (a MoE layer's per-expert ``experts.<e>.gate_proj.weight`` / ``up_proj`` / ``down_proj``
    become ``experts.gate_up_proj [E, 2I, H]`` / ``experts.down_proj``); this undoes that for engines that load
    checkpoint names (vLLM, SGLang), one tensor at a time, as ``save_pretrained`` does. Other tensors pass as they
    are."""
    from transformers.core_model_loading import revert_weight_conversion

    hf_model = unwrapped(model)
    for name, tensor in weights:
        yield from revert_weight_conversion(hf_model, {name: tensor}).items()


def response_length(batch: RolloutBatch) -> int:
    """``R``: the width of ``responses`` (or of ``response_mask``)."""
    key = "responses" if "responses" in batch else "response_mask"
    return int(batch.batch[key].shape[1])


def model_inputs(batch: RolloutBatch, device: torch.device, model: Any = None) -> dict[str, torch.Tensor]:
    """``input_ids`` / ``attention_mask`` / ``position_ids`` on ``device``; position ids derived if absent. A
    visual batch (:mod:`rl_engines.vision`) gives its visual inputs for ``model`` instead of position ids (the
    model computes its multimodal ones)."""
    input_ids = batch.batch["input_ids"].to(device)
    attention_mask = batch.batch["attention_mask"].to(device)
    if is_visual(batch):
        visual = visual_inputs(batch, device, unwrapped(model) if model is not None else None)
        return {"input_ids": input_ids, "attention_mask": attention_mask.long(), **visual}
    if "position_ids" in batch:
        position_ids = batch.batch["position_ids"].to(device)
    else:
        position_ids = position_ids_from_mask(attention_mask)
    return {"input_ids": input_ids, "attention_mask": attention_mask.long(), "position_ids": position_ids}


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counting real tokens only (left padding gets 0): ``cumsum(mask) - 1`` clamped at 0."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def response_log_probs(
    logits: torch.Tensor, responses: torch.Tensor, *, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``responses [B, R]`` under ``logits [B, R, V]`` (already aligned: row t predicts token t).

    ``log_softmax(logits / temperature)`` gathered at the response ids, in float32; entropy of the same
    distribution when asked. Returns ``([B, R], [B, R] | None)``.
    """
    scaled = logits.float()
    if temperature != 1.0:
        scaled = scaled / temperature
    picked = scaled.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    log_probs = picked - torch.logsumexp(scaled, dim=-1)
    entropy = entropy_from_logits(scaled) if with_entropy else None
    return log_probs, entropy


def forward_log_probs(
    model: nn.Module,
    batch: RolloutBatch,
    device: torch.device,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward pass; log-probs (and entropy) of the batch's responses, ``[B, R]`` each, on ``device``."""
    resp_len = response_length(batch)
    out = model(**model_inputs(batch, device, model), use_cache=False)
    logits = out.logits[:, -resp_len - 1 : -1, :]  # [B, R, V]: position t predicts token t + 1
    responses = batch.batch["responses"].to(device)
    return response_log_probs(logits, responses, temperature=temperature, with_entropy=with_entropy)


def forward_values(model: nn.Module, batch: RolloutBatch, device: torch.device) -> torch.Tensor:
    """Critic values ``[B, R]`` of the state before each response token (ROLL / verl convention)."""
    resp_len = response_length(batch)
    out = model(**model_inputs(batch, device, model), use_cache=False)
    return out.logits[:, -resp_len - 1 : -1, 0].float()  # type: ignore[no-any-return]


def forward_outputs(
    model: nn.Module, batch: RolloutBatch, device: torch.device, *, value_head: bool, temperature: float,
    with_entropy: bool,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """``values`` of a value-head model, else ``log_probs`` (and ``entropy``); ``[B, R]`` each, on ``device``.
    (:meth:`rl_engines.strategies.micro_batches.MicroBatchPlanner.forward` runs it padded or trimmed.)"""
    if value_head:
        return {"values": forward_values(model, batch, device)}
    log_probs, entropy = forward_log_probs(model, batch, device, temperature=temperature, with_entropy=with_entropy)
    return {"log_probs": log_probs} if entropy is None else {"log_probs": log_probs, "entropy": entropy}


def widen(outputs: dict[str, torch.Tensor], width: int) -> dict[str, torch.Tensor]:
    """``[B, r]`` outputs of a padding-free pass back to the batch's ``[B, R]``, 0 in the columns it did not see."""
    return {key: nn.functional.pad(value, (0, width - value.shape[1])) for key, value in outputs.items()}


def without_padding_columns(batch: RolloutBatch, round_to: int = 1) -> RolloutBatch:
    """The model inputs of ``batch`` (``input_ids``, ``attention_mask``, ``position_ids`` when given,
    ``responses``) cut to the columns :func:`kept_columns` keeps (visual inputs kept whole)."""
    mask, responses = batch.batch["attention_mask"], response_length(batch)
    prompts = mask.shape[1] - responses
    start, end = kept_columns(mask, responses, round_to)
    tensors = {key: batch.batch[key][:, start:end] for key in ("input_ids", "attention_mask", "position_ids")
               if key in batch}  # fmt: skip
    for key in ("responses", "response_mask"):
        if key in batch:
            tensors[key] = batch.batch[key][:, : end - prompts]
    others = {VISUAL_KEY: batch.non_tensor_batch[VISUAL_KEY]} if is_visual(batch) else {}
    return RolloutBatch(tensors, others)


def kept_columns(attention_mask: torch.Tensor, responses: int, round_to: int = 1) -> tuple[int, int]:
    """``(start, end)``: the columns from the first real prompt token of any sample to the last real response token
    of any sample (``responses`` right-padded response columns at the end), widened to a multiple of ``round_to``
    (responses first, then prompts) within the batch. At least the last prompt column stays (it predicts the first
    response token) and one response column."""
    mask = attention_mask.to(torch.bool)
    total = mask.shape[1]
    prompts = total - responses
    used = mask.any(dim=0).nonzero().flatten().tolist()  # ascending
    prompt_columns, response_columns = [c for c in used if c < prompts], [c for c in used if c >= prompts]
    start = min(prompt_columns[0], prompts - 1) if prompt_columns else prompts - 1
    end = response_columns[-1] + 1 if response_columns else prompts + 1
    short = (-(end - start)) % round_to
    grow = min(short, total - end)
    return max(start - (short - grow), 0), end + grow
