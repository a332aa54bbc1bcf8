"""Videos as frames for Qwen2-VL / Qwen2.5-VL: ``pixel_values_videos``, ``video_grid_thw`` (and Qwen2.5-VL's
``second_per_grid_ts``) in the layout transformers' Qwen2-VL video processor gives, without that processor (it needs
torchvision, which has no CPU build for this torch on the package registry).

A video is a list of frames (PIL images of one size), sampled already; :func:`frame_count`, :func:`frame_indices` and
:func:`frame_size` are qwen-vl-utils' sampling rules (which frames, at what size) that ROLL's ``data_args.video_*``
drive, for the data loader that decodes the file (apps.rlvr.video_data). Each frame goes through the model folder's
own image processor: its resize (``smart_resize`` to the pixel bounds), rescale and normalisation are the image
path's, so a frame's patches are exactly an image's. The image processor writes each image patch
``temporal_patch_size`` times (an image is a still video); a video instead puts
``temporal_patch_size`` consecutive frames side by side in each patch: patch ``(g, i)`` holds patch ``i`` of frames
``g * T .. g * T + T - 1``, channel-major as ``[C, T, P, P]``, and a frame count that is not a multiple of ``T`` is
padded by repeating the last frame, as the video processor does. So a video of ``T`` copies of one picture equals
that picture through the image path, grid ``(1, h, w)``.

The prompt holds ROLL's ``<video>`` (or ``<|video_pad|>`` inside a vision block) once per video, expanded to
``t * h * w / merge_size**2`` pads. Qwen3-VL's prompt instead gives every temporal patch its own vision block after
its time, ``<0.2 seconds><|vision_start|>...<|vision_end|><1.2 seconds>...`` (:func:`timestamped_video_text`, from
each frame's time in the clip), and the model numbers each block's positions as a one-frame video.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import torch

VIDEO_PLACEHOLDER = "<video>"
"""How ROLL's video datasets mark a video in a prompt's text."""
VIDEO_PAD = "<|video_pad|>"
VIDEO_TENSORS = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
"""The video inputs a sample may hold, in the model's keyword names (``second_per_grid_ts``: Qwen2.5-VL only)."""
VIDEO_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
TIMESTAMPED = ("qwen3_vl", "qwen3_vl_moe")
"""Models whose prompts carry each temporal patch's time (``<t seconds>``) before its own vision block."""
TIMESTAMPS = "video_timestamps"
"""Key of the temporal patches' times (seconds, every video's in order) that :func:`encode_video` returns for a
timestamped model; :func:`timestamped_video_text` writes them into the prompt (it is not a model input)."""
FRAME_FACTOR = 2
"""Sampled frame counts are multiples of this (qwen-vl-utils', as ROLL uses it)."""
MIN_FRAMES = 4
MAX_FRAME_TOKENS = 768
"""A sampled frame's size is bounded by this many merged tokens (qwen-vl-utils' ``VIDEO_MAX_TOKEN_NUM``) and by its
share of ``total_pixels``."""
FRAME_LIST_FPS = 2.0
"""The sampling rate qwen-vl-utils (and so ROLL) assumes for a video given as a list of frame images."""


def check_video_model(model_type: str | None) -> None:
    """Videos are built for Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE; any other model type is refused."""
    if model_type not in VIDEO_MODEL_TYPES:
        raise ValueError(
            f"video inputs are built for {list(VIDEO_MODEL_TYPES)}, not model_type {model_type!r}. Use images, or "
            "one of those models."
        )


def group_times(frame_times: Sequence[float], temporal: int) -> list[float]:
    """Each temporal patch's time: the mean of its first and last frame's (the frame list padded with its last
    frame's time to a multiple of ``temporal``), as Qwen3-VL's processor computes them."""
    times = list(frame_times) + [frame_times[-1]] * (-len(frame_times) % temporal)
    return [(times[i] + times[i + temporal - 1]) / 2 for i in range(0, len(times), temporal)]


def timestamped_video_text(text: str, grids: torch.Tensor, times: torch.Tensor, merge_size: int) -> str:
    """Qwen3-VL's video prompt (transformers 5.2's processor, the version ROLL pins, and vLLM's): the k-th video's
    ``<|vision_start|><|video_pad|><|vision_end|>`` (or a bare ``<|video_pad|>``, vLLM's form; in text order) becomes,
    for each temporal patch, ``<t seconds>`` (one decimal) and a vision block of that patch's ``h * w /
    merge_size**2`` pads. ``times``: every video's patch times in order (``grids[k, 0]`` each)."""
    start, end = "<|vision_start|>", "<|vision_end|>"
    if text.count(VIDEO_PAD) != len(grids):
        raise ValueError(f"the prompt has {text.count(VIDEO_PAD)} video placeholder(s) and {len(grids)} video(s); "
                         f"each video needs one {VIDEO_PLACEHOLDER!r} in the prompt text.")  # fmt: skip
    counts = grids[:, 0].tolist()
    bounds = [sum(counts[:k]) for k in range(len(counts) + 1)]
    blocks = []
    for k, grid in enumerate(grids.tolist()):
        pads = VIDEO_PAD * (grid[1] * grid[2] // merge_size**2)
        own = times[bounds[k] : bounds[k + 1]].tolist()
        blocks.append("".join(f"<{t:.1f} seconds>{start}{pads}{end}" for t in own))
    placeholder = re.escape(f"{start}{VIDEO_PAD}{end}") + "|" + re.escape(VIDEO_PAD)
    order = iter(blocks)
    return re.sub(placeholder, lambda _: next(order), text)  # in text order, wrapped or bare


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
    frame_times: Sequence[float] | None = None,
) -> dict[str, torch.Tensor]:
    """A video's model inputs: ``pixel_values_videos [t * h * w, C * T * P * P]``, ``video_grid_thw [1, 3]`` and, for
    Qwen2.5-VL, ``second_per_grid_ts [1]`` (``T / fps``: the seconds one temporal patch spans at the frames' sampling
    rate ``fps``); for Qwen3-VL, :data:`TIMESTAMPS` ``[t]`` from ``frame_times`` (each frame's time in the clip,
    seconds; :func:`group_times`). ``min_pixels`` / ``max_pixels`` bound each frame's size (ROLL's
    ``video_min_pixels`` / ``video_max_pixels``); unset, the processor's own bounds apply."""
    check_video_model(model_type)
    if not frames:
        raise ValueError("a video needs at least one frame.")
    if fps <= 0:
        raise ValueError(f"video fps must be > 0, got {fps}.")
    if model_type in TIMESTAMPED and (frame_times is None or len(frame_times) != len(frames)):
        raise ValueError(f"a {model_type} video needs each frame's time (frame_times, {len(frames)} values): its "
                         "prompt carries each temporal patch's timestamp.")  # fmt: skip
    size = None
    if min_pixels or max_pixels:
        least, most = pixel_bounds(processor)
        size = {"shortest_edge": int(min_pixels or least), "longest_edge": int(max_pixels or most)}
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
    if model_type in TIMESTAMPED:
        out[TIMESTAMPS] = torch.tensor(group_times(list(frame_times or ()), temporal), dtype=torch.float64)
    return out


