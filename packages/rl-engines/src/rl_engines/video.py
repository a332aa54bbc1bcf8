"""Videos as frames for Qwen2-VL / Qwen2.5-VL: ``pixel_values_videos``, ``video_grid_thw`` (and Qwen2.5-VL's
``second_per_grid_ts``) in the layout transformers' Qwen2-VL video processor gives, without that processor (it needs
torchvision, which has no CPU build for this torch on the package registry).

A video is a list of frames (PIL images of one size), sampled already (ROLL's ``video_fps`` / ``video_max_frames``
choose them). Each frame goes through the model folder's own image processor: its resize (``smart_resize`` to the
pixel bounds), rescale and normalisation are the image path's, so a frame's patches are exactly an image's. The image
processor writes each image patch ``temporal_patch_size`` times (an image is a still video); a video instead puts
``temporal_patch_size`` consecutive frames side by side in each patch: patch ``(g, i)`` holds patch ``i`` of frames
``g * T .. g * T + T - 1``, channel-major as ``[C, T, P, P]``, and a frame count that is not a multiple of ``T`` is
padded by repeating the last frame, as the video processor does. So a video of ``T`` copies of one picture equals
that picture through the image path, grid ``(1, h, w)``.

The prompt holds ROLL's ``<video>`` (or ``<|video_pad|>`` inside a vision block) once per video, expanded to
``t * h * w / merge_size**2`` pads. Qwen3-VL is refused: its processor writes each temporal patch's timestamp into
the text (``<t seconds>``) and its RoPE numbers video frames by them, which this module does not build.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

VIDEO_PLACEHOLDER = "<video>"
"""How ROLL's video datasets mark a video in a prompt's text."""
VIDEO_PAD = "<|video_pad|>"
VIDEO_TENSORS = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
"""The video inputs a sample may hold, in the model's keyword names (``second_per_grid_ts``: Qwen2.5-VL only)."""
VIDEO_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")


def check_video_model(model_type: str | None) -> None:
    """Videos are built for Qwen2-VL and Qwen2.5-VL; any other model type is refused, naming it."""
    if model_type not in VIDEO_MODEL_TYPES:
        raise ValueError(
            f"video inputs are built for {list(VIDEO_MODEL_TYPES)}, not model_type {model_type!r}: Qwen3-VL's "
            "processor writes each frame group's timestamp into the prompt and numbers video positions by it, which "
            "is not built here. Use images, or a Qwen2-VL / Qwen2.5-VL model."
        )


def frame_patches(processor: Any, frame: Any, size: dict[str, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One frame through the image processor: its patches as ``[n, C, P * P]`` (the first of the processor's identical
    temporal copies) and its grid ``(1, h, w)``."""
    out = processor(images=[frame], return_tensors="pt", **({"size": size} if size else {}))
    temporal = int(processor.temporal_patch_size)
    values = out["pixel_values"]
    channels = values.shape[1] // (temporal * int(processor.patch_size) ** 2)
    return values.reshape(values.shape[0], channels, temporal, -1)[:, :, 0], out["image_grid_thw"][0].long()


def encode_video(
    processor: Any,
    frames: Sequence[Any],
    *,
    fps: float,
    model_type: str | None,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
) -> dict[str, torch.Tensor]:
    """A video's model inputs: ``pixel_values_videos [t * h * w, C * T * P * P]``, ``video_grid_thw [1, 3]`` and, for
    Qwen2.5-VL, ``second_per_grid_ts [1]`` (``T / fps``: the seconds one temporal patch spans at the frames' sampling
    rate ``fps``). ``min_pixels`` / ``max_pixels`` bound each frame's size (ROLL's ``video_min_pixels`` /
    ``video_max_pixels``); unset, the processor's own bounds apply."""
    check_video_model(model_type)
    if not frames:
        raise ValueError("a video needs at least one frame.")
    if fps <= 0:
        raise ValueError(f"video fps must be > 0, got {fps}.")
    size = None
    if min_pixels or max_pixels:
        size = {"shortest_edge": int(min_pixels or processor.min_pixels),
                "longest_edge": int(max_pixels or processor.max_pixels)}  # fmt: skip
    temporal = int(processor.temporal_patch_size)
    encoded = [frame_patches(processor, frame, size) for frame in frames]
    grids = {tuple(grid.tolist()) for _, grid in encoded}
    if len(grids) != 1:
        raise ValueError(f"a video's frames must share one size; these resize to the grids {sorted(grids)}.")
    encoded += [encoded[-1]] * (-len(encoded) % temporal)  # pad with the last frame, as the video processor does
    patches = torch.stack([p for p, _ in encoded])  # [frames, n, C, P * P]
    groups = patches.reshape(len(encoded) // temporal, temporal, *patches.shape[1:]).permute(0, 2, 3, 1, 4)
    grid = encoded[0][1].clone()
    grid[0] = groups.shape[0]
    out = {"pixel_values_videos": groups.reshape(groups.shape[0] * groups.shape[1], -1).contiguous(),
           "video_grid_thw": grid.unsqueeze(0)}  # fmt: skip
    if model_type == "qwen2_5_vl":
        out["second_per_grid_ts"] = torch.tensor([temporal / fps], dtype=torch.float32)
    return out


def encode_videos(processor: Any, videos: Sequence[Sequence[Any]], **options: Any) -> dict[str, torch.Tensor]:
    """:func:`encode_video` of each video, concatenated in order (``{}`` for none)."""
    parts = [encode_video(processor, frames, **options) for frames in videos]
    return {key: torch.cat([part[key] for part in parts]) for key in (parts[0] if parts else {})}
