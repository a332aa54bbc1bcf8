"""Validation every ``eval_steps``: the ``validation`` section's prompts, its sampling, the same rewards.

Generation runs on actor_infer (synced with the latest weights), in ``val_batch_size`` prompts at a time; the
last batch is padded to the inference world size and the padding is dropped before scoring. Reported as
``val/score/mean`` (and per reward section, ``val/score/<name>``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from apps.rlvr.config import RLVRConfig
from apps.rlvr.data import load_records
from apps.rlvr.rewards import RewardRouter
from apps.rlvr.rollout import PromptSource, padded_indices
from rl_engines.config import GeneratingArgs


class Validator:
    """Scores the validation set with the current policy."""

    def __init__(
        self, prompts: PromptSource, router: RewardRouter, generating: GeneratingArgs, batch_size: int
    ) -> None:
        self.prompts, self.router, self.generating, self.batch_size = prompts, router, generating, batch_size

    @classmethod
    def from_config(cls, config: RLVRConfig, train_prompts: PromptSource, router: RewardRouter) -> Validator:
        """Validation data (``validation.data_args``, prompt / messages columns as for training) and sampling."""
        assert config.validation is not None
        data_args = config.validation.data_args
        files = data_args.get("file_name")
        if not files:
            raise ValueError(
                "validation.data_args.file_name is not set; give the validation prompts or drop eval_steps."
            )
        prompt_key = data_args.get("prompt", train_prompts.prompt_key if "messages" not in data_args else None)
        messages_key = data_args.get("messages", train_prompts.messages_key if prompt_key is None else None)
        records = load_records(files, prompt_key=prompt_key, messages_key=messages_key)
        prompts = replace(train_prompts, records=records, prompt_key=prompt_key, messages_key=messages_key,
                          template=str(data_args.get("template", train_prompts.template)))  # fmt: skip
        return cls(prompts, router, config.validation.generating_args, config.val_batch_size or len(records))

    def __call__(self, roles: Any) -> dict[str, float]:
        """Generate for every validation prompt and average the rewards."""
        world = roles["actor_infer"].world_size
        total, count = 0.0, 0
        per_section: dict[str, list[float]] = {}
        everything = list(range(len(self.prompts.records)))
        for start in range(0, len(everything), self.batch_size):
            indices = everything[start : start + self.batch_size]
            padded = padded_indices(indices, world)
            batch = self.prompts.batch(padded, [f"val:{i}" for i in padded])
            rollout = roles["actor_infer"].call("generate", batch, self.generating, dispatch="dp_split")
            keep = len(indices) * self.generating.num_return_sequences  # padding comes last
            rollout = rollout.slice(0, keep)
            scores = self.prompts.scores(rollout, self.router)
            total += float(scores.sum())
            count += len(scores)
            for row, score in enumerate(scores.tolist()):
                record = self.prompts.records[int(rollout.non_tensor_batch["record_index"][row])]
                per_section.setdefault(self.router.section_for(record), []).append(score)
        metrics = {"val/score/mean": total / max(count, 1), "val/samples": float(count)}
        metrics.update({f"val/score/{name}": sum(v) / len(v) for name, v in per_section.items()})
        return metrics
