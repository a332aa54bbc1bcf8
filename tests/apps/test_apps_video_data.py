"""Sampling a video as ROLL's ``data_args.video_*`` ask (issue 23): how many frames, which ones, at what size and rate,
from a video file decoded with PyAV or from a list of frame images. Expected values are worked out by hand from
qwen-vl-utils' rules (ROLL's roll/utils/qwen_vl_utils.py), not by calling the code under test twice."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from apps.rlvr.video_data import read_frames, sample_video
from rl_engines.video import frame_count, frame_indices, frame_size

av = pytest.importorskip("av")

BOUNDS = {"min_pixels": 128 * 28 * 28, "max_pixels": 128 * 28 * 28, "total_pixels": 12288 * 28 * 28}
"""video_r1.yaml's video_min_pixels / video_max_pixels / video_total_pixels."""


def test_frame_counts_follow_the_rate_and_the_bounds():
    assert frame_count(300, 30.0, fps=2.0, max_frames=192) == 20  # 10 s at 2 fps
    assert frame_count(301, 30.0, fps=2.0, max_frames=192) == 20  # 20.07 rounded down to an even count
    assert frame_count(30, 30.0, fps=2.0, max_frames=192) == 4  # 1 s: 2 frames, raised to the minimum of 4
    assert frame_count(3000, 30.0, fps=2.0, max_frames=15) == 14  # capped by max_frames, rounded down to even
    assert frame_count(5, 1.0, fps=2.0, max_frames=192) == 4  # never more than the video holds, even
    with pytest.raises(ValueError, match="at least 2"):
        frame_count(1, 30.0, fps=2.0, max_frames=192)


def test_indices_spread_evenly_and_keep_both_ends():
    assert frame_indices(10, 4) == [0, 3, 6, 9]
    assert frame_indices(300, 20)[:3] == [0, 16, 31] and frame_indices(300, 20)[-1] == 299  # 299 / 19 = 15.74 apart


def test_frame_size_keeps_the_aspect_within_the_budget():
    # 640 x 480 at factor 28: 476 x 644 = 306,544 pixels > the 100,352 bound, so scaled by sqrt(307200 / 100352)
    assert frame_size(480, 640, 20, factor=28, **BOUNDS) == (252, 364)
    # with 1000 frames the share of total_pixels (19,268) is below 1.05 * min_pixels (105,369), so that is the cap,
    # and max_pixels (100,352) still binds
    assert frame_size(480, 640, 1000, factor=28, **BOUNDS) == (252, 364)
    small = {"min_pixels": 4 * 28 * 28, "max_pixels": 2048 * 2048, "total_pixels": 64 * 28 * 28}
    # the share: 64 * 784 / 32 * 2 = 3136 < 1.05 * 3136 = 3292 pixels: scaled by sqrt(307200 / 3292) = 9.66
    assert frame_size(480, 640, 32, factor=28, **small) == (28, 56)
    # 20 x 30 rounds to 28 x 28 = 784 < 3136: scaled up by sqrt(3136 / 600) = 2.29 and rounded up
    assert frame_size(20, 30, 4, factor=28, min_pixels=4 * 28 * 28, max_pixels=10**6, total_pixels=10**8) == (56, 84)


def write_video(path, colours, fps, codec, size=(64, 48)):
    """A video whose frame ``i`` is one solid grey level ``colours[i]``."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p" if codec == "mpeg4" else "rgb24"  # png frames: lossless RGB
        for level in colours:
            frame = av.VideoFrame.from_ndarray(np.full((size[1], size[0], 3), level, np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())


def grey(frame: Image.Image) -> float:
    return float(np.asarray(frame, dtype=np.float32).mean())


def test_a_lossless_file_gives_the_sampled_frames_and_their_rate(tmp_path):
    path = tmp_path / "clip.mov"
    write_video(path, [8 * i for i in range(30)], fps=10, codec="png")  # 3 s at 10 fps
    video = sample_video(path, patch_size=14, fps=2.0, max_frames=192, **BOUNDS)
    frames, rate = video.frames, video.rate
    assert len(frames) == 6 and rate == pytest.approx(6 / 30 * 10)  # 3 s x 2 fps
    assert video.times == pytest.approx([i / 10 for i in (0, 6, 12, 17, 23, 29)])  # index / the clip's 10 fps
    assert [round(grey(f)) for f in frames] == [8 * i for i in frame_indices(30, 6)] == [0, 48, 96, 136, 184, 232]
    # 48 x 64 rounds to 56 x 56, below the 100,352-pixel floor: scaled up by sqrt(100352 / 3072) = 5.72, rounded up
    assert {f.size for f in frames} == {(392, 280)}


def test_an_mp4_reads_with_its_rate(tmp_path):
    path = tmp_path / "clip.mp4"
    write_video(path, [10 * i for i in range(24)], fps=8, codec="mpeg4")  # 3 s at 8 fps, lossy
    frames, rate = read_frames(path, lambda total, fps: [0, total - 1])
    assert rate == pytest.approx(8.0) and len(frames) == 2
    assert grey(frames[0]) == pytest.approx(0, abs=4) and grey(frames[1]) == pytest.approx(230, abs=4)


def test_a_container_without_a_frame_count_is_counted_by_decoding(tmp_path):
    path = tmp_path / "clip.mkv"  # Matroska announces no frame count
    write_video(path, [10 * i for i in range(20)], fps=10, codec="mpeg4")
    with av.open(str(path)) as container:
        assert container.streams.video[0].frames == 0
    video = sample_video(path, patch_size=14, fps=2.0, max_frames=192, **BOUNDS)
    assert video.rate == pytest.approx(2.0) and video.times == pytest.approx([0.0, 0.6, 1.3, 1.9])  # 0, 6, 13, 19
    assert [round(grey(f) / 10) for f in video.frames] == [0, 6, 13, 19]


def test_a_list_of_frames_is_kept_whole_at_two_fps(tmp_path):
    paths = []
    for i in range(3):
        paths.append(tmp_path / f"{i}.png")
        Image.new("RGB", (64, 48), (40 * i,) * 3).save(paths[-1])
    video = sample_video(paths, patch_size=14, fps=5.0, max_frames=2, **BOUNDS)
    frames, rate = video.frames, video.rate
    assert video.times == [0.0, 0.5, 1.0, 1.5]  # numbered as ROLL does, the repeated frame too
    assert rate == 2.0 and [round(grey(f)) for f in frames] == [0, 40, 80, 80]  # padded to even, not sampled
    # each frame first to the image bounds (280 x 392, as above), then the video's: 109,760 > 100,352 pixels
    assert {f.size for f in frames} == {(364, 252)}


def test_missing_and_unreadable_files_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nothing\.mp4 does not exist"):
        sample_video(tmp_path / "nothing.mp4", patch_size=14, fps=2.0, max_frames=8, **BOUNDS)
    (tmp_path / "bad.mp4").write_bytes(b"not a video")
    with pytest.raises(ValueError, match=r"bad\.mp4: cannot decode"):
        sample_video(tmp_path / "bad.mp4", patch_size=14, fps=2.0, max_frames=8, **BOUNDS)
