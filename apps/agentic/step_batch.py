"""Samples between the rollout and training (ROLL's agentic pipeline, in its order; step 2 applies to whole episodes
too, as ROLL adjusts every batch):

1. ``step_rewards`` column: each turn's discounted return over the later turns of its episode (``step_reward_gamma``;
   only gigpo and step_reinforce read it), computed before any sample is copied or dropped;
2. ``batch_adjust_mode``: the number of step samples varies with the episodes' lengths, so it is made a multiple of
   ROLL's ``size_divide`` = lcm(actor_train's global batch, actor_train's and the reference's ``infer_batch_size`` x
   data-parallel size, and a running critic's two: gae) by ``copy`` (random samples duplicated and trained twice),
   ``delete`` (random samples dropped), ``auto`` (ROLL's rule, copy when the remainder is at least half the batch or
   the batch is below one multiple, comes down to: copy below one multiple, else delete) or ``random_sample``
   (exactly one multiple kept); ``delete`` and ``random_sample`` copy instead below one multiple. The random picks
   come from a generator
   seeded by (seed, step), so a resumed or replayed run adjusts the same way (ROLL's are unseeded);
3. the rewards to train on: the estimator of ``rl_core.step_rewards`` for gigpo / step_reinforce (over the adjusted
   batch, copies included, as ROLL), else the step scores normalised by ``reward_normalization``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from apps.agentic.config import AgenticConfig
from apps.common.preflight import parallel_layout, train_plan
from rl_core.agentic_rewards import normalize_agentic_rewards
from rl_core.batch import RolloutBatch
from rl_core.batch_size import TrainBatchPlan
from rl_core.step_rewards import STEP_ESTIMATORS, discounted_step_returns
from rl_engines.config import WorkerConfig


def size_divisor(config: AgenticConfig, sections: dict[str, WorkerConfig]) -> int:
    """ROLL's ``size_divide``: the step-sample count every training and scoring call divides evenly."""
    sizes = []
    for role in ("actor_train", "reference", "critic"):
        section = sections.get(role)
        if section is None:  # not running: a reference left off, a critic outside gae (as in ROLL)
            continue
        dp = parallel_layout(section).data_parallel_size(role)
        sizes.append(section.infer_batch_size * dp)
        if role != "reference":
            args = section.training_args
            sizes.append(args.per_device_train_batch_size * args.gradient_accumulation_steps * dp)
    return math.lcm(*sizes)


def train_plans(config: AgenticConfig, sections: dict[str, WorkerConfig], samples: int) -> dict[str, TrainBatchPlan]:
    """The training roles' batch plans for a step of ``samples`` step samples (a multiple of ``size_divisor``)."""
    roles = [role for role in ("actor_train", "critic") if role in sections]
    return {role: train_plan(config.base, role, sections[role], samples=samples) for role in roles}


def with_step_returns(rollout: RolloutBatch, gamma: float) -> RolloutBatch:
    """``rollout`` with the ``step_rewards`` tensor: each turn's discounted return within its episode."""
    columns = rollout.non_tensor_batch
    scores = torch.as_tensor(np.asarray(columns["step_scores"], dtype=np.float32))
    rollout.batch["step_rewards"] = discounted_step_returns(scores, columns["traj_id"], columns["step"], gamma)
    return rollout


def resolved_mode(size: int, mode: str, divisor: int) -> str:
    """What ``batch_adjust_mode`` does to ``size`` samples that ``divisor`` does not divide (ROLL's rules): ``auto``
    copies when the remainder is at least half the batch or the batch is below ``divisor``, else deletes; ``delete``
    and ``random_sample`` copy when the batch is below ``divisor``."""
    remainder = size % divisor
    if mode == "auto":
        mode = "copy" if remainder >= 0.5 * size or size < divisor else "delete"
    if mode in ("delete", "random_sample") and size < divisor:
        mode = "copy"
    return mode


def adjusted_size(size: int, mode: str, divisor: int) -> int:
    """The sample count :func:`adjust_batch` leaves of ``size`` samples."""
    remainder = size % divisor
    if remainder == 0:
        return size
    return {"delete": size - remainder, "random_sample": divisor}.get(resolved_mode(size, mode, divisor),
                                                                        size + divisor - remainder)  # fmt: skip


def adjust_batch(
    rollout: RolloutBatch, mode: str, divisor: int, rng: np.random.Generator
) -> tuple[RolloutBatch, dict[str, float]]:
    """``rollout`` resized to a multiple of ``divisor`` by ``mode`` (module docstring); returns it and ROLL's
    ``system/batch_add_count`` / ``system/batch_remove_count``."""
    size = len(rollout)
    remainder = size % divisor
    counts = {"system/batch_add_count": 0.0, "system/batch_remove_count": 0.0}
    if remainder == 0:
        return rollout, counts
    mode = resolved_mode(size, mode, divisor)
    if mode == "delete":
        drop = set(rng.choice(size, remainder, replace=False).tolist())
        counts["system/batch_remove_count"] = float(remainder)
        return rollout.index([i for i in range(size) if i not in drop]), counts
    if mode == "random_sample":
        keep = np.sort(rng.choice(size, divisor, replace=False))
        counts["system/batch_remove_count"] = float(size - divisor)
        return rollout.index(keep), counts
    extra = divisor - remainder
    copies = rng.choice(size, extra, replace=extra > size)
    counts["system/batch_add_count"] = float(extra)
    return rollout.index(np.concatenate([np.arange(size), copies])), counts


def step_sample_rewards(rollout: RolloutBatch, config: AgenticConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """The rewards to train on (ROLL's ``response_level_rewards``) and their metrics: step samples through the step
    estimators, otherwise (whole episodes too) the scores normalised by ``reward_normalization``."""
    columns, norm = rollout.non_tensor_batch, config.reward_normalization
    groups, tags = list(columns["traj_group_id"]), list(columns["tag"])
    estimator = config.base.adv_estimator
    types = {"mean_type": norm.norm_mean_type, "std_type": norm.norm_std_type}
    if estimator not in STEP_ESTIMATORS:
        scores = rollout.batch["scores"]
        return normalize_agentic_rewards(scores, groups, norm.grouping, norm.core_method, tags=tags, **types), {}
    episode_scores = torch.as_tensor(np.asarray(columns["episode_scores"], dtype=np.float32))
    out = STEP_ESTIMATORS.get(estimator)(
        episode_scores, rollout.batch["step_rewards"], groups, list(columns["state_hash"]), grouping=norm.grouping,
        method=norm.core_method, tags=tags, episode_weight=config.episode_reward_weight,
        step_weight=config.step_reward_weight, **types,
    )  # fmt: skip
    metrics: dict[str, Any] = {"critic/step_rewards_norm/mean": float(out.step.mean())}
    if out.episode is not None:
        metrics["critic/episode_rewards_norm/mean"] = float(out.episode.mean())
    if out.state_group_sizes is not None:
        sizes = out.state_group_sizes.float()
        metrics.update({"system/state_batch_size/max": float(sizes.max()), "system/state_batch_size/mean":
                        float(sizes.mean()), "system/state_batch_size/min": float(sizes.min())})  # fmt: skip
    return out.rewards, metrics
