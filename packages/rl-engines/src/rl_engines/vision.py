"""Vision-language models (Qwen2-VL / Qwen2.5-VL / Qwen3-VL): their prompts with images, and the visual inputs a
rollout batch carries to every role that runs the model.

A prompt's images go through the model folder's own image processor (``preprocessor_config.json``): ``pixel_values
[patches, C * T * P * P]`` and ``image_grid_thw [images, 3]`` (temporal, height, width patches). The text holds one
``<|image_pad|>`` placeholder per image inside ``<|vision_start|> ... <|vision_end|>``, expanded here to
``t * h * w / merge_size**2`` pads, as the models' processors do (the merger folds ``merge_size x merge_size``
patches into one token). The expansion is done here, not by transformers' processor class, because that class
insists on a video processor, which needs torchvision; the result is the same ids.

A rollout batch carries each sample's visual inputs in ``non_tensor_batch["multi_modal_inputs"]`` (verl's name): a
dict of tensors per sample (``{}`` for a sample without images), repeated with its sample for every response.
:func:`visual_inputs` concatenates them for any set of rows in row order, which is how the model reads a batch:
the i-th image's patches belong to the i-th run of image pads in ``input_ids``. Position ids are the model's own
(3-D multimodal RoPE, computed from ``input_ids``, ``image_grid_thw``, ``attention_mask`` and the token types,
``mm_token_type_ids``, derived here from ``input_ids``), so a visual batch passes none.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rl_engines.video import (
    TIMESTAMPS,
    VIDEO_PAD,
    VIDEO_PLACEHOLDER,
    VIDEO_TENSORS,
    encode_videos,
    timestamped_video_text,
)

VISUAL_KEY = "multi_modal_inputs"
"""``non_tensor_batch`` key of the per-sample visual inputs."""
VISUAL_TENSORS = ("pixel_values", "image_grid_thw", *VIDEO_TENSORS)
"""The visual inputs a sample may hold, in the model's keyword names (images; videos: :mod:`rl_engines.video`)."""
ROPE_INPUTS = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")
"""The visual inputs the models' ``get_rope_index`` numbers multimodal positions by."""
IMAGE_PLACEHOLDER = "<image>"
"""How ROLL's (and verl's) multimodal datasets mark an image in a prompt's text."""
VISION_START, VISION_END, IMAGE_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"
VL_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")


def is_vl_config(config: dict[str, Any]) -> bool:
    """A vision-language model's ``config.json`` (a vision tower)."""
    return config.get("model_type") in VL_MODEL_TYPES or "vision_config" in config


def is_vl_model(path: str | Path) -> bool:
    """The HF folder at ``path`` holds a vision-language model."""
    file = Path(path) / "config.json"
    return file.is_file() and is_vl_config(json.loads(file.read_text(encoding="utf-8")))


PLACEHOLDER_IDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def placeholder_token_ids(config: Any) -> list[int]:
    """A vision-language model's placeholder tokens (image / video pads, vision start / end), which generation never
    samples: in a response they would be read as image slots and break the next forward ("Image features and image
    tokens do not match"). Empty for a text model (or a model without a transformers config)."""
    if config is None or not is_vl_config(config.to_dict()):
        return []
    ids = [getattr(config, key, None) for key in PLACEHOLDER_IDS]
    return [int(i) for i in ids if i is not None]


def is_visual(batch: Any) -> bool:
    """``batch`` (a RolloutBatch) carries visual inputs."""
    return VISUAL_KEY in batch.non_tensor_batch


def visual_inputs(batch: Any, device: torch.device, model: Any = None) -> dict[str, torch.Tensor]:
    """The model's visual keyword inputs for ``batch``'s rows: each sample's tensors concatenated in row order
    (``{}`` without images), and, for ``model`` (a VL model, wrapped or not), ``mm_token_type_ids`` of the rows'
    ``input_ids`` (:func:`token_types`)."""
    if not is_visual(batch):
        return {}
    samples = list(batch.non_tensor_batch[VISUAL_KEY])
    out = {}
    for key in VISUAL_TENSORS:
        parts = [sample[key] for sample in samples if sample and key in sample]
        if parts:
            out[key] = torch.cat(parts).to(device)
    if out and model is not None:
        out["mm_token_type_ids"] = token_types(batch.batch["input_ids"], vl_config(model)).to(device)
    return out


def vl_config(model: Any) -> Any:
    """The transformers config of a VL ``model``, or of the module a wrapper holds (DeepSpeed's engine: its own
    ``config`` is DeepSpeed's)."""
    for candidate in (model, getattr(model, "module", None)):
        config = getattr(candidate, "config", None)
        if getattr(config, "image_token_id", None) is not None:
            return config
    raise ValueError(
        f"a batch with images reached {type(model).__name__}, whose config names no image_token_id: only a "
        "vision-language model (Qwen2-VL / Qwen2.5-VL / Qwen3-VL) takes pictures."
    )


