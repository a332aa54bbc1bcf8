"""ROLL's VLTrajEnvManager: multi-turn episodes whose observations are pictures, for vision-language models.

Each turn's user message is ``pre_step_template`` (``{turn_idx}``; the first turn's opens with the environment's
instructions), the observation and ``next_step_template`` (``{actions_left}``, ``{max_response_length}``), as ROLL
formats it. With ``env_config.render_mode: rgb_array`` the observation is the environment's picture
(``render("rgb_array")``: Sokoban's and FrozenLake's grids drawn as coloured cells), put in the message as the model's
vision block, its image pads expanded to the picture's tokens by the model's own image processor; with ``text`` it is
the text observation. The episode's context keeps every picture it holds, in order: each generate call sends them
with the context (``multi_modal_inputs``), and the episode's training sample carries them, so every role scores and
trains on exactly the pictures the model saw when it sampled. Everything else (one sample per episode, the tokens
kept as sampled, rewards) is ``TrajectoryRunner``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from PIL import Image

from apps.agentic.env_manager import EnvManager
from apps.agentic.rollout import Episode, TrajectoryRunner
from rl_core.batch import RolloutBatch
from rl_engines.config import GeneratingArgs
from rl_engines.vision import (
    IMAGE_PAD,
    VISION_END,
    VISION_START,
    VISUAL_KEY,
    encode_images,
    is_vl_model,
    load_image_processor,
    merge_size,
    visual_column,
)


class VisionTrajectoryRunner(TrajectoryRunner):
    """``TrajectoryRunner`` for a manager with VLTrajEnvManager tags (its other tags run as text episodes)."""

    def __init__(self, manager: EnvManager, tokenizer: Any, generating: GeneratingArgs, sequence_length: int,
                 processor: Any, record_frames: bool = False) -> None:  # fmt: skip
        super().__init__(manager, tokenizer, generating, sequence_length, record_frames)
        self.processor = processor
        self.merge = merge_size(processor)

    def _user_text(self, episode: Episode, turn: int) -> tuple[str, list[dict[str, torch.Tensor]]]:
        spec = episode.slot.spec
        if not spec.visual:
            return super()._user_text(episode, turn)
        assert spec.pre_step_template is not None and spec.next_step_template is not None  # config validation
        before = spec.pre_step_template.format(turn_idx=turn)
        if turn == 1:  # ROLL: the environment's instructions, then the first turn
            before = episode.slot.env.instructions + before
        after = spec.next_step_template.format(actions_left=spec.max_steps - turn + 1,
                                               max_response_length=spec.max_tokens_per_step)  # fmt: skip
        observation, pictures = self._observation(episode)
        return before + observation + after, pictures

    def _observation(self, episode: Episode) -> tuple[str, list[dict[str, torch.Tensor]]]:
        """The observation as the message shows it: the picture's vision block (``render_mode: rgb_array``) with
        its visual inputs, or the text observation."""
        env = episode.slot.env
        if episode.slot.spec.env_config.get("render_mode") != "rgb_array":
            return episode.observation, []
        frame = env.render("rgb_array")
        if isinstance(frame, str):
            raise ValueError(
                f"custom_envs.{episode.slot.tag}: env_type {episode.slot.spec.env_type!r} draws no picture"
            )
        visual = encode_images(self.processor, [Image.fromarray(frame)])
        pads = int(visual["image_grid_thw"][0].prod()) // self.merge**2
        return f"{VISION_START}{IMAGE_PAD * pads}{VISION_END}", [visual]

    def _context_columns(self, episodes: Sequence[Episode]) -> dict[str, list[Any]]:
        return {VISUAL_KEY: list(visual_column(context_pictures(e) for e in episodes))}

    def to_batch(self, episodes: Sequence[Episode]) -> RolloutBatch:
        """One sample per episode, with the pictures of its context."""
        batch = super().to_batch(episodes)
        batch.non_tensor_batch[VISUAL_KEY] = visual_column(context_pictures(e) for e in episodes)
        return batch


def context_pictures(episode: Episode) -> dict[str, torch.Tensor]:
    """The visual inputs of an episode's context: its pictures' patches and grids concatenated in order (``{}``
    without pictures)."""
    if not episode.pictures:
        return {}
    return {key: torch.cat([picture[key] for picture in episode.pictures]) for key in episode.pictures[0]}


def load_vl_processor(model_path: str, role: str) -> Any:
    """The image processor of the VL model at ``model_path``; a text model is refused naming the key."""
    if not is_vl_model(model_path):
        raise ValueError(
            f"{role}.model_args.model_name_or_path={model_path!r} is not a vision-language model, but an env manager "
            "runs VLTrajEnvManager tags (their observations are pictures); use a Qwen2-VL / Qwen2.5-VL / Qwen3-VL "
            "model or the text TrajEnvManager."
        )
    return load_image_processor(model_path)
