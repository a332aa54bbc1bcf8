"""Vision-language models (Qwen2-VL / Qwen2.5-VL / Qwen3-VL) under megatron_train and megatron_infer, and
``freeze_module_prefix`` on Megatron models (:func:`freeze_parameters`).

The language model is Megatron's ``GPTModel`` built from the config's text section like its text twin (Qwen2-VL and
Qwen2.5-VL: Qwen2; Qwen3-VL: Qwen3), split the same ways (TP, sequence parallelism, PP, virtual pipeline), with
multimodal RoPE: each token's temporal / height / width positions come from the model's own ``get_rope_index``
(transformers) and rotate the frequency sections the config's ``mrope_section`` gives them (Qwen3-VL: interleaved,
``mrope_interleaved``).

The vision tower is transformers' own module, loaded from the same folder and **replicated** on every TP rank of the
first pipeline stage, registered on the first model chunk as ``vision_model`` (ROLL's Megatron name for it, so
``freeze_module_prefix: vision_model`` means what it means in ROLL). Its output replaces the image pads' word
embeddings before the first layer, as transformers does. Qwen3-VL's DeepStack features are added to the image tokens'
hidden states after the first decoder layers; they travel into the decoder as its ``context`` (the input Megatron's
layers pass through untouched without cross-attention), so activation recomputation (``recompute_granularity:
full``) re-adds each micro-batch's own features and returns their gradient. Gradients: every TP rank runs the tower
on the same pictures and gets the complete gradient of the embeddings (column-parallel layers all-reduce their input
gradient; under sequence parallelism the scatter's backward gathers it), so the tower's gradients agree over TP ranks
and are summed over data-parallel ranks like every other replicated weight.

Names: HF files call the tower ``visual.*`` and the language model like its text twin (``model.layers.*``);
transformers 5's modules call them ``model.visual.*`` and ``model.language_model.*``. Both spellings load; weights
are exported under the modules' names, the ones hf_infer and fsdp2_train use.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rl_ckpt.spec import VISION_MODULE, rope_parameters, vl_text_name
from rl_engines.strategies.megatron_config import MegatronOptions
from rl_engines.vision import ROPE_INPUTS, token_types, visual_inputs


def mrope(config: dict[str, Any]) -> tuple[list[int], bool]:
    """``mrope_section`` (frequencies per temporal / height / width axis) and whether they interleave (Qwen3-VL)."""
    rope = rope_parameters(dict(config.get("text_config") or {}))
    section = rope.get("mrope_section")
    if not section or len(section) != 3:
        raise ValueError(f"config.json's text_config names no 3-part mrope_section (got {rope!r})")
    return [int(s) for s in section], bool(rope.get("mrope_interleaved", False))


class InterleavedMRoPE(nn.Module):
    """Qwen3-VL's multimodal RoPE as Megatron's rotary module (``GPTModel.rotary_pos_emb``): frequency ``j`` rotates
    by the height position when ``j % 3 == 1`` and ``j < 3 * section[1]``, by the width position when ``j % 3 == 2``
    and ``j < 3 * section[2]``, else by the temporal one (transformers' ``apply_interleaved_mrope``)."""

    inv_freq: torch.Tensor
    axis: torch.Tensor

    def __init__(self, head_dim: int, base: float, section: list[int]) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        index = torch.arange(head_dim // 2)
        axis = torch.zeros(head_dim // 2, dtype=torch.long)
        for dim in (1, 2):
            axis[(index % 3 == dim) & (index < 3 * section[dim])] = dim
        self.register_buffer("axis", axis, persistent=False)

    def forward(self, position_ids: torch.Tensor, mrope_section: Any = None, cp_group: Any = None) -> torch.Tensor:
        """``position_ids [3, B, S]`` -> ``[S, B, 1, head_dim]`` angles (Megatron's rotary layout)."""
        freqs = position_ids.to(self.inv_freq.device).float()[..., None] * self.inv_freq  # [3, B, S, D/2]
        chosen = freqs.gather(0, self.axis.expand_as(freqs[:1]).clone())[0]  # [B, S, D/2]
        return torch.cat((chosen, chosen), dim=-1)[..., None, :].transpose(0, 1).contiguous()


@dataclass
class MegatronVision:
    """A rank's share of a VL model beyond the language model: the HF model's structure (on the meta device; its
    ``get_rope_index`` and ``get_image_features`` are used) with the real vision tower on the first stage."""

    hf: Any
    """transformers' inner VL model (``Qwen2_5_VLModel``...), its ``visual`` real on the first stage."""
    tower: nn.Module | None
    shapes: dict[str, tuple[int, ...]]
    """The tower's parameter shapes by file name (``visual.*``), on every stage."""
    module_names: dict[str, str]
    """File name -> transformers module name of every weight."""
    deepstack: int
    """Decoder layers after which DeepStack features are added (Qwen3-VL; 0 otherwise)."""

    @property
    def config(self) -> Any:
        return self.hf.config

    def positions(self, ids: torch.Tensor, mask: torch.Tensor, batch: Any, device: torch.device) -> torch.Tensor:
        """``[3, B, S]`` multimodal RoPE positions of ``ids`` (``mask``: the real tokens) with ``batch``'s pictures
        and videos (None: text only), from the model's own ``get_rope_index`` (left padding aware)."""
        rows = ids.cpu()
        visual = visual_inputs(batch, torch.device("cpu")) if batch is not None else {}
        grids = {key: visual[key] for key in ROPE_INPUTS if key in visual}
        rope, _ = self.hf.get_rope_index(rows, token_types(rows, self.config), attention_mask=mask.long().cpu(),
                                         **grids)  # fmt: skip
        return rope.to(device)  # type: ignore[no-any-return]

    def decoder_input(
        self, chunk: Any, ids: torch.Tensor, batch: Any, sequence_parallel: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The first layer's input ``[S, B, H]`` (this rank's sequence slice under sequence parallelism): word
        embeddings (vocabulary-parallel, all-reduced) with the image and video pads' rows replaced by the tower's
        output; and the DeepStack addends ``[layers, S, B, H]`` (zero away from the visual tokens; None without
        them)."""
        words = chunk.embedding.word_embeddings
        scatter = words.reduce_scatter_embeddings
        words.reduce_scatter_embeddings = False  # the whole sequence first: image rows go in before the scatter
        try:
            embeds = words(ids)  # [B, S, H]
        finally:
            words.reduce_scatter_embeddings = scatter
        visual = visual_inputs(batch, ids.device) if batch is not None else {}
        parts = [self._features(ids, visual, kind) for kind in ("image", "video") if _PIXELS[kind] in visual]
        if not parts:
            return _sequence_first(embeds, sequence_parallel), None
        for pads, features in parts:
            rows = torch.cat(features.pooler_output).to(embeds.dtype)
            embeds = embeds.masked_scatter(pads[..., None].expand_as(embeds), rows)
        if not self.deepstack:
            return _sequence_first(embeds, sequence_parallel), None
        addends = torch.stack([  # image and video pads never overlap: each layer's addend is their sum
            torch.stack([_at(pads, torch.cat(features.deepstack_features[layer]).to(embeds.dtype), embeds)
                         for pads, features in parts]).sum(0)
            for layer in range(self.deepstack)
        ])  # fmt: skip
        return _sequence_first(embeds, sequence_parallel), _sequence_first(addends, sequence_parallel, dim=1)

    def _features(self, ids: torch.Tensor, visual: dict[str, torch.Tensor], kind: str) -> tuple[torch.Tensor, Any]:
        """The ``kind`` (image / video) pads of ``ids`` and the tower's features of their pictures / frames."""
        encode = self.hf.get_image_features if kind == "image" else self.hf.get_video_features
        features = encode(visual[_PIXELS[kind]], visual[f"{kind}_grid_thw"], return_dict=True)
        pads = ids == int(getattr(self.config, f"{kind}_token_id"))
        count = sum(int(part.shape[0]) for part in features.pooler_output)
        if int(pads.sum()) != count:
            raise ValueError(f"{kind.capitalize()} features and {kind} tokens do not match: {int(pads.sum())} {kind} "
                             f"pads, {count} {kind} features")  # fmt: skip
        return pads, features


_PIXELS = {"image": "pixel_values", "video": "pixel_values_videos"}


def add_deepstack(layer: int, _module: Any, _args: Any, kwargs: dict[str, Any], output: Any) -> Any:
    """Forward hook (``with_kwargs``) of decoder layer ``layer`` (< ``deepstack``): its hidden states plus that
    layer's DeepStack addend from the decoder's ``context`` (none: a batch without images)."""
    context = kwargs.get("context")
    if context is None:
        return output
    hidden, passed = output
    return hidden + context[layer], passed


def _at(mask: torch.Tensor, rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``[B, S, H]`` zeros with ``rows`` at ``mask``."""
    return torch.zeros_like(like).masked_scatter(mask[..., None].expand_as(like), rows)


def _sequence_first(hidden: torch.Tensor, sequence_parallel: bool, dim: int = 0) -> torch.Tensor:
    """``[..., B, S, H]`` -> ``[..., S, B, H]`` (batch at ``dim``), this rank's sequence slice under sequence
    parallelism (whose backward gathers the gradient of the whole sequence)."""
    out = hidden.transpose(dim, dim + 1).contiguous()
    if sequence_parallel:
        from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

        if dim:  # Megatron scatters the first dimension
            out = scatter_to_sequence_parallel_region(out.transpose(0, dim).contiguous()).transpose(0, dim)
        else:
            out = scatter_to_sequence_parallel_region(out)
    return out


def build_vision(model_path: str, *, first: bool, dtype: torch.dtype, device: torch.device) -> MegatronVision:
    """The VL structure of ``model_path`` on the meta device; on the first stage (``first``) its vision tower real
    (random until the loader fills it from the folder)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        whole = AutoModelForImageTextToText.from_config(config)  # type: ignore[no-untyped-call]
    names = {vl_text_name(name): name for name in whole.state_dict()}
    hf = whole.model
    shapes = {f"visual.{name}": tuple(p.shape) for name, p in hf.visual.named_parameters()}
    tower = None
    if first:
        tower = type(hf.visual)._from_config(config.vision_config)
        tower.to(device=device, dtype=dtype)
        hf.visual = tower
    deepstack = len(getattr(config.vision_config, "deepstack_visual_indexes", None) or ())
    return MegatronVision(hf, tower, shapes, names, deepstack)


def attach_vision(chunks: list[Any], model_path: str, first: bool, dtype: torch.dtype, device: torch.device,
                   role: str, value_head: bool, options: MegatronOptions) -> MegatronVision:  # fmt: skip
    """A VL model's vision tower on the first chunk of the first stage (``vision_model``), and its DeepStack hooks
    on that chunk's first decoder layers; what this does not build is refused naming the key."""
    if value_head:
        raise ValueError(
            f"{role}.model_args.model_name_or_path={model_path!r} is a vision-language model; a value head on it (a "
            "critic) is not built. Use a critic-free estimator (GRPO, REINFORCE++, RLOO) for vision-language runs."
        )
    vision = build_vision(model_path, first=first, dtype=dtype, device=device)
    if not (first and vision.deepstack):
        if first:
            setattr(chunks[0], VISION_MODULE, vision.tower)
        return vision
    layers = chunks[0].decoder.layers
    prefix = f"{role}.strategy_args.strategy_config"
    if len(layers) < vision.deepstack:
        raise ValueError(
            f"{prefix}.pipeline_model_parallel_size={options.pipeline_model_parallel_size}: the first model chunk "
            f"holds {len(layers)} decoder layer(s), but {model_path} adds DeepStack features after its first "
            f"{vision.deepstack}; use fewer stages (or virtual stages) so the first one holds them."
        )
    setattr(chunks[0], VISION_MODULE, vision.tower)
    for index in range(vision.deepstack):
        layers[index].register_forward_hook(functools.partial(add_deepstack, index), with_kwargs=True)
    return vision


def freeze_parameters(model: Any, prefixes: Sequence[str]) -> set[str]:
    """Freeze (``requires_grad`` off) this rank's parameters of ``model`` (a MegatronModel) whose Megatron names
    start with one of ``prefixes`` (``model_args.freeze_module_prefix``, as ROLL matches them on its Megatron models:
    ``vision_model`` is the vision tower; decoder layers are numbered within each stage). A prefix matching no
    parameter of any stage is an error naming it (every stage calls this). Returns the transformers names of the
    frozen vision-tower weights (the same on every rank), which weight syncs send once."""
    if not prefixes:
        return set()
    names = [name for name, _ in model.module.named_parameters()]
    for name, param in model.module.named_parameters():
        if any(name.startswith(prefix) for prefix in prefixes):
            param.requires_grad_(False)
    matched = [{prefix for prefix in prefixes if any(name.startswith(prefix) for name in names)}]
    if model.stage.size > 1:
        everywhere: list[Any] = [None] * model.stage.size
        dist.all_gather_object(everywhere, matched[0], group=model.stage.group)
        matched = everywhere
    unmatched = [prefix for prefix in prefixes if not any(prefix in found for found in matched)]
    if unmatched:
        heads = sorted({".".join(name.split(".")[:2]) for name in names})
        raise ValueError(
            f"{model.role}.model_args.freeze_module_prefix: {unmatched} match no parameter of the Megatron model; "
            f"its parameter names (ROLL's Megatron names) start with {heads}."
        )
    if model.vision is None:
        return set()
    tower = (name.removeprefix("visual.") for name, _ in model.layout.vision)
    return {model.vision.module_names.get(f"visual.{rest}", f"visual.{rest}") for rest in tower
            if any(f"{VISION_MODULE}.{rest}".startswith(prefix) for prefix in prefixes)}  # fmt: skip


def check_vl_options(config: Any, role: str, path: str) -> None:
    """What the Megatron strategies do not build for a vision-language model, refused naming the key."""
    if getattr(config, "use_sequence_packing", False):
        raise ValueError(
            f"{role}.use_sequence_packing: the Megatron strategies do not pack vision-language batches ({path}); set "
            "it to false (fsdp2_train packs them)."
        )
    if config.model_args.lora:
        raise ValueError(
            f"{role}.model_args.lora_target: the Megatron strategies have no LoRA on vision-language models ({path}); "
            "train it full-parameter, or with LoRA on fsdp2_train."
        )