def token_types(input_ids: torch.Tensor, config: Any) -> torch.Tensor:
    """``mm_token_type_ids`` of ``input_ids`` for a VL model's ``config``: 1 at image pads, 2 at video pads, 0
    elsewhere, as the models' processors return them. transformers' Qwen-VL models compute their multimodal RoPE
    positions (3-D: temporal, height, width of each image token) only when they get it; without it the image tokens
    would be numbered like text."""
    types = torch.zeros_like(input_ids)
    for value, key in ((1, "image_token_id"), (2, "video_token_id")):
        token = getattr(config, key, None)
        if token is not None:
            types[input_ids == int(token)] = value
    return types


def load_image_processor(path: str | Path, *, min_pixels: int | None = None, max_pixels: int | None = None) -> Any:
    """The folder's image processor; ``min_pixels`` / ``max_pixels`` (ROLL's ``data_args.image_min_pixels`` /
    ``image_max_pixels``) override its resize bounds."""
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(str(path))  # type: ignore[no-untyped-call]
    for key, edge, value in (("min_pixels", "shortest_edge", min_pixels), ("max_pixels", "longest_edge", max_pixels)):
        if not value:
            continue
        if isinstance(processor.size, dict):
            processor.size[edge] = value
        else:  # transformers' SizeDict
            setattr(processor.size, edge, value)
        if getattr(processor, key, None) is not None:  # older processors keep the bounds as attributes too
            setattr(processor, key, value)
    return processor


def encode_images(processor: Any, images: Sequence[Any]) -> dict[str, torch.Tensor]:
    """``pixel_values`` and ``image_grid_thw`` of ``images`` (PIL images) through the image processor; ``{}``
    for none."""
    if not images:
        return {}
    out = processor(images=list(images), return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"].long()}


def expand_image_pads(text: str, grids: torch.Tensor, merge_size: int, pad: str = IMAGE_PAD) -> str:
    """``text`` with its k-th ``pad`` (``<|image_pad|>``, or ``<|video_pad|>`` for videos) repeated
    ``prod(grids[k]) / merge_size**2`` times; the number of pads must equal the number of images / videos (a
    ValueError names both)."""
    kind, placeholder = ("image", IMAGE_PLACEHOLDER) if pad == IMAGE_PAD else ("video", VIDEO_PLACEHOLDER)
    pieces = text.split(pad)
    if len(pieces) - 1 != len(grids):
        raise ValueError(
            f"the prompt has {len(pieces) - 1} {kind} placeholder(s) and {len(grids)} {kind}(s); each {kind} needs "
            f"one {placeholder!r} in the prompt text (or {pad!r} in a chat-templated one)."
        )
    out = [pieces[0]]
    for grid, piece in zip(grids, pieces[1:], strict=True):
        out.append(pad * (int(grid.prod()) // merge_size**2) + piece)
    return "".join(out)


def with_image_tokens(text: str) -> str:
    """ROLL's ``<image>`` / ``<video>`` placeholders as the Qwen-VL vision block
    (``<|vision_start|><|image_pad|><|vision_end|>``, ``<|video_pad|>`` for a video)."""
    for placeholder, pad in ((IMAGE_PLACEHOLDER, IMAGE_PAD), (VIDEO_PLACEHOLDER, VIDEO_PAD)):
        text = text.replace(placeholder, f"{VISION_START}{pad}{VISION_END}")
    return text


def visual_column(samples: Iterable[dict[str, torch.Tensor]]) -> np.ndarray:
    """Per-sample visual input dicts as a ``non_tensor_batch`` column."""
    items = list(samples)
    column = np.empty(len(items), dtype=object)
    for index, item in enumerate(items):
        column[index] = item
    return column


def merge_size(processor: Any) -> int:
    """Patches merged into one token along each side (the image processor's ``merge_size``, 2 for Qwen-VL)."""
    return int(getattr(processor, "merge_size", 2))


def encode_prompt(
    text: str,
    images: Sequence[Any],
    tokenizer: Any,
    processor: Any,
    videos: Sequence[Sequence[Any]] = (),
    **video_options: Any,
) -> tuple[list[int], dict[str, torch.Tensor]]:
    """A prompt's token ids (``text``, chat-templated already, with one ``<|image_pad|>`` per image and one
    ``<|video_pad|>`` per video, or ROLL's ``<image>`` / ``<video>``) and its visual inputs (``{}`` without any).
    ``videos``: each a list of frames, encoded by :func:`rl_engines.video.encode_video` with ``video_options``
    (``fps``, ``model_type``, ``min_pixels``, ``max_pixels``, ``frame_times``; Qwen3-VL's timestamped blocks by
    :func:`rl_engines.video.timestamped_video_text`)."""
    visual = {**encode_images(processor, images), **encode_videos(processor, videos, **video_options)}
    times = visual.pop(TIMESTAMPS, None)  # Qwen3-VL: written into the text, not a model input
    text = with_image_tokens(text)
    if times is not None:
        text = timestamped_video_text(text, visual["video_grid_thw"], times, merge_size(processor))
    for pad, grids in ((IMAGE_PAD, "image_grid_thw"), (VIDEO_PAD, "video_grid_thw")):
        if (grids in visual or pad in text) and not (
            pad == VIDEO_PAD and times is not None
        ):  # pads without pictures raise here
            text = expand_image_pads(text, visual.get(grids, torch.zeros((0, 3))), merge_size(processor), pad)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]), visual