def encode_videos(processor: Any, videos: Sequence[Sequence[Any]], **options: Any) -> dict[str, torch.Tensor]:
    """:func:`encode_video` of each video, concatenated in order (``{}`` for none). ``fps`` may be one value per
    video (each video's sampling rate, as ROLL passes them to the processor)."""
    rates = options.pop("fps", None)
    rates = list(rates) if isinstance(rates, (list, tuple)) else [rates] * len(videos)
    times = options.pop("frame_times", None) or [None] * len(videos)
    if len(rates) != len(videos) or len(times) != len(videos):
        raise ValueError(f"{len(videos)} videos, {len(rates)} fps values and {len(times)} frame-time lists; give one "
                         "per video.")  # fmt: skip
    parts = [encode_video(processor, frames, fps=rate, frame_times=when, **options)
             for frames, rate, when in zip(videos, rates, times, strict=True)]  # fmt: skip
    return {key: torch.cat([part[key] for part in parts]) for key in (parts[0] if parts else {})}


# ---- sampling a video file or a list of frames (qwen-vl-utils' fetch_video, as ROLL's data_args.video_* use it) ----
def frame_count(total: int, video_fps: float, *, fps: float, max_frames: int, min_frames: int = MIN_FRAMES) -> int:
    """How many of a video's ``total`` frames (recorded at ``video_fps``) to sample at ``fps``: ``total / video_fps *
    fps`` kept within ``[min_frames, max_frames]`` (rounded up / down to :data:`FRAME_FACTOR`) and ``total``, then
    rounded down to :data:`FRAME_FACTOR`. A video shorter than :data:`FRAME_FACTOR` frames is an error."""
    low = math.ceil(min_frames / FRAME_FACTOR) * FRAME_FACTOR
    high = math.floor(min(max_frames, total) / FRAME_FACTOR) * FRAME_FACTOR
    wanted = min(max(total / video_fps * fps, low), high, total)
    count = math.floor(wanted / FRAME_FACTOR) * FRAME_FACTOR
    if not FRAME_FACTOR <= count <= total:
        raise ValueError(f"a video of {total} frames yields {count} frames to sample; it needs at least "
                         f"{FRAME_FACTOR} (and data_args.video_max_frames >= {FRAME_FACTOR}).")  # fmt: skip
    return count


def frame_indices(total: int, count: int) -> list[int]:
    """``count`` frame indices spread evenly over ``0 .. total - 1`` (first and last included), rounded."""
    return [int(i) for i in torch.linspace(0, total - 1, count).round().long().tolist()]


def pixel_bounds(processor: Any) -> tuple[int, int]:
    """The image processor's resize bounds: least and most pixels of a resized image."""
    size = processor.size
    least, most = (size.get(edge) for edge in ("shortest_edge", "longest_edge"))
    return int(least or processor.min_pixels), int(most or processor.max_pixels)


def smart_size(height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """qwen-vl-utils' ``smart_resize``: the nearest size in multiples of ``factor``, the aspect ratio kept, scaled
    down to at most ``max_pixels`` or up to at least ``min_pixels``."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"a video frame of {width}x{height} is too elongated (aspect ratio above 200).")
    h, w = max(factor, round(height / factor) * factor), max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = math.floor(height / beta / factor) * factor, math.floor(width / beta / factor) * factor
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def frame_size(
    height: int, width: int, frames: int, *, factor: int, min_pixels: int, max_pixels: int, total_pixels: int
) -> tuple[int, int]:
    """The size every sampled frame is resized to: :func:`smart_size` with at least ``min_pixels`` and at most the
    smallest of ``max_pixels``, :data:`MAX_FRAME_TOKENS` tokens and the frame's share of ``total_pixels``
    (``total_pixels / frames * FRAME_FACTOR``), that cap never below ``1.05 * min_pixels``."""
    cap = max(min(MAX_FRAME_TOKENS * factor * factor, total_pixels / frames * FRAME_FACTOR), int(min_pixels * 1.05))
    return smart_size(height, width, factor=factor, min_pixels=min_pixels, max_pixels=int(min(max_pixels, cap)))
