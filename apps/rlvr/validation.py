"""Validation every ``eval_steps``: the ``validation`` section's prompts, its sampling, the same rewards.

Generation runs on actor_infer (synced with the latest weights), in ``val_batch_size`` prompts at a time; the
last batch is padded to the inference world size and the padding is dropped before scoring. Reported as
``val/score/mean`` (and per reward section, ``val/score/<name>``). rollout_mock dumps / replays the scored
validation rollout of each evaluated step as split ``val``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from apps.common.padding import padded_indices
from apps.rlvr.config import RLVRConfig
from apps.rlvr.data import load_records, record_layout
from apps.rlvr.rewards import RewardRouter
from apps.rlvr.rollout import PromptSource
from apps.rlvr.video_data import VIDEO_KEYS, VideoOptions
from apps.rlvr.vl_data import image_processor
from rl_core.batch import RolloutBatch
from rl_engines.config import GeneratingArgs
from rl_replay import RolloutReplay


class Validator:
    """Scores the validation set with the current policy."""

    def __init__(
        self,
        prompts: PromptSource,
        router: RewardRouter,
        generating: GeneratingArgs,
        batch_size: int,
        replay: RolloutReplay | None = None,
        max_steps: int = 0,
    ) -> None:
        self.prompts, self.router, self.generating, self.batch_size = prompts, router, generating, batch_size
        self.max_steps = max_steps  # the rewards' sense of training progress (the detection reward's dynamic IoU)
        self.get_rollout = self._rollout if replay is None else replay.wrap(self._rollout, split="val", step="step")

    @classmethod
    def from_config(
        cls, config: RLVRConfig, train_prompts: PromptSource, router: RewardRouter, replay: RolloutReplay | None = None,
        log: Callable[[str], None] = print,
    ) -> Validator:  # fmt: skip
        """Validation data (``validation.data_args.file_name``) and sampling; the prompts ROLL drops for their length
        are dropped (``log`` says how many). A text model's prompts are encoded as training's (its columns,
        templates), as ROLL's RLVR pipeline encodes both with one encode_function; a vision-language model's read
        validation's own ``data_args`` (columns, template, pixel bounds, video sampling), as ROLL's VLM pipeline."""
        assert config.validation is not None
        data_args = config.validation.data_args
        files = data_args.get("file_name")
        if not files:
            raise ValueError(
                "validation.data_args.file_name is not set; give the validation prompts or drop eval_steps."
            )
        prompt_key, messages_key, template = (
            train_prompts.prompt_key,
            train_prompts.messages_key,
            train_prompts.template,
        )
        if train_prompts.image_processor is not None:
            prompt_key = data_args.get("prompt", prompt_key if "messages" not in data_args else None)
            messages_key = data_args.get("messages", messages_key if prompt_key is None else None)
            template = config.global_template or data_args.get("template", template)
        records = load_records(files, prompt_key=prompt_key, messages_key=messages_key,
                               layout=record_layout(data_args, "validation"))  # fmt: skip
        processor = train_prompts.image_processor
        if processor is not None and ("image_min_pixels" in data_args or "image_max_pixels" in data_args):
            processor = image_processor(config, data_args)  # its own pixel bounds
        videos = train_prompts.videos
        if any(key in data_args for key in VIDEO_KEYS):
            videos = VideoOptions.from_data_args(data_args)  # its own sampling
        prompts, dropped = replace(train_prompts, records=records, prompt_key=prompt_key, messages_key=messages_key,
                                   template=str(template), image_processor=processor,
                                   videos=videos).within_prompt_length("validation")  # fmt: skip
        if dropped:
            log(dropped)
        router.check_records(prompts.records, "validation")
        batch_size = config.val_batch_size or len(prompts.records)
        return cls(prompts, router, config.validation.generating_args, batch_size, replay, config.max_steps)

    def __call__(self, roles: Any, step: int) -> dict[str, float]:
        """Generate for every validation prompt and average the rewards (``val/score/...``)."""
        return self.metrics(self.get_rollout(roles=roles, step=step))

    def _rollout(self, *, roles: Any, step: int) -> RolloutBatch:
        """Every validation prompt's responses with ``scores``; rollout_mock dumps / replays this (split val)."""
        world = roles["actor_infer"].world_size
        everything = list(range(len(self.prompts.records)))
        parts = []
        for start in range(0, len(everything), self.batch_size):
            indices = everything[start : start + self.batch_size]
            padded = padded_indices(indices, world)
            batch = self.prompts.batch(padded, [f"val:{i}" for i in padded])
            rollout = roles["actor_infer"].call("generate", batch, self.generating, dispatch="dp_split")
            parts.append(rollout.slice(0, len(indices) * self.generating.num_return_sequences))  # padding is last
        rollout = RolloutBatch.concat(parts)
        self.prompts.grade(rollout, self.router, step, self.max_steps)
        return rollout

    def metrics(self, rollout: RolloutBatch) -> dict[str, float]:
        """``validation_metrics`` of the scored rollout."""
        records = self.prompts.records_of(rollout)
        return validation_metrics(rollout.batch["scores"].tolist(), records, self.router.section_for)


def validation_metrics(
    scores: list[float], records: list[dict[str, Any]], section_for: Callable[[dict[str, Any]], str]
) -> dict[str, float]:
    """Mean score overall and per reward section (``val/score/...``), and ROLL's names: the fraction of fully right
    answers (score 1) overall and per data tag (``val_correct/all/mean``, ``val_correct/<tag>/mean``)."""
    per_section: dict[str, list[float]] = {}
    per_tag: dict[str, list[float]] = {}
    for score, record in zip(scores, records):
        per_section.setdefault(section_for(record), []).append(score)
        if record.get("tag") is not None:
            per_tag.setdefault(str(record["tag"]), []).append(float(score == 1.0))
    metrics = {"val/score/mean": sum(scores) / max(len(scores), 1), "val/samples": float(len(scores)),
               "val_correct/all/mean": sum(score == 1.0 for score in scores) / max(len(scores), 1)}  # fmt: skip
    metrics.update({f"val/score/{name}": sum(v) / len(v) for name, v in per_section.items()})
    metrics.update({f"val_correct/{tag}/mean": sum(v) / len(v) for tag, v in per_tag.items()})
    return metrics
