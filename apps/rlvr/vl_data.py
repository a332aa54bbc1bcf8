"""Vision-language RLVR data as ROLL's VLM pipeline reads it (``roll/datasets/vlm_dataset_utils.py``).

A record holds its prompt (a chat ``messages`` column, or a text ``prompt`` column that ROLL wraps in its question
template) with one ``<image>`` per image, and its images in an ``images`` column: a list whose items are file paths,
raw bytes, ``{"bytes": ..., "path": ...}`` dicts (how HF datasets store an Image feature in parquet), or
``data:image/...;base64,`` strings. (One-RL-to-See-Them-All / Orsta style records keep the answer in
``reward_model.ground_truth`` and the source in ``data_source``; apps.rlvr.data reads them as the ``ground_truth``
and ``tag`` columns, as ROLL maps them.) Images are read as RGB and go through the model's image processor
(``data_args.image_min_pixels`` / ``image_max_pixels`` bound their size), see :mod:`rl_engines.vision`.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from apps.rlvr.data import DataError, left_padded
from apps.rlvr.video_data import VideoOptions, record_video
from rl_core.batch import RolloutBatch
from rl_engines.vision import VISUAL_KEY, encode_prompt, visual_column

IMAGES_KEY = "images"
QUESTION_TEMPLATE = (
    "{Question}  Output the thinking process in <think> </think> and final answer (number) in <answer> </answer> tags."
)
"""ROLL's VLM question template for a text ``prompt`` column (``format_prompt``)."""


def load_image(item: Any, where: str) -> Any:
    """One ``images`` entry as an RGB PIL image; ``where`` names the record in errors."""
    from PIL import Image

    try:
        if isinstance(item, dict):
            item = item.get("bytes") or item.get("path")
        if isinstance(item, (bytes, bytearray)):
            return Image.open(io.BytesIO(item)).convert("RGB")
        if isinstance(item, str) and item.startswith("data:image/"):
            return Image.open(io.BytesIO(base64.b64decode(item.split(",", 1)[1]))).convert("RGB")
        if isinstance(item, str):
            return Image.open(Path(item)).convert("RGB")
    except (OSError, ValueError) as err:
        raise DataError(f"{where}: cannot read image {str(item)[:80]!r} ({err}).") from None
    raise DataError(f"{where}: an image must be a path, bytes, a data: URI or a {{bytes, path}} dict, got "
                    f"{type(item).__name__}.")  # fmt: skip


def record_images(record: dict[str, Any], where: str) -> list[Any]:
    """The record's images (none when it has no ``images`` column or an empty one: a text-only sample)."""
    items = record.get(IMAGES_KEY)
    if items is None:
        return []
    if not isinstance(items, (list, tuple)):
        items = [items]
    return [load_image(item, f"{where} image {i}") for i, item in enumerate(items) if item is not None]


def vl_prompt_batch(
    texts: Sequence[str], records: Sequence[dict[str, Any]], tokenizer: Any, processor: Any, prompt_length: int,
    videos: VideoOptions | None = None, model_type: str | None = None,
) -> RolloutBatch:  # fmt: skip
    """Left-padded prompt ids ``[B, P]`` of chat-templated ``texts`` with their records' images and video (sampled
    by ``videos``, apps.rlvr.video_data, for a ``model_type`` that takes videos), and each sample's visual inputs.
    A prompt longer than ``prompt_length`` is an error (cutting it could cut an image's tokens)."""
    encoded = []
    for text, record in zip(texts, records, strict=True):
        where = f"record {record.get('id', '?')}"
        sampled = record_video(record, videos, int(getattr(processor, "patch_size", 14)), where)
        pixels = sampled[0].frames[0].width * sampled[0].frames[0].height if sampled else None  # their final size
        try:
            ids, visual = encode_prompt(text, record_images(record, where), tokenizer, processor,
                                        [video.frames for video in sampled], fps=[video.rate for video in sampled],
                                        frame_times=[video.times for video in sampled], model_type=model_type,
                                        min_pixels=pixels, max_pixels=pixels)  # fmt: skip
        except ValueError as err:
            raise DataError(f"{where}: {err}") from None
        if len(ids) > prompt_length:
            raise DataError(
                f"{where}: its prompt is {len(ids)} tokens with its images' and video's tokens, more than "
                f"prompt_length={prompt_length}; raise prompt_length or lower data_args.image_max_pixels / "
                "video_max_pixels / video_total_pixels."
            )
        encoded.append((ids, visual))
    column = visual_column(visual for _, visual in encoded)
    return RolloutBatch(left_padded([ids for ids, _ in encoded], tokenizer), {VISUAL_KEY: column})


ROLL_MIN_PIXELS, ROLL_MAX_PIXELS = 4 * 28 * 28, 4096 * 4096
"""ROLL's ``data_args.image_min_pixels`` / ``image_max_pixels`` defaults, which its VLM pipeline always sets on the
processor (the model folder's own bounds do not apply)."""


def image_processor(config: Any, data_args: dict[str, Any] | None = None) -> Any:
    """The actor's image processor when its model is a vision-language one (else None), with the pixel bounds of
    ``data_args`` (the actor's by default; validation passes its own), ROLL's defaults where unset or null."""
    from rl_engines.vision import is_vl_model, load_image_processor

    path = str(config.actor_train.model_args.model_name_or_path)
    if not is_vl_model(path):
        return None
    data_args = config.actor_train.data_args if data_args is None else data_args
    return load_image_processor(path, min_pixels=int(data_args.get("image_min_pixels") or ROLL_MIN_PIXELS),
                                max_pixels=int(data_args.get("image_max_pixels") or ROLL_MAX_PIXELS))  # fmt: skip


def graded_records(records: list[dict[str, Any]], visual: Sequence[dict[str, Any]], processor: Any,
                   model_type: str | None, step: int, max_steps: int) -> list[dict[str, Any]]:  # fmt: skip
    """The records a vision-language rollout's rewards see: each with ``image_sizes`` (``(t, height, width)`` of its
    images after the processor, in pixels), ``vl_model_type`` (the policy's, which decides the boxes' frame in the
    detection reward) and ``global_step`` / ``max_steps`` (its dynamic IoU threshold), as ROLL's reward workers
    get them from the batch."""
    patch = int(getattr(processor, "patch_size", 14))
    out = []
    for record, inputs in zip(records, visual, strict=True):
        grids = inputs.get("image_grid_thw") if inputs else None
        sizes = [] if grids is None else [(int(t), int(h) * patch, int(w) * patch) for t, h, w in grids.tolist()]
        out.append({**record, "image_sizes": sizes, "vl_model_type": model_type, "global_step": step,
                    "max_steps": max_steps})  # fmt: skip
    return out


def model_type(config: Any) -> str | None:
    """The actor's ``model_type`` from its folder's config.json (None when it cannot be read)."""
    import json

    path = Path(str(config.actor_train.model_args.model_name_or_path)) / "config.json"
    return json.loads(path.read_text(encoding="utf-8")).get("model_type") if path.is_file() else None
