"""Video RLVR data as ROLL reads it: a record's ``video`` (a file path, or a list of frame image paths; relative ones
under ``data_args.video_folder``) sampled by ``data_args.video_fps`` / ``video_max_frames`` / ``video_min_pixels`` /
``video_max_pixels`` / ``video_total_pixels`` (ROLL's DataArguments defaults where unset), see
:func:`rl_engines.video.sample_video`; and the Video-R1 record layout that ROLL's
``custom_data_kwargs_func: roll.datasets.vlm_dataset_utils.video_r1_get_data_kwargs`` reads (``problem``,
``problem_type``, ``modality_type``, ``solution``, ``video``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from apps.rlvr.data import DataError

VIDEO_KEY = "video"
VIDEO_KEYS = ("video_fps", "video_max_frames", "video_min_pixels", "video_max_pixels", "video_total_pixels",
              "video_folder")  # fmt: skip
"""The ``data_args`` keys read here."""
VIDEO_R1 = "roll.datasets.vlm_dataset_utils.video_r1_get_data_kwargs"
"""The ROLL data function whose record layout :func:`video_r1_record` reads."""


@dataclass(frozen=True)
class VideoOptions:
    """How a record's video is sampled (ROLL's ``data_args.video_*``, its defaults where unset)."""

    fps: float = 2.0
    max_frames: int = 128
    min_pixels: int = 4 * 28 * 28
    max_pixels: int = 2048 * 2048
    total_pixels: int = 16384 * 28 * 28
    folder: str | None = None

    @staticmethod
    def check(data_args: dict[str, Any], section: str) -> None:
        """Each ``video_*`` number is positive (the frame count and pixel bounds whole numbers) and
        ``video_min_pixels`` <= ``video_max_pixels``; a DataError names ``<section>.data_args.<key>`` otherwise."""
        for key, kind in (("fps", float), ("max_frames", int), ("min_pixels", int), ("max_pixels", int),
                          ("total_pixels", int)):  # fmt: skip
            value = data_args.get(f"video_{key}")
            valid = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
            if value is not None and not (valid and (kind is float or float(value).is_integer())):
                raise DataError(f"{section}.data_args.video_{key}={value!r}: give a positive "
                                f"{'number' if kind is float else 'whole number'}.")  # fmt: skip
        low, high = data_args.get("video_min_pixels"), data_args.get("video_max_pixels")
        if low is not None and high is not None and low > high:
            raise DataError(f"{section}.data_args.video_min_pixels={low} exceeds video_max_pixels={high}.")

    @classmethod
    def from_data_args(cls, data_args: dict[str, Any]) -> VideoOptions:
        """From ``data_args`` (null values keep the defaults)."""
        given = {key: data_args.get(f"video_{key}") for key in ("fps", "max_frames", "min_pixels", "max_pixels",
                                                                 "total_pixels", "folder")}  # fmt: skip
        return cls(**{key: value for key, value in given.items() if value is not None})

    def sample(self, source: Any, patch_size: int, where: str) -> SampledVideo:
        """The record's video sampled; ``where`` names the record in errors."""
        source = self._located(source, where)
        try:
            return sample_video(source, patch_size=patch_size, fps=float(self.fps), max_frames=int(self.max_frames),
                                min_pixels=int(self.min_pixels), max_pixels=int(self.max_pixels),
                                total_pixels=int(self.total_pixels))  # fmt: skip
        except (OSError, ValueError, ImportError) as err:
            raise DataError(f"{where}: {err}") from None

    def _located(self, source: Any, where: str) -> Any:
        """Relative paths under ``folder``; a video is a path or a list of frame paths."""
        if isinstance(source, str):
            return self._path(source)
        if isinstance(source, (list, tuple)) and source and all(isinstance(item, str) for item in source):
            return [self._path(item) for item in source]
        raise DataError(f"{where}: its {VIDEO_KEY!r} must be a video file path or a list of frame image paths, got "
                        f"{str(source)[:80]!r}.")  # fmt: skip

    def _path(self, name: str) -> Path:
        path = Path(name)
        return path if path.is_absolute() or not self.folder else Path(self.folder) / path


