"""Trajectories as files a person can read: one text file per episode (each turn's observation, the model's
response, the parsed action and the reward) and, when the environment draws itself, one PNG with the frames side
by side. Written under ``render_save_dir/step_<n>/``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from apps.common.plots import quiet_matplotlib

if TYPE_CHECKING:
    from apps.agentic.rollout import Episode

GAP = 4
"""White pixels between two frames of the PNG strip."""


def episode_text(episode: Episode) -> str:
    """The episode's turns as plain text."""
    head = (f"env {episode.slot.tag} (slot {episode.slot.index}, group {episode.slot.group}), seed {episode.seed}: "
            f"{'success' if episode.success else 'no success'}, reward {sum(episode.rewards):.3f}, "
            f"{len(episode.rewards)} turns")  # fmt: skip
    lines = [head, ""]
    for turn, frame in enumerate(episode.frames):
        lines += [f"--- state {turn} ---", frame["observation"]]
        if "response" in frame:
            lines += [f"model: {frame['response']!r}", f"action: {frame['action']}  reward: {frame['reward']:.3f}"]
    return "\n".join(lines) + "\n"


def frame_strip(images: Sequence[np.ndarray]) -> np.ndarray:
    """Frames ``[H, W, 3]`` (uint8) side by side, padded to the tallest, separated by white gaps."""
    height = max(image.shape[0] for image in images)
    parts = []
    for image in images:
        padded = np.full((height, image.shape[1], 3), 255, dtype=np.uint8)
        padded[: image.shape[0]] = image
        parts += [padded, np.full((height, GAP, 3), 255, dtype=np.uint8)]
    return np.concatenate(parts[:-1], axis=1)


def render_episodes(episodes: Sequence[Episode], folder: Path) -> Path:
    """Write ``<i>_<tag>.txt`` (and ``.png`` when frames have images) for every episode; returns ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    for number, episode in enumerate(episodes):
        stem = folder / f"{number:04d}_{episode.slot.tag}"
        stem.with_suffix(".txt").write_text(episode_text(episode), encoding="utf-8")
        images = [frame["image"] for frame in episode.frames if isinstance(frame.get("image"), np.ndarray)]
        if images:
            quiet_matplotlib()
            import matplotlib.image

            matplotlib.image.imsave(stem.with_suffix(".png"), frame_strip(images))
    return folder
