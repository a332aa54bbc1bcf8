"""Build a tiny Qwen2-style model and a byte-level BPE tokenizer locally (no hub download).

Used by tests and CPU demos. The defaults keep ``head_dim = hidden_size / num_attention_heads = 32``, the
smallest head size vLLM's CPU backend accepts, so the same folder later loads into every inference engine.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rl_engines.vision import VL_MODEL_TYPES  # the vision-language architectures build_tiny_vl_model builds

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def build_tiny_tokenizer(
    path: str | Path, corpus: Iterable[str], *, vocab_size: int = 512, extra_special_tokens: Iterable[str] = ()
) -> None:
    """Train a byte-level BPE tokenizer on ``corpus`` and save it as a HF tokenizer folder with a ChatML template.

    Special tokens: ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos), as in Qwen2, then
    ``extra_special_tokens`` (ids 3, 4, ...).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[*SPECIAL_TOKENS, *extra_special_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(corpus), trainer=trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", *extra_special_tokens],
        padding_side="left",
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(str(path))


def build_tiny_causal_lm(
    path: str | Path,
    *,
    vocab_size: int = 512,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 2,
    num_key_value_heads: int = 1,
    tie_word_embeddings: bool = True,
    max_position_embeddings: int = 512,
    seed: int = 0,
    eos_token_id: int = 2,
    pad_token_id: int = 0,
) -> None:
    """Save a randomly initialised ``Qwen2ForCausalLM`` (fp32 safetensors) to ``path``.

    Grouped-query attention (2 query heads, 1 KV head) and tied embeddings by default, so weight handling that
    real checkpoints need is exercised. The ids match :func:`build_tiny_tokenizer`'s special tokens.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=max_position_embeddings,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.pad_token_id = pad_token_id
    model.save_pretrained(str(path))


MOE_FAMILIES = ("qwen3_moe", "qwen2_moe")
"""Mixture-of-experts model types :func:`build_tiny_moe_lm` builds."""


def build_tiny_moe_lm(
    path: str | Path,
    *,
    model_type: str = "qwen3_moe",
    vocab_size: int = 512,
    hidden_size: int = 64,
    moe_intermediate_size: int = 32,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 2,
    num_key_value_heads: int = 1,
    router_aux_loss_coef: float = 0.001,
    max_position_embeddings: int = 512,
    seed: int = 0,
    eos_token_id: int = 2,
    pad_token_id: int = 0,
) -> None:
    """Save a randomly initialised mixture-of-experts LM (``Qwen3MoeForCausalLM`` or ``Qwen2MoeForCausalLM``, fp32
    safetensors in HF's per-expert layout) to ``path``: every layer an MoE block of ``num_experts`` experts, top
    ``num_experts_per_tok``; Qwen2-MoE adds its gated shared expert. Untied output head, head size 32 (vLLM's CPU
    minimum); ids as :func:`build_tiny_tokenizer`'s."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if model_type not in MOE_FAMILIES:
        raise ValueError(f"model_type={model_type!r}: build_tiny_moe_lm builds {list(MOE_FAMILIES)}.")
    common: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, moe_intermediate_size=moe_intermediate_size,
        num_experts=num_experts, num_experts_per_tok=num_experts_per_tok, num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
        router_aux_loss_coef=router_aux_loss_coef, max_position_embeddings=max_position_embeddings,
        eos_token_id=eos_token_id, pad_token_id=pad_token_id, bos_token_id=None, tie_word_embeddings=False,
        decoder_sparse_step=1, mlp_only_layers=[], intermediate_size=2 * moe_intermediate_size,
    )  # fmt: skip
    if model_type == "qwen3_moe":
        common.update(head_dim=hidden_size // num_attention_heads, norm_topk_prob=True)  # as Qwen3-30B-A3B
    else:
        common["shared_expert_intermediate_size"] = moe_intermediate_size
    config = AutoConfig.for_model(model_type, **common)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.pad_token_id = pad_token_id
    model.save_pretrained(str(path))


VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
"""Qwen-VL's vision special tokens (ids 3 to 6 in :func:`build_tiny_vl_model`'s tokenizer)."""


def build_tiny_vl_model(
    path: str | Path,
    corpus: Iterable[str],
    *,
    model_type: str = "qwen2_5_vl",
    vocab_size: int = 256,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    vision_depth: int = 2,
    num_key_value_heads: int = 1,
    min_pixels: int = 28 * 28,
    max_pixels: int = 112 * 112,
    seed: int = 0,
) -> None:
    """Save a randomly initialised Qwen2.5-VL, Qwen2-VL, Qwen3-VL or Qwen3-VL-MoE (``model_type``; Qwen3-VL with 4
    experts, 2 per token, in every language layer; fp32 safetensors in HF's
    layout), its tokenizer (:func:`build_tiny_tokenizer` plus :data:`VISION_TOKENS`) and its image processor (the
    model's patches, 14 pixels, 16 for Qwen3-VL; 2 x 2 merged into one token; images resized to ``min_pixels`` ..
    ``max_pixels``) to ``path``. The vision tower has ``vision_depth`` blocks (Qwen2.5-VL: the last one full
    attention, the others windowed; Qwen3-VL: the first one's features also added to the language model's first
    layer, its DeepStack) and projects to the language model's ``hidden_size``; multimodal RoPE splits the 32-wide
    heads' frequencies 4 / 6 / 6 (Qwen3-VL: 6 / 5 / 5, interleaved). ``num_key_value_heads`` 2 lets Megatron split
    them over 2 TP ranks."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if model_type not in VL_MODEL_TYPES:
        raise ValueError(f"model_type={model_type!r}: build_tiny_vl_model builds {list(VL_MODEL_TYPES)}")
    build_tiny_tokenizer(path, corpus, vocab_size=vocab_size, extra_special_tokens=VISION_TOKENS)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    ids: dict[str, Any] = {token: tokenizer.convert_tokens_to_ids(token) for token in VISION_TOKENS}
    text, vision = _tiny_vl_sections(model_type, len(tokenizer), hidden_size, num_hidden_layers, vision_depth)
    text["num_key_value_heads"] = num_key_value_heads
    config = AutoConfig.for_model(
        model_type, text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=True,
    )  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config)  # type: ignore[no-untyped-call]
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    model.save_pretrained(str(path))
    patch = vision.get("patch_size", 14)
    bounds = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    Qwen2VLImageProcessorPil(size=bounds, patch_size=patch).save_pretrained(str(path))


def _tiny_vl_sections(
    model_type: str, vocab: int, hidden: int, layers: int, depth: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The text and vision config sections of a tiny ``model_type`` (see :func:`build_tiny_vl_model`)."""
    text: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=hidden // 32, num_key_value_heads=1, max_position_embeddings=1024,
        rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]}, tie_word_embeddings=True, eos_token_id=2,
        pad_token_id=0, bos_token_id=None,
    )  # fmt: skip
    if model_type == "qwen2_vl":
        return text, dict(depth=depth, embed_dim=32, mlp_ratio=2, num_heads=2, hidden_size=hidden, patch_size=14,
                          spatial_merge_size=2, temporal_patch_size=2)  # fmt: skip
    if model_type in ("qwen3_vl", "qwen3_vl_moe"):
        del text["rope_scaling"]
        if model_type == "qwen3_vl_moe":  # 4 experts of which 2 route each token, in every layer; an expert's
            # width and twice it differ from the hidden size: a stacked expert tensor's orientation shows in its shape
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden * 3 // 4,
                        decoder_sparse_step=1, norm_topk_prob=True, router_aux_loss_coef=0.001,
                        mlp_only_layers=[])  # fmt: skip
        text.update(head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                  "mrope_section": [6, 5, 5], "mrope_interleaved": True})  # fmt: skip
        return text, dict(depth=depth, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                          spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=hidden,
                          num_position_embeddings=64, deepstack_visual_indexes=[0])  # fmt: skip
    return text, dict(depth=depth, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=hidden, window_size=56,
                      fullatt_block_indexes=[depth - 1])  # fmt: skip