def read_frames(path: str | Path, wanted: Any) -> tuple[list[Any], float]:
    """The frames of a video file (PyAV, ``pip install av``) as RGB PIL images, and its frame rate. ``wanted(total,
    fps)`` returns the indices to keep once the frame count is known: the container's count, or, where it announces
    none or more than it holds, the count of frames actually decoded (as ROLL's decoders count them)."""
    try:
        import av
    except ImportError:
        raise ImportError(f"reading the video {path} needs PyAV: pip install av (or give the video as a list of "
                          "frame images).") from None  # fmt: skip
    if not Path(path).is_file():
        raise FileNotFoundError(f"video {path} does not exist; check data_args.video_folder and the record's video.")
    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            rate, total = float(stream.average_rate or stream.guessed_rate or 0), int(stream.frames)
        if rate <= 0:
            raise ValueError(f"video {path}: cannot read its frame rate.")
        keep = set(wanted(total, rate)) if total else set()
        frames, decoded = _decode(av, path, keep)
        if len(frames) != len(keep) or not total:  # no count, or fewer frames than announced: sample what is there
            if decoded < 1:
                raise ValueError(f"video {path}: no frame could be decoded.")
            keep = set(wanted(decoded, rate))
            frames, _ = _decode(av, path, keep)
    except (av.FFmpegError, IndexError) as err:  # IndexError: no video stream
        raise ValueError(f"video {path}: cannot decode it ({err}).") from None
    return frames, rate


def _decode(av: Any, path: str | Path, keep: set[int]) -> tuple[list[Any], int]:
    """The frames at ``keep`` in order and how many frames were decoded (all of them, unless every kept frame came
    before the end: decoding stops after the last one)."""
    frames, decoded = [], 0
    with av.open(str(path)) as container:
        for index, frame in enumerate(container.decode(container.streams.video[0])):
            decoded = index + 1
            if index in keep:
                frames.append(frame.to_image().convert("RGB"))
                if len(frames) == len(keep):
                    break
    return frames, decoded


@dataclass(frozen=True)
class SampledVideo:
    """A video as the model sees it: ``frames`` (RGB PIL images of one size), the ``rate`` they were sampled at
    (frames per second: Qwen2.5-VL's ``second_per_grid_ts``) and each frame's ``times`` in the clip (seconds:
    Qwen3-VL's timestamps)."""

    frames: list[Any]
    rate: float
    times: list[float]


def sample_video(
    source: str | Path | Sequence[Any], *, patch_size: int, fps: float, max_frames: int, min_pixels: int,
    max_pixels: int, total_pixels: int,
) -> SampledVideo:  # fmt: skip
    """A video's frames as the model sees them, their sampling rate and times, as ROLL's ``data_args.video_*`` make
    them (qwen-vl-utils' ``fetch_video``): a file (``source`` a path) sampled at ``fps``
    (:func:`rl_engines.video.frame_count`, :func:`~rl_engines.video.frame_indices`; the rate is then
    ``count / total * video_fps``, a frame's time its index / ``video_fps``); a list of frame images (paths or PIL
    images, each first resized to the pixel bounds in multiples of 4 x the patch, as ROLL does) kept whole, the last
    repeated to an even count, at :data:`~rl_engines.video.FRAME_LIST_FPS` (frame ``i`` at ``i / FRAME_LIST_FPS`` s,
    as ROLL numbers them). Every frame is then resized (bicubic) to :func:`~rl_engines.video.frame_size`."""
    from PIL import Image

    from rl_engines.video import FRAME_FACTOR, FRAME_LIST_FPS, frame_count, frame_indices, frame_size, smart_size

    if isinstance(source, (str, Path)):
        picked: dict[str, Any] = {}

        def wanted(total: int, rate: float) -> list[int]:
            count = frame_count(total, rate, fps=fps, max_frames=max_frames)
            picked.update(rate=count / total * rate, indices=frame_indices(total, count))
            return list(picked["indices"])

        frames, video_fps = read_frames(source, wanted)
        rate, times = picked["rate"], [index / video_fps for index in picked["indices"]]
    else:
        frames = [Image.open(f).convert("RGB") if isinstance(f, (str, Path)) else f.convert("RGB") for f in source]
        if not frames:
            raise ValueError("a video given as frames needs at least one frame.")
        # each frame first as ROLL's fetch_video reads it: fetch_image(..., image_factor) takes the factor as its patch
        # size, so the frames are sized in multiples of 4 x the patch (56), then the video's resize below (28)
        sizes = [smart_size(f.height, f.width, factor=4 * patch_size, min_pixels=min_pixels, max_pixels=max_pixels)
                 for f in frames]  # fmt: skip
        frames = [f.resize((w, h), Image.Resampling.BICUBIC) for f, (h, w) in zip(frames, sizes, strict=True)]
        frames += [frames[-1]] * (-len(frames) % FRAME_FACTOR)
        rate, times = FRAME_LIST_FPS, [index / FRAME_LIST_FPS for index in range(len(frames))]
    width, height = frames[0].size
    size = frame_size(height, width, len(frames), factor=2 * patch_size, min_pixels=min_pixels,
                      max_pixels=max_pixels, total_pixels=total_pixels)  # fmt: skip
    resized = [frame.resize((size[1], size[0]), Image.Resampling.BICUBIC) for frame in frames]
    return SampledVideo(resized, rate, times)


def record_video(
    record: dict[str, Any], options: VideoOptions | None, patch_size: int, where: str
) -> list[SampledVideo]:
    """The record's one video, sampled (``[]`` when it has none). A record with a video and no video options (no
    ``video_*`` data key and no video layout) is read with ROLL's defaults."""
    source = record.get(VIDEO_KEY)
    if source is None or source == [] or source == "":
        return []
    return [(options or VideoOptions()).sample(source, patch_size, where)]


QUESTION = (
    "{Question}\n"
    "Please think about this question as if you were a human pondering deeply. "
    "Engage in an internal dialogue using expressions such as 'let me think', 'wait', 'Hmm', 'oh, I see', "
    "'let's break it down', etc, or other natural language thought expressions "
    "It's encouraged to include self-reflection or verification in the reasoning process. "
    "Provide your detailed reasoning between the <think> </think> tags, and then give your final answer between the "
    "<answer> </answer> tags."
)
"""Video-R1's question template, as ROLL's ``video_r1_format_prompt`` writes it."""
TYPE_INSTRUCTIONS = {
    "multiple choice": " Please provide only the single option letter (e.g., A, B, C, D, etc.) within the <answer> "
    "</answer> tags.",
    "numerical": " Please provide the numerical value (e.g., 42 or 3.14) within the <answer> </answer> tags.",
    "OCR": " Please transcribe text from the image/video clearly and provide your text answer within the <answer> "
    "</answer> tags.",
    "free-form": " Please provide your text answer within the <answer> </answer> tags.",
    "regression": " Please provide the numerical value (e.g., 42 or 3.14) within the <answer> </answer> tags.",
}
"""The instruction appended for each ``problem_type``."""


def video_r1_record(row: dict[str, Any], prompt_key: str, where: str) -> dict[str, Any]:
    """A Video-R1 row as ROLL's ``video_r1_encode_function`` encodes it: ``prompt_key`` holds the chat (one user turn:
    ``<video>``, the question template and the instruction for its ``problem_type``), ``ground_truth`` =
    ``solution``, ``reward_model`` = ``problem_type`` (the Video-R1 reward grades by it) and ``tag`` =
    ``modality_type`` (the reward section's ``tag_included``)."""
    missing = [key for key in ("problem", "problem_type", "solution") if key not in row]
    if missing:
        raise DataError(f"{where}: the Video-R1 layout (data_args.custom_data_kwargs_func={VIDEO_R1}) needs the "
                        f"columns {missing}; the row has {sorted(row)}.")  # fmt: skip
    kind, modality = row["problem_type"], row.get("modality_type")
    if kind not in TYPE_INSTRUCTIONS:
        raise DataError(f"{where}: problem_type={kind!r} is not one of Video-R1's {list(TYPE_INSTRUCTIONS)}.")
    if modality != "video":
        raise DataError(f"{where}: modality_type={modality!r}; the Video-R1 layout is read for video records here. "
                        "Give image questions in ROLL's VLM layout (an images column).")  # fmt: skip
    content = "<video>" + QUESTION.format(Question=row["problem"]) + TYPE_INSTRUCTIONS[kind]
    return {**row, prompt_key: [{"role": "user", "content": content}], "ground_truth": row["solution"],
            "reward_model": kind, "tag": modality}  # fmt: skip
